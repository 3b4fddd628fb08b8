"""Model-agnostic MoE building blocks (single device; parallelism is applied from `hf_ppmoe.parallel`)."""

from .balance import LoadBalancer, bias_update
from .experts import EXPERTS_FUNCTIONS, MLP, Experts, einsum_experts, index_experts
from .kernels import CAPABILITIES, capability_table
from .gates import GATES, Gate, GShardGate, PrototypeGate, SwitchGate, TopKGate, get_gate_class, register_gate
from .layer import MoELayer
from .losses import balance_loss, losses_wanted, route_fractions, router_loss, router_z_loss
from .observe import ROUTING_INDEX, RoutingHooks
from .routing import Routing, capacity_for, group_size_for, positions_in_expert

__all__ = [
    "CAPABILITIES",
    "EXPERTS_FUNCTIONS",
    "GATES",
    "Experts",
    "GShardGate",
    "LoadBalancer",
    "Gate",
    "MLP",
    "MoELayer",
    "PrototypeGate",
    "ROUTING_INDEX",
    "Routing",
    "RoutingHooks",
    "SwitchGate",
    "TopKGate",
    "capability_table",
    "capacity_for",
    "einsum_experts",
    "get_gate_class",
    "group_size_for",
    "index_experts",
    "balance_loss",
    "bias_update",
    "losses_wanted",
    "route_fractions",
    "router_loss",
    "positions_in_expert",
    "register_gate",
    "router_z_loss",
]
