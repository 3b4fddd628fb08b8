"""PPMoE expert parallelism (Pipeline-MoE, arXiv 2304.11414, Sec. 3.3, Algorithm 1) inside Transformers' plans.

The experts of every MoE layer are split evenly over the tensor-parallel group (rank r holds experts
[r*E/N, (r+1)*E/N)). Every rank holds the same hidden states and computes the same routing; each runs its own
experts on the routes that reach them (the others get the sentinel id and are skipped), and one all-reduce sums the
partial outputs: the communication of a tensor-parallel dense FFN, plus the router weight's gradient [E, H].

- "ppmoe_ffn" (FFN slot): an MoE layer becomes a `PPMoELayer`; a dense FFN gets "replicated_input".
- "ppmoe" (`EPImplementationInterface`, `DistributedConfig(ep_implementation="ppmoe")`) and "ppmoe_experts" (the
  tensor-parallel plan's rule): the experts module becomes an `ExpertParallel` one running `PPMoEExperts`.

docs/parallel.md walks through one layer on two ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers.distributed.expert_parallel import EPImplementation, EPImplementationInterface
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
from transformers.distributed.tensor_parallel import TensorParallelLayer

from ..moe.experts import Experts
from ..moe.layer import MoELayer
from .comm import copy_to, reduce_from, scale_grad, sum_grad_over
from .modules import ExpertParallel, TensorParallel, become
from .tensor_parallel import ReplicatedInputParallel

PPMOE = "ppmoe"


def local_expert_ids(expert_ids, first_expert: int, num_local_experts: int):
    """Global expert ids to this rank's local ids; routes to other ranks' experts get the sentinel (skipped)."""
    local = expert_ids - first_expert
    return local.masked_fill((local < 0) | (local >= num_local_experts), num_local_experts)


class PPMoEExperts(EPImplementation):
    """Runs this rank's experts on the routes that reach them. Our MoE layers (`PPMoELayer`) sum the ranks' outputs
    and input gradients themselves, once for the router and the experts together. In any other MoE block (e.g.
    Transformers' own Qwen3-MoE, whose router sits outside the experts) the experts do it: their inputs, the hidden
    states and the routing weights, sum their gradients over the group and their output is summed, so the router
    gets whole gradients on every rank (the communication of Transformers' "all_reduce" EP)."""

    needs_shared_batch = True

    def __init__(self, experts, ep_mesh, tp_mesh):
        super().__init__(experts, ep_mesh, tp_mesh)
        self.first_expert = ep_mesh.get_local_rank() * self.num_local_experts
        self.group = ep_mesh.get_group()
        self.layer_combines = isinstance(experts, Experts)  # ours live in MoE layers, split by "ppmoe_ffn"
        become(
            experts, ExpertParallel, PPMOE, ep_mesh,
            first_expert=self.first_expert, num_global_experts=self.num_local_experts * ep_mesh.size(),
        )

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        local = local_expert_ids(top_k_index, self.first_expert, self.num_local_experts)
        if self.layer_combines:
            return self.experts_forward(hidden_states, local, top_k_weights)
        hidden_states, top_k_weights = copy_to(hidden_states, self.group), copy_to(top_k_weights, self.group)
        return reduce_from(self.experts_forward(hidden_states, local, top_k_weights), self.group)


def share_router_generator(gate, group, device_type: str) -> int:
    """Make the router's random draws (jitter, GShard random routing) identical on every rank of `group`.

    A router that already has a generator gets the state of the group's first rank. Returns a seed drawn on that
    rank, for a router without a generator to seed one with on its first forward (on the device of its input).
    Every rank draws the candidate seed, so their default generators stay in step."""
    src = dist.get_global_rank(group, 0)
    seed = torch.randint(0, 2**62, (1,), device=device_type)
    dist.broadcast(seed, src=src, group=group)
    if gate.generator is not None:
        state = gate.generator.get_state().to(device_type)
        dist.broadcast(state, src=src, group=group)
        gate.generator.set_state(state.cpu())
    return int(seed.item())


class PPMoELayer(TensorParallel, MoELayer):
    """An `MoELayer` on a tensor-parallel group (module docstring): the router replicated with one random generator
    on every rank; when the experts are PPMoE-split (an `ExpertParallel` module with style "ppmoe"), the input
    enters through `copy_to`, the experts' partial output leaves through `reduce_from`, the router weight's gradient
    is summed over the group and the values every rank computes alike (router losses and logits) get 1/N of it."""

    router_seed: int

    def route(self, x, token_mask, compute_losses):
        gate, experts = self.gate, self.experts
        if gate.generator is None:
            gate.generator = torch.Generator(x.device).manual_seed(self.router_seed)
        if not (isinstance(experts, ExpertParallel) and experts.parallel_style == PPMOE):
            return super().route(x, token_mask, compute_losses)  # whole experts here, or all-to-all
        group = experts.mesh.get_group()
        sum_grad_over(gate.weight, group)  # here, not at install: parameters may be replaced by loading
        out, routing = super().route(copy_to(x, group), token_mask, compute_losses)
        out = reduce_from(out, group)
        n = dist.get_world_size(group)
        scaled = {"router_logits": scale_grad(routing.router_logits, 1 / n)}
        if routing.aux_loss is not None:
            scaled.update(aux_loss=scale_grad(routing.aux_loss, 1 / n), z_loss=scale_grad(routing.z_loss, 1 / n))
        return out, routing._replace(**scaled)


class PPMoEFFNParallel(ReplicatedInputParallel):
    """Plan style "ppmoe_ffn" for the FFN slot: an MoE layer becomes a `PPMoELayer`; a dense FFN gets
    "replicated_input", so its colwise projections share one input-gradient all-reduce."""

    def install_forward(self, module, mesh):
        if not isinstance(module, MoELayer):  # a dense FFN
            return super().install_forward(module, mesh)
        seed = share_router_generator(module.gate, mesh.get_group(), mesh.device_type)
        return become(module, PPMoELayer, "ppmoe_ffn", mesh, router_seed=seed)


class PPMoEExpertsParallel(TensorParallelLayer):
    """Plan style "ppmoe_experts": the experts module reached through `PPMoEExperts` on the tensor-parallel mesh."""

    def install_forward(self, module, mesh):
        dispatch = ALL_PARALLEL_STYLES["ep_dispatch_experts"]
        return dispatch.install_forward(module, mesh, tp_mesh=mesh, ep_implementation=PPMOE)


EPImplementationInterface.register(PPMOE, PPMoEExperts)
ALL_PARALLEL_STYLES.register("ppmoe_ffn", PPMoEFFNParallel())
ALL_PARALLEL_STYLES.register("ppmoe_experts", PPMoEExpertsParallel())
