"""Expert parallelism inside Transformers' plans: the token dispatchers an MoE layer takes when its experts are
spread over ranks, and the expert-parallel implementations its experts module runs.

PPMoE (Pipeline-MoE, arXiv 2304.11414, Sec. 3.3, Algorithm 1): the experts of every MoE layer are split evenly over
the tensor-parallel group (rank r holds experts [r*E/N, (r+1)*E/N)). Every rank holds the same hidden states and
computes the same routing; each runs its own experts on the routes that reach them (the others get the sentinel id
and are skipped: the index slice), and one all-reduce sums the partial outputs: the communication of a
tensor-parallel dense FFN, plus the routing weights' gradient [T, K] in backward.

- "ppmoe_ffn" (FFN slot): an MoE layer's dispatcher becomes a `PPMoEDispatcher`; a dense FFN gets
  "replicated_input".
- "ppmoe" (`EPImplementationInterface`, `DistributedConfig(ep_implementation="ppmoe")`) and "ppmoe_experts" (the
  tensor-parallel plan's rule): the experts module becomes an `ExpertParallel` one running `PPMoEExperts`.

All-to-all (experts over more ranks than the tensor-parallel group, which read different batches): the experts
module runs Transformers' `AllToAllEP` (`AllToAllWithDrops`) and the layer's dispatcher becomes an
`AllToAllDispatcher`.

docs/parallel.md walks through one layer on two ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers.distributed.expert_parallel import AllToAllEP, EPImplementation, EPImplementationInterface
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
from transformers.distributed.tensor_parallel import TensorParallelLayer

from ..moe.experts import Experts
from ..moe.layer import MoELayer, TokenDispatcher
from .comm import copy_to, reduce_from
from .modules import ExpertParallel, ParallelModule, TensorParallel, become

PPMOE = "ppmoe"
ALL_TO_ALL = "all_to_all_with_drops"


def local_routes(expert_ids, weights, first_expert: int, num_local_experts: int):
    """Global expert ids to this rank's local ids; a route to another rank's expert becomes one that goes nowhere
    here, as the experts' contract writes it (routing.py): the sentinel id and weight 0."""
    local = expert_ids - first_expert
    elsewhere = (local < 0) | (local >= num_local_experts)
    return local.masked_fill(elsewhere, num_local_experts), weights.masked_fill(elsewhere, 0.0)


class PPMoEExperts(EPImplementation):
    """Runs this rank's experts on the routes that reach them (the index slice: every other route goes nowhere
    here). In our MoE layers their `PPMoEDispatcher` dispatches and combines around them; in any other MoE block
    (e.g. Transformers' own Qwen3-MoE, whose router sits outside the experts) the experts do the same themselves:
    their inputs, the hidden states and the routing weights, sum their gradients over the group and their output is
    summed, so the router gets whole gradients on every rank (the communication of Transformers' "all_reduce" EP)."""

    needs_shared_batch = True

    def __init__(self, experts, ep_mesh, tp_mesh):
        super().__init__(experts, ep_mesh, tp_mesh)
        self.first_expert = ep_mesh.get_local_rank() * self.num_local_experts
        self.group = ep_mesh.get_group()
        self.layer_combines = isinstance(experts, Experts)  # ours: their layer's PPMoEDispatcher does it
        become(
            experts, ExpertParallel, PPMOE, ep_mesh,
            first_expert=self.first_expert, num_global_experts=self.num_local_experts * ep_mesh.size(),
        )

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        if not self.layer_combines:  # entered before the routes elsewhere are zeroed: their gradients come from there
            hidden_states, top_k_weights = copy_to(hidden_states, self.group), copy_to(top_k_weights, self.group)
        local, top_k_weights = local_routes(top_k_index, top_k_weights, self.first_expert, self.num_local_experts)
        out = self.experts_forward(hidden_states, local, top_k_weights)
        return out if self.layer_combines else reduce_from(out, self.group)


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


class ReplicatedRouterDispatcher(TokenDispatcher):
    """A dispatcher for a layer whose ranks route the same tokens: the router draws its random numbers (jitter,
    GShard's random routing) from one generator seeded alike on every rank of the group."""

    router_seed: int | None = None

    def route(self, gate, x, token_mask, compute_losses):
        if gate.generator is None and self.router_seed is not None:
            gate.generator = torch.Generator(x.device).manual_seed(self.router_seed)
        return super().route(gate, x, token_mask, compute_losses)


