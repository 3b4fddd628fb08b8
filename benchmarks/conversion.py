"""Time and peak memory of upcycling a GPT-2-small-sized model (124M parameters, random weights) to 8 experts.

    python benchmarks/conversion.py [--experts 8] [--workdir /tmp/hf-ppmoe-conversion-bench]

Builds and saves the dense model once, then runs each conversion in a fresh process (`hf_ppmoe_cli.main`, as the
`hf-ppmoe` command does) and reports, for that process: the conversion's wall time (imports excluded), its CPU time
(user + system, imports included), its peak RSS, and its peak anonymous memory, next to the size of the weights it
writes. `hf-ppmoe upcycle` streams: it reads source tensors lazily with safe_open (memory-mapped) and computes and
writes one output tensor at a time, so what it allocates stays far below one copy of the output. Peak RSS also counts
the pages of the memory-mapped source that were read (the kernel's page cache, not copies held by the conversion),
which is why it grows with the source's size. The last row, the Python API without an output folder, returns the
model in memory: it holds one full copy, the reference for the streaming rows.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

IMPORTS = "import sys, time, hf_ppmoe_cli, hf_ppmoe.conversion; t = time.perf_counter(); "
CLI = IMPORTS + "rc = hf_ppmoe_cli.main(sys.argv[1:]); print('SECONDS', time.perf_counter() - t); sys.exit(rc)"
BASELINE = IMPORTS + "print('SECONDS', 0.0)"
IN_MEMORY = IMPORTS + (
    "m = hf_ppmoe.conversion.upcycle(sys.argv[1], num_experts=int(sys.argv[2]), moe_layer_frequency=1); "
    "total = sum(float(p.double().sum()) for p in m.parameters()); "  # touch every weight: all of them in memory
    "print('SECONDS', time.perf_counter() - t)"
)


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def measure(script: str, *args: str) -> tuple[float, float, float, float]:
    """Run `python -c script args` in a fresh process; return (conversion seconds, CPU seconds, peak RSS GiB,
    peak anonymous memory GiB). VmHWM and RssAnon are sampled from /proc every 10 ms (ru_maxrss would also count the
    memory of this process, which the child carries until its exec)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    log = tempfile.TemporaryFile()  # files, not pipes: nothing blocks the child while it is polled
    child = subprocess.Popen([sys.executable, "-c", script, *args], env=env, stdout=log, stderr=subprocess.STDOUT)
    peak_anon = peak_rss = 0
    while True:
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)
        if pid:
            break
        try:
            peak_anon = max(peak_anon, _status_kib(child.pid, "RssAnon"))
            peak_rss = max(peak_rss, _status_kib(child.pid, "VmHWM"))
        except (FileNotFoundError, ProcessLookupError):
            pass
        time.sleep(0.01)
    child.returncode = os.waitstatus_to_exitcode(status)
    log.seek(0)
    output = log.read().decode(errors="replace")
    if child.returncode != 0:
        raise RuntimeError(f"{script} {' '.join(args)} failed:\n{output}")
    seconds = float(next(line.split()[1] for line in output.splitlines() if line.startswith("SECONDS")))
    return seconds, usage.ru_utime + usage.ru_stime, peak_rss / 2**20, peak_anon / 2**20


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

    src, E = str(work / "gpt2"), str(args.experts)
    rows = [("baseline: `import hf_ppmoe_cli, hf_ppmoe.conversion` only", *measure(BASELINE), 0.0)]
    runs = [
        ("`hf-ppmoe upcycle`, every FFN MoE", "moe_all", ["--moe_layer_frequency", "1"]),
        ("`hf-ppmoe upcycle`, every FFN MoE, 500MB shards", "moe_500mb", ["--moe_layer_frequency", "1", "--max_shard_size", "500MB"]),
        ("`hf-ppmoe upcycle`, every other FFN MoE (default)", "moe_half", []),
    ]
    for label, name, extra in runs:
        rows.append((label, *measure(CLI, "upcycle", src, str(work / name), "--num_experts", E, *extra), weights_gib(work / name)))
    merged = measure(CLI, "merge", str(work / "moe_all"), str(work / "merged"))
    rows.append(("`hf-ppmoe merge` of the every-FFN output back to GPT-2", *merged, weights_gib(work / "merged")))
    rows.append(("reference: `upcycle(src)` returning the model in memory", *measure(IN_MEMORY, src, E), weights_gib(work / "moe_all")))

    print(f"{args.experts} experts; every-FFN output in {len(list((work / 'moe_all').glob('*.safetensors')))} shard(s), "
          f"500MB run in {len(list((work / 'moe_500mb').glob('*.safetensors')))}\n")
    print("| conversion | wall time (s) | CPU time (s) | peak RSS (GiB) | peak anonymous memory (GiB) | output weights (GiB) |")
    print("|---|---|---|---|---|---|")
    for label, seconds, cpu, rss, anon, out in rows:
        print(f"| {label} | {seconds:.1f} | {cpu:.1f} | {rss:.2f} | {anon:.2f} | {out:.2f} |")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
