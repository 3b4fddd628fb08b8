"""What the integrity checks of saving and loading cost (hf_ppmoe.utils.integrity, used by save_pretrained,
from_pretrained and the converters).

    python benchmarks/checksums.py [--gib 2] [--shards 4] [--workdir /tmp/hf-ppmoe-checksum-bench]

Writes GIB of random float32 weights as SHARDS safetensors files, then times, in this process and with the files in
the page cache (a loaded checkpoint is read from memory or disk once anyway):
- SHA-256 of one shard in one thread (the per-core rate),
- write_checksums over all shards (what save_pretrained and every conversion add; files hashed in parallel threads),
- verify_checksums over all shards (what from_pretrained and the converters' reader add when the folder has them),
- the finiteness check of from_pretrained (torch.isfinite(...).all() per tensor) over the same weights.
Each is the median of --rounds runs, reported as seconds per GiB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hf_ppmoe.utils.integrity import _sha256, check_finite, verify_checksums, write_checksums


def timed(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/hf-ppmoe-checksum-bench")
    args = parser.parse_args()

    folder = Path(args.workdir)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    per_shard = int(args.gib * 2**30 / args.shards / 4)
    names = []
    for i in range(args.shards):
        name = f"model-{i + 1:05d}-of-{args.shards:05d}.safetensors"
        save_file({f"w{i}.{j}": torch.randn(per_shard // 4) for j in range(4)}, folder / name)
        names.append(name)
    gib = sum((folder / n).stat().st_size for n in names) / 2**30
    for n in names:  # into the page cache
        (folder / n).read_bytes()

    one = timed(lambda: _sha256(folder / names[0]), args.rounds) / ((folder / names[0]).stat().st_size / 2**30)
    write = timed(lambda: write_checksums(folder, names), args.rounds) / gib
    verify = timed(lambda: verify_checksums(folder, names), args.rounds) / gib
    tensors = {k: v for n in names for k, v in load_file(folder / n).items()}
    finite = timed(lambda: check_finite(("f", k, t) for k, t in tensors.items()), args.rounds) / gib
    print(f"{gib:.2f} GiB in {args.shards} shards, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads")
    print(f"SHA-256, one file, one thread   {one:6.2f} s/GiB")
    print(f"write_checksums (all shards)    {write:6.2f} s/GiB")
    print(f"verify_checksums (all shards)   {verify:6.2f} s/GiB")
    print(f"finiteness check                {finite:6.2f} s/GiB")
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
