"""Expert parallelism on 2 processes: PPMoE against Transformers' own `all_reduce` (masked) and `all_to_all` EP.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/expert_parallel.py [--tokens 2048 --hidden 256 ...]

One GPT-MoE (every FFN an MoE layer, SwiGLU experts, top-k) is split three ways over the same 2 ranks, through
`DistributedConfig(tp_size=2, ep_size=2, ep_implementation=...)`, so attention and everything else is identical and
only the expert-parallel implementation differs:

- ppmoe:      ours. Whole experts per rank; index_select only the routes to local experts; one all-reduce.
- all_reduce: Transformers' AllReduceEP. The same split, but every rank hands its experts the whole batch with the
              other ranks' routes masked (sentinel id, weight 0), then one all-reduce. With Transformers' grouped_mm
              kernel the masked routes still go through its gather and elementwise passes; our `index` experts implementation
              skips them, so "all_reduce + index" computes what PPMoE computes and differs only in communication.
- all_to_all: Transformers' AllToAllEP. Each rank takes half the tokens, sends routes to the owner rank with an
              all-to-all and back with a second one, then all-gathers the halves.

Step time is forward + backward of the whole model; the variants run interleaved, round after round (rotating
which goes first), and the median over rounds is reported (the machine is shared and noisy). Bytes are counted per MoE layer and rank with
`hf_ppmoe.parallel.count_collectives` and compared with the all-to-all volume of the PPMoE paper's Eq. (2) for a
data-parallel MoE: t_a2a = (E - 1) * b * s * h / B per all-to-all, i.e. (E - 1) * b*s*h * (bytes_per_element / 2)
bytes (the paper counts 2-byte elements), two all-to-alls forward and two backward, with b*s*h the activations of
one rank: here the T tokens every rank holds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from transformers import DistributedConfig

from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM
from hf_ppmoe.parallel import count_collectives, init_distributed

# (ep_implementation, experts_implementation): our index implementation skips the sentinel routes of other ranks' experts;
# Transformers' grouped_mm kernel takes them through its gather and elementwise passes (masked)
VARIANTS = (
    ("ppmoe", "index"),
    ("all_reduce", "grouped_mm"),
    ("all_reduce", "index"),
    ("all_to_all", "grouped_mm"),
    ("all_to_all", "index"),
)


def build_config(args, experts) -> GPTMoEConfig:
    return GPTMoEConfig(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.inner, num_hidden_layers=args.layers,
        num_attention_heads=8, num_experts=args.experts, num_experts_per_tok=args.topk, moe_layer_frequency=1,
        experts_implementation=experts,
    )


def build(args, implementation, experts):
    torch.manual_seed(0)
    model = GPTMoEForCausalLM(build_config(args, experts)).train()
    distributed = DistributedConfig(tp_size=2, ep_size=2, ep_implementation=implementation)
    distributed, _, meshes = GPTMoEForCausalLM.prepare_distribute_model(distributed)
    return GPTMoEForCausalLM.maybe_distribute_model(model, distributed, meshes)


def step(model, ids) -> float:
    model.zero_grad(set_to_none=True)
    dist.barrier()
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    dist.barrier()
    return time.perf_counter() - start


def balanced_routes(args) -> torch.Tensor:
    """Router replay ids giving every expert as many routes from every slice of the tokens: token t's k-th route to
    expert (t k + k) mod E (so the all-to-all's rows do not depend on the router's draws)."""
    return (torch.arange(args.tokens * args.topk) % args.experts).view(args.tokens, args.topk)


def layer_collectives(model, args, routes=None) -> list[tuple[str, str, int]]:
    """(phase, op, bytes) of every collective one MoE layer issues in its forward and backward on this rank (routes:
    router replay ids, or the router's own)."""
    x = torch.randn(args.tokens, args.hidden, requires_grad=True)
    with count_collectives() as comm:
        out, _ = model.model.layers[0].mlp(x, expert_ids=routes)
        comm.mark("backward")
        out.square().sum().backward()
    split = comm.marks["backward"]
    return [("forward" if i < split else "backward", c.op, c.bytes) for i, c in enumerate(comm.calls)]


def planned_collectives(args, variant) -> list[tuple[str, str, int]]:
    """hf_ppmoe.planning's prediction of `layer_collectives` for the variant's layout on these 2 ranks."""
    from hf_ppmoe.planning import Layout, Run
    from hf_ppmoe.planning.communication import layer_collectives as planned
    from hf_ppmoe.planning.shapes import model_spec

    implementation = variant[0]
    layout = Layout(tp=2, ep=2, ep_implementation="all_to_all") if implementation == "all_to_all" else Layout(tp=2)
    spec = model_spec(build_config(args, variant[1]))
    return [(x.phase, x.op, x.bytes) for x in planned(spec, layout, Run(dtype="float32"), args.tokens, "moe")]


def layer_bytes(model, args, routes=None) -> tuple[int, int, list[str]]:
    """Bytes this rank sends into collectives in one MoE layer's forward and backward, and the ops."""
    calls = layer_collectives(model, args, routes)
    ops = [f"{op}[{size:,} B]" for _, op, size in calls]
    return sum(b for p, _, b in calls if p == "forward"), sum(b for p, _, b in calls if p == "backward"), ops


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per step (batch 8 x tokens/8)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inner", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    init_distributed()
    torch.manual_seed(1)
    ids = torch.randint(0, 1024, (8, args.tokens // 8))
    models = {variant: build(args, *variant) for variant in VARIANTS}
    losses = {name: model(input_ids=ids, labels=ids).loss.item() for name, model in models.items()}
    times = {name: [] for name in VARIANTS}
    for name in VARIANTS:  # warm-up
        step(models[name], ids)
    for r in range(args.rounds):
        for name in VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]:  # rotate which goes first
            times[name].append(step(models[name], ids))
    traffic = {name: layer_bytes(model, args) for name, model in models.items()}
    routes = balanced_routes(args)
    checked = {name: (layer_collectives(model, args, routes), planned_collectives(args, name))
               for name, model in models.items() if name[1] == "index"}
    if dist.get_rank() != 0:
        return
    T, H, E, element = args.tokens, args.hidden, args.experts, 4
    paper_a2a = (E - 1) * T * H * element // 2
    print(
        f"2 ranks (gloo, CPU, 1 thread each), T={T} tokens, H={H}, expert inner={args.inner}, E={E}, top-{args.topk}, "
        f"{args.layers} MoE layers, float32; median of {args.rounds} interleaved rounds"
    )
    print("\n| EP implementation | experts implementation | step time fwd+bwd (ms) | vs ppmoe | loss |")
    print("|---|---|---|---|---|")
    base = statistics.median(times[VARIANTS[0]])
    for name in VARIANTS:
        median = statistics.median(times[name])
        print(f"| {name[0]} | {name[1]} | {1000 * median:.0f} | {median / base:.2f}x | {losses[name]:.6f} |")
    print("\n| per MoE layer and rank | forward bytes | backward bytes | collectives |")
    print("|---|---|---|---|")
    for name in VARIANTS:
        if name[1] == "index":  # the bytes do not depend on the experts implementation
            fwd, bwd, ops = traffic[name]
            print(f"| {name[0]} | {fwd:,} | {bwd:,} | {', '.join(ops)} |")
    print(f"| Eq. (2), data-parallel MoE all-to-all (E={E}) | {2 * paper_a2a:,} | {2 * paper_a2a:,} | 2 x all_to_all each way |")
    print(f"\nT x H x 4 bytes = {T * H * element:,}; router gradient E x H x 4 = {E * H * element:,}")
    print("\nWith balanced routes replayed (token t's k-th route to expert (tK + k) mod E), each collective as counted "
          "and as hf_ppmoe.planning predicts it (layer_collectives):\n")
    print("| EP implementation | collective | counted bytes | predicted bytes |")
    print("|---|---|---|---|")
    for name, (counted, planned) in checked.items():
        for (phase, op, size), (_, _, predicted) in zip(counted, planned):
            print(f"| {name[0]} | {phase} {op} | {size:,} | {predicted:,} |")
        print(f"| {name[0]} | all {len(counted)} | {'equal' if counted == planned else 'DIFFERENT'} | |")


if __name__ == "__main__":
    main()
