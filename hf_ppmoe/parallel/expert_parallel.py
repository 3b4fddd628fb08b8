"""Expert parallelism as experts wrappers: an MoE layer stays gate, then experts, and its experts module, split over
ranks, keeps Transformers' experts contract `forward(hidden_states, top_k_index, top_k_weights) -> [T, H]` with the
communication inside. Each wrapper is an `EPImplementation` in Transformers' `EPImplementationInterface`, installed
by its `ep_dispatch_experts` style, and the experts module takes the class `ExpertParallel<its class>`, so
`print(model)` shows which one runs (modules.py).

- "ppmoe" (`PPMoEExperts`; PPMoE, arXiv 2304.11414, Sec. 3.3, Algorithm 1): the experts of every MoE layer are split
  evenly over the tensor-parallel group (rank r holds experts [r*E/N, (r+1)*E/N)). Every rank holds the same hidden
  states and computes the same routing; each runs its own experts on the routes that reach them (the others get the
  sentinel id and are skipped: the index slice), and one all-reduce sums the partial outputs: the communication of a
  tensor-parallel dense FFN, plus the routing weights' gradient [T, K] in backward. Reached by
  `DistributedConfig(ep_implementation="ppmoe")` and by the tensor-parallel plan's style "ppmoe_experts".
- "all_to_all_with_drops" (`AllToAllWithDrops`): experts over more ranks than the tensor-parallel group (ranks that
  read different batches): Transformers' all-to-all, which sends each route to the rank holding its expert and
  brings the outputs back, also for the routes a capacity-limited gate dropped.
- Transformers' own ("all_reduce", "all_to_all") run on our experts as they are.

The router stays outside the experts, replicated: under tensor parallelism the "ppmoe_ffn" style
(tensor_parallel.py) gives every rank's gate the same random draws (`share_router_generator`).

docs/parallel.md walks through one layer on two ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers.distributed.expert_parallel import AllToAllEP, EPImplementation, EPImplementationInterface
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
from transformers.distributed.tensor_parallel import TensorParallelLayer

from .comm import copy_to, reduce_from
from .modules import ExpertParallel, become

PPMOE = "ppmoe"
ALL_TO_ALL = "all_to_all_with_drops"


def local_routes(expert_ids, weights, first_expert: int, num_local_experts: int):
    """Global expert ids to this rank's local ids; a route to another rank's expert becomes one that goes nowhere
    here, as the experts' contract writes it (routing.py): the sentinel id and weight 0."""
    local = expert_ids - first_expert
    elsewhere = (local < 0) | (local >= num_local_experts)
    return local.masked_fill(elsewhere, num_local_experts), weights.masked_fill(elsewhere, 0.0)


def _show(experts, implementation: EPImplementation, style: str) -> None:
    """The experts module as `ExpertParallel<its class>`, naming the style and this rank's experts."""
    n = implementation.num_local_experts
    mesh = implementation.ep_mesh
    become(experts, ExpertParallel, style, mesh, first_expert=mesh.get_local_rank() * n, num_global_experts=n * mesh.size())


class PPMoEExperts(EPImplementation):
    """PPMoE's experts wrapper (module docstring), on any experts module with Transformers' contract (ours, or
    Transformers' Qwen3-MoE and Mixtral experts):

        tokens, weights ─copy_to─> index slice (this rank's routes) ─> experts ─> partial out ─reduce_from─> out

    `copy_to` is the identity forward and sums the tokens' and routing weights' gradients (partial on each rank:
    each backpropagates through its own experts) over the group in backward, so the router outside, replicated, gets
    its whole gradient on every rank with no sum of its own; `reduce_from` is the one all-reduce forward. Transformers'
    "all_reduce" EP is the same with the other ranks' routes masked rather than skipped."""

    needs_shared_batch = True

    def __init__(self, experts, ep_mesh, tp_mesh):
        super().__init__(experts, ep_mesh, tp_mesh)
        self.first_expert = ep_mesh.get_local_rank() * self.num_local_experts
        self.group = ep_mesh.get_group()
        _show(experts, self, PPMOE)

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        hidden_states, top_k_weights = copy_to(hidden_states, self.group), copy_to(top_k_weights, self.group)
        local, top_k_weights = local_routes(top_k_index, top_k_weights, self.first_expert, self.num_local_experts)
        return reduce_from(self.experts_forward(hidden_states, local, top_k_weights), self.group)


class AllToAllWithDrops(AllToAllEP):
    """Transformers' all-to-all expert parallelism, for gates that drop routes too. A dropped route (sentinel id
    `num_experts`, weight 0) would index past Transformers' per-expert counts; it is sent to this rank's own first
    expert instead (no traffic, one wasted row per dropped route) and its weight 0 removes it from the output and
    from every gradient."""

    def __init__(self, experts, ep_mesh, tp_mesh):
        super().__init__(experts, ep_mesh, tp_mesh)
        self.num_global_experts = self.num_local_experts * ep_mesh.size()
        self.own_first = ep_mesh.get_local_rank() * self.num_local_experts
        _show(experts, self, ALL_TO_ALL)

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        top_k_index = top_k_index.masked_fill(top_k_index >= self.num_global_experts, self.own_first)
        return super().__call__(hidden_states, top_k_index, top_k_weights)


def share_router_generator(gate, group, device_type: str) -> None:
    """Make the router's random draws (jitter, GShard random routing) identical on every rank of `group`, whose ranks
    route the same tokens.

    A router that already has a generator gets the state of the group's first rank. One without gets a seed drawn
    on that rank (`Gate.generator_seed`), from which it makes its generator on its input's device at its first draw.
    Every rank draws the candidate seed, so their default generators stay in step."""
    src = dist.get_global_rank(group, 0)
    seed = torch.randint(0, 2**62, (1,), device=device_type)
    dist.broadcast(seed, src=src, group=group)
    if gate.generator is not None:
        state = gate.generator.get_state().to(device_type)
        dist.broadcast(state, src=src, group=group)
        gate.generator.set_state(state.cpu())
    gate.generator_seed = int(seed.item())


class PPMoEExpertsParallel(TensorParallelLayer):
    """Plan style "ppmoe_experts": the experts module reached through `PPMoEExperts` on the tensor-parallel mesh."""

    def install_forward(self, module, mesh):
        dispatch = ALL_PARALLEL_STYLES["ep_dispatch_experts"]
        return dispatch.install_forward(module, mesh, tp_mesh=mesh, ep_implementation=PPMOE)


EPImplementationInterface.register(PPMOE, PPMoEExperts)
EPImplementationInterface.register(ALL_TO_ALL, AllToAllWithDrops)
ALL_PARALLEL_STYLES.register("ppmoe_experts", PPMoEExpertsParallel())
