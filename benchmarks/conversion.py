"""Time and peak memory of upcycling a GPT-2-small-sized model (124M parameters, random weights) to 8 experts.

    python benchmarks/conversion.py [--experts 8] [--workdir /tmp/hf-ppmoe-conversion-bench]

Builds and saves the dense model once, then runs each conversion in a fresh process and reports its wall time and
peak resident memory (the child's ru_maxrss), next to the size of the weights it writes. `hf-ppmoe upcycle` streams:
it reads source tensors lazily with safe_open and computes and writes one output tensor at a time, so the memory it
allocates stays far below one copy of the output. The last row, the Python API without an output folder, returns the
model in memory, so it necessarily holds one full copy: it is the reference the streaming rows are measured against.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

IN_MEMORY = (
    "import sys, torch, hf_ppmoe; from hf_ppmoe.conversion import upcycle; "
    "m = upcycle(sys.argv[1], num_experts=int(sys.argv[2]), moe_layer_frequency=1); "
    "print(sum(float(p.double().sum()) for p in m.parameters()))"  # touch every weight: all of them in memory
)


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def measure(command: list[str]) -> tuple[float, float, float]:
    """Run `command` in a fresh process; return (seconds, peak RSS GiB, peak anonymous memory GiB) of that process.

    Peak RSS (VmHWM) also counts the pages of files the process has mapped: safe_open maps the source checkpoint,
    so reading all of it adds its size, though those pages are the kernel's page cache, not copies the conversion
    holds. Anonymous memory (RssAnon, sampled every 10 ms) is what the process itself allocated."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    start = time.perf_counter()
    child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak_anon = peak_rss = 0
    while child.poll() is None:
        try:
            peak_anon = max(peak_anon, _status_kib(child.pid, "RssAnon"))
            peak_rss = max(peak_rss, _status_kib(child.pid, "VmHWM"))
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.01)
    stderr = child.communicate()[1]
    seconds = time.perf_counter() - start
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{stderr}")
    return seconds, peak_rss / 2**20, peak_anon / 2**20


def weights_gib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--workdir", default="/tmp/hf-ppmoe-conversion-bench")
    args = parser.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    dense = GPT2LMHeadModel(GPT2Config())  # GPT-2 small: 12 layers, 768 wide, 50257 tokens
    params = sum(p.numel() for p in dense.parameters())
    dense.save_pretrained(work / "gpt2")
    del dense
    print(f"source: GPT-2 small, {params / 1e6:.0f}M parameters, {weights_gib(work / 'gpt2'):.2f} GiB of safetensors")

    cli = [sys.executable, "-m", "hf_ppmoe.cli"]
    E = str(args.experts)
    runs = [
        ("`hf-ppmoe upcycle`, every FFN MoE", "moe_all", ["--moe_layer_frequency", "1"]),
        ("`hf-ppmoe upcycle`, every FFN MoE, 500MB shards", "moe_all_500mb", ["--moe_layer_frequency", "1", "--max_shard_size", "500MB"]),
        ("`hf-ppmoe upcycle`, every other FFN MoE (default)", "moe_half", []),
    ]
    rows = [("baseline: `import hf_ppmoe` (Python, torch, Transformers)", *measure([sys.executable, "-c", "import hf_ppmoe"]), 0.0)]
    for label, name, extra in runs:
        result = measure([*cli, "upcycle", str(work / "gpt2"), str(work / name), "--num_experts", E, *extra])
        rows.append((label, *result, weights_gib(work / name)))
    result = measure([*cli, "merge", str(work / "moe_all"), str(work / "merged")])
    rows.append(("`hf-ppmoe merge` of the first output back to GPT-2", *result, weights_gib(work / "merged")))
    result = measure([sys.executable, "-c", IN_MEMORY, str(work / "gpt2"), E])
    rows.append(("reference: `upcycle(src)` returning the model in memory", *result, weights_gib(work / "moe_all")))

    info = json.loads((work / "moe_all" / "config.json").read_text())
    print(f"output: {info['num_experts']} experts, {len(list((work / 'moe_all').glob('*.safetensors')))} shard(s)\n")
    print("| conversion | wall time (s) | peak RSS (GiB) | peak anonymous memory (GiB) | output weights (GiB) |")
    print("|---|---|---|---|---|")
    for label, seconds, rss, anon, out in rows:
        print(f"| {label} | {seconds:.1f} | {rss:.2f} | {anon:.2f} | {out:.2f} |")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
