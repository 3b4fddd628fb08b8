"""Bytes per rank of parameters, gradients and AdamW state for each layout of the training entry point, against the
formula whole / (fsdp x tp x pp). CPU, gloo, several processes (torchrun, started by this script):

    python benchmarks/memory.py              # 1, 2, 4 and 8 processes; prints a markdown table
    python benchmarks/memory.py --max-world 4

Every layout is built exactly as `python -m hf_ppmoe.training` builds it (`hf_ppmoe.training.parallel_setup`:
pipeline stage, tensor / PPMoE or all-to-all expert parallelism, FSDP2 / HSDP), runs one forward + backward and one
AdamW step, and counts the local shards each rank then holds (`hf_ppmoe.parallel.state_bytes`: parameters, their
gradients, AdamW's two moments). Counted after the step, so FSDP's transient all-gathered layers (one or two layers at
a time, freed after use) are not in the numbers; activations are not counted either.

What the formula leaves out, and the table shows: parameters that tensor parallelism keeps whole on every TP rank
(norms, routers) are divided by fsdp x pp only; a pipeline stage holds its own layers plus the embeddings (first) or
the final norm and head (last), so stages are not equal; FSDP pads dim 0 to a multiple of the shard count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM
from hf_ppmoe.parallel import init_distributed, state_bytes
from hf_ppmoe.training.parallel_setup import DataParallelGroup, split_model

# per world size: the layouts (fsdp, tp, pp, ep; the remaining processes are replicas)
LAYOUTS = {
    1: [{}],
    2: [{}, dict(fsdp=2), dict(tp=2), dict(pp=2), dict(fsdp=2, ep=2)],
    4: [dict(fsdp=4), dict(fsdp=2), dict(fsdp=2, tp=2), dict(fsdp=2, pp=2), dict(tp=2, pp=2), dict(fsdp=4, ep=4),
        dict(fsdp=2, tp=2, ep=4)],
    8: [dict(fsdp=8), dict(fsdp=4, tp=2), dict(fsdp=2, tp=2), dict(fsdp=2, tp=2, pp=2), dict(fsdp=8, ep=8)],
}
MODEL = dict(
    vocab_size=4096, hidden_size=128, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
    num_experts=8, num_experts_per_tok=2, moe_layer_frequency=2,
)


def name(layout: dict, world: int) -> str:
    fsdp, tp, pp = (layout.get(k, 1) for k in ("fsdp", "tp", "pp"))
    sizes = (("replicas", world // (fsdp * tp * pp)), ("fsdp", fsdp), ("tp", tp), ("pp", pp))
    text = " x ".join(f"{k} {v}" for k, v in sizes if v > 1) or "1 process"
    return text + (f" (ep {layout['ep']})" if layout.get("ep", tp) > tp else "")


def measure(layout: dict, config: dict, batch: int = 2, length: int = 32) -> dict:
    """On every rank of the job: build the model, split it as `layout` says, one training step; returns this rank's
    {"params", "grads", "optimizer"} bytes."""
    world = dist.get_world_size()
    sizes = dict(tp_size=layout.get("tp", 1), pp_size=layout.get("pp", 1), fsdp_size=layout.get("fsdp", 1))
    dp = DataParallelGroup(SimpleNamespace(process_index=dist.get_rank(), num_processes=world), **sizes,
                      ep_size=layout.get("ep"))
    torch.manual_seed(0)
    model = GPTMoEForCausalLM(GPTMoEConfig(**config)).train()
    model, pipe = split_model(model, SimpleNamespace(**sizes, gradient_accumulation_steps=2, fsdp_reshard_after_forward=True), dp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(3, config["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(dp.rank))
    if pipe is not None:
        pipe.step(ids, ids)
    else:
        model(ids, labels=ids).loss.backward()
    optimizer.step()
    return state_bytes(model, optimizer)


def worker(out: str, config: dict) -> None:
    init_distributed()
    world, results = dist.get_world_size(), []
    for layout in LAYOUTS[world]:
        ranks = [None] * world
        dist.all_gather_object(ranks, measure(layout, config))
        factor = math.prod(layout.get(k, 1) for k in ("fsdp", "tp", "pp"))
        results.append({"layout": name(layout, world), "factor": factor, "ranks": ranks})
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def table(results: list[dict], whole: int) -> str:
    mib = 2**20
    lines = [
        "| layout | processes | params / grads / AdamW per rank (MiB, largest rank) | total per rank (largest) | "
        "formula whole / (fsdp x tp x pp) | measured / formula |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        totals = [sum(rank.values()) for rank in r["ranks"]]
        largest = r["ranks"][totals.index(max(totals))]
        formula = whole / r["factor"]
        parts = " / ".join(f"{largest[k] / mib:.2f}" for k in ("params", "grads", "optimizer"))
        lines.append(f"| {r['layout']} | {len(r['ranks'])} | {parts} | {max(totals) / mib:.2f} | {formula / mib:.2f} | "
                     f"{max(totals) / formula:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-world", type=int, default=8, choices=sorted(LAYOUTS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, MODEL)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in (w for w in sorted(LAYOUTS) if w <= args.max_world):
            out = Path(tmp, f"{world}.json")
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                       __file__, f"--worker={out}"]
            subprocess.run(command, env=env, check=True, capture_output=True)
            results += json.loads(out.read_text())
    whole = sum(results[0]["ranks"][0].values())
    params = sum(p.numel() for p in GPTMoEForCausalLM(GPTMoEConfig(**MODEL)).parameters())
    print(f"GPT-MoE, {params / 1e6:.2f}M parameters ({MODEL}); whole model + grads + AdamW = {whole / 2**20:.2f} MiB\n")
    print(table(results, whole))


if __name__ == "__main__":
    main()