class PPMoEDispatcher(TensorParallel, ReplicatedRouterDispatcher):
    """PPMoE's dispatcher over a tensor-parallel group (module docstring): the router replicated with one random
    generator, so every rank computes the same routing; when the experts are PPMoE-split (an `ExpertParallel`
    module with style "ppmoe"), dispatch hands them the tokens and routing weights through `copy_to` (every rank keeps
    every token; their gradients, partial on each rank, are summed over the group) and combine sums the experts'
    partial outputs with `reduce_from` (one all-reduce). The router's own gradients are whole on every rank, so its
    weight stays replicated without a sum of its own. Experts reached otherwise (Transformers' all-to-all through its
    own entry point) get the tokens as they are."""

    def dispatch(self, x, routing, experts):
        if not _ppmoe_split(experts):
            return super().dispatch(x, routing, experts)
        group = self.mesh.get_group()
        return copy_to(x, group), routing.expert_ids, copy_to(routing.weights, group).to(x.dtype)

    def combine(self, out, routing, experts):
        return reduce_from(out, self.mesh.get_group()) if _ppmoe_split(experts) else out


def _ppmoe_split(experts) -> bool:
    return isinstance(experts, ExpertParallel) and experts.parallel_style == PPMOE


class AllToAllDispatcher(ParallelModule, ReplicatedRouterDispatcher):
    """The dispatcher of a layer whose experts are spread over more ranks than its tensor-parallel group (ranks that
    read different batches): its experts module runs Transformers' all-to-all (`AllToAllWithDrops`), which sends
    each route to the rank holding its expert and brings the outputs back, so the layer hands it the tokens and
    routing as they are. With a tensor-parallel group the router's draws stay shared over it."""


class AllToAllWithDrops(AllToAllEP):
    """Transformers' all-to-all expert parallelism, for gates that drop routes too. A dropped route (sentinel id
    `num_experts`, weight 0) would index past Transformers' per-expert counts; it is sent to this rank's own first
    expert instead (no traffic, one wasted row per dropped route) and its weight 0 removes it from the output and
    from every gradient."""

    def __init__(self, experts, ep_mesh, tp_mesh):
        super().__init__(experts, ep_mesh, tp_mesh)
        n = self.num_local_experts
        become(
            experts, ExpertParallel, ALL_TO_ALL, ep_mesh,
            first_expert=ep_mesh.get_local_rank() * n, num_global_experts=n * ep_mesh.size(),
        )

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        n = self.num_local_experts
        own_first = self.ep_mesh.get_local_rank() * n
        top_k_index = top_k_index.masked_fill(top_k_index >= n * self.ep_mesh.size(), own_first)
        return super().__call__(hidden_states, top_k_index, top_k_weights)


def use_all_to_all_dispatchers(model, ep_mesh) -> None:
    """Give every MoE layer of `model` whose experts run `AllToAllWithDrops` an `AllToAllDispatcher` (keeping the
    shared router seed of the PPMoE dispatcher a tensor-parallel plan gave it)."""
    for layer in model.modules():
        if isinstance(layer, MoELayer) and getattr(layer.experts, "parallel_style", None) == ALL_TO_ALL:
            seed = getattr(layer.dispatcher, "router_seed", None)
            layer.dispatcher = become(TokenDispatcher(), AllToAllDispatcher, ALL_TO_ALL, ep_mesh, router_seed=seed)


class PPMoEExpertsParallel(TensorParallelLayer):
    """Plan style "ppmoe_experts": the experts module reached through `PPMoEExperts` on the tensor-parallel mesh."""

    def install_forward(self, module, mesh):
        dispatch = ALL_PARALLEL_STYLES["ep_dispatch_experts"]
        return dispatch.install_forward(module, mesh, tp_mesh=mesh, ep_implementation=PPMOE)


EPImplementationInterface.register(PPMOE, PPMoEExperts)
EPImplementationInterface.register(ALL_TO_ALL, AllToAllWithDrops)
ALL_PARALLEL_STYLES.register("ppmoe_experts", PPMoEExpertsParallel())
