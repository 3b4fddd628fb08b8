"""Peak memory and preparation time of the training data path (hf_ppmoe.training.block_data) as the corpus grows, against
the run_clm.py way, on corpora generated from the built-in corpus:

    python benchmarks/data.py                   # 25, 100 and 400 MB; prints a markdown table
    python benchmarks/data.py --sizes 25 100
    python benchmarks/data.py --sizes 400 --runs first cached streaming     # some of the runs

For each size, one .txt file (the built-in corpus repeated, documents separated by blank lines), a byte-level BPE
tokenizer trained on the built-in corpus, and 2-step runs of `python -m hf_ppmoe.training` on a tiny GPT-MoE
(block_size 128, 8 sequences a step):
- first:     an empty cache: the blocks are prepared (tokenized, packed, written to memory-mapped Arrow);
- cached:    the same command again: the cache entry is reused;
- streaming: `--streaming`: packed on the fly, only what the 2 steps and the evaluation read;
- 2 procs:   torchrun with 2 processes and an empty cache: the main process prepares, the other maps the entry;
- run_clm:   the run_clm.py way in a process of its own: `datasets`' text loader, `Dataset.map` with the batched fast
             tokenizer, `group_texts` into blocks (memory-mapped Arrow in a fresh datasets cache), then 2 training
             steps of the same model on its blocks.
Peak RSS is the largest resident set of any process of the run (`getrusage(RUSAGE_CHILDREN)` of a wrapper that runs
it); "data ready" is the time `load_data` took (the line train.py prints), for run_clm the loading, map and grouping;
MB/s is the corpus size over that time. CPU numbers on a shared machine are proxies.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
MEASURE = """
import resource, subprocess, sys, time
clock = time.perf_counter()
result = subprocess.run(sys.argv[1:], capture_output=True, text=True)
seconds = time.perf_counter() - clock
print(result.stdout[-3000:] + result.stderr[-3000:])
print("RSS_KB", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "WALL", seconds, "RC", result.returncode)
"""
RUN_CLM = """
import sys, time, torch
from itertools import chain
import datasets
import hf_ppmoe  # registers gpt_moe with the Auto classes
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
corpus, tokenizer_dir, config, cache = sys.argv[1:5]
clock = time.perf_counter()
tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
raw = datasets.load_dataset("text", data_files={"train": corpus}, split="train", cache_dir=cache)
tokenized = raw.map(lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"])
block = 128
def group_texts(examples):
    joined = {k: list(chain(*examples[k])) for k in examples}
    n = len(joined["input_ids"]) // block * block
    return {k: [t[i : i + block] for i in range(0, n, block)] for k, t in joined.items()}
blocks = tokenized.map(group_texts, batched=True).with_format("torch")
print(f"data: {len(blocks)} blocks, ready in {time.perf_counter() - clock:.1f} s")
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(2):
    ids = blocks[list(range(step * 8, step * 8 + 8))]["input_ids"]
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def measure(command: list[str]) -> dict:
    result = subprocess.run([sys.executable, "-c", MEASURE, *command], env=ENV, capture_output=True, text=True)
    out = result.stdout
    rss, wall, rc = re.search(r"RSS_KB (\d+) WALL ([\d.]+) RC (-?\d+)", out).groups()
    if int(rc):
        raise RuntimeError(f"{' '.join(command)} failed:\n{out[-3000:]}")
    ready = re.findall(r"data: .*ready in ([\d.]+) s", out)
    return {"rss_gb": int(rss) / 2**20, "wall_s": float(wall), "ready_s": max(map(float, ready))}


def setup(root: Path) -> tuple[Path, Path]:
    from hf_ppmoe import GPTMoEConfig
    from hf_ppmoe.training.data import builtin_corpus, train_tokenizer

    tokenizer = train_tokenizer(builtin_corpus())
    tokenizer.save_pretrained(root / "tokenizer")
    GPTMoEConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, num_experts=4, num_experts_per_tok=2,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    ).to_json_file(root / "config.json")
    return root / "tokenizer", root / "config.json"


def corpus(root: Path, megabytes: int) -> Path:
    from hf_ppmoe.training.data import builtin_corpus

    path = root / f"corpus_{megabytes}mb.txt"
    text = "\n\n".join(builtin_corpus()) + "\n\n"
    with open(path, "w") as f:
        for _ in range(megabytes * 2**20 // len(text.encode()) + 1):
            f.write(text)
    return path


RUNS = ("first", "cached", "streaming", "2 procs", "run_clm")


def bench(root: Path, megabytes: int, tokenizer: Path, config: Path, runs=RUNS) -> dict:
    text = corpus(root, megabytes)
    size_mb = text.stat().st_size / 2**20

    def train(name, *extra, processes=1, cache=None):
        flags = [f"--train_file={text}", f"--tokenizer_name={tokenizer}", f"--config_name={config}", "--max_steps=2",
                 "--block_size=128", "--per_device_train_batch_size=8", "--eval_batches=1", "--plots=False",
                 f"--output_dir={root / name}", f"--data_cache_dir={cache or root / f'cache_{megabytes}'}", *extra]
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
                    "-m", "hf_ppmoe.training"] if processes > 1 else [sys.executable, "-m", "hf_ppmoe.training"]
        return measure([*launcher, *flags])

    commands = {  # in this order: "cached" reuses what "first" prepared
        "first": lambda: train("first"),
        "cached": lambda: train("cached"),
        "streaming": lambda: train("streaming", "--streaming"),
        "2 procs": lambda: train("two", processes=2, cache=root / f"cache2_{megabytes}"),
        "run_clm": lambda: measure([sys.executable, "-c", RUN_CLM, str(text), str(tokenizer), str(config), str(root / f"clm_{megabytes}")]),
    }
    rows = {name: command() for name, command in commands.items() if name in runs}
    for row in rows.values():
        row["mb_per_s"] = size_mb / row["ready_s"] if row["ready_s"] else None
    text.unlink()
    return {"megabytes": round(size_mb, 1), **rows}


def table(results: list[dict]) -> str:
    lines = ["| corpus | run | peak RSS (GB) | data ready (s) | MB/s | whole run (s) |", "|---|---|---|---|---|---|"]
    for result in results:
        for name in RUNS:
            if name not in result:
                continue
            r = result[name]
            rate = f"{r['mb_per_s']:.2f}" if name in ("first", "2 procs", "run_clm") else "-"
            lines.append(f"| {result['megabytes']} MB | {name} | {r['rss_gb']:.2f} | {r['ready_s']:.1f} | {rate} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[25, 100, 400], help="corpus sizes in MB")
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=RUNS, help="which runs (default: all)")
    parser.add_argument("--json", help="also write the results here")
    options = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as folder:
        tokenizer_dir, config_file = setup(Path(folder))
        for megabytes in options.sizes:
            clock = time.perf_counter()
            results.append(bench(Path(folder), megabytes, tokenizer_dir, config_file, options.runs))
            print(f"{megabytes} MB done in {time.perf_counter() - clock:.0f} s", file=sys.stderr, flush=True)
            print(table(results[-1:]), flush=True)
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=1))
    print(table(results))
