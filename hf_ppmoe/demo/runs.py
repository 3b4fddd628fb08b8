"""The demo's training runs, side by side: one process per CPU core, one thread each (a run's numbers do not depend
on which process runs it or what runs beside it), every finished run written to root/runs/ and its model to
root/models/ at once; and the paired speed measurement of the trained models."""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import time
from contextlib import contextmanager
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..modeling import GPTMoEForCausalLM
from .protocol import SCRATCH_ARMS, Setting, build, corpus, train, upcycle_from, windows


@dataclass
class Clock:
    """When the run started, the load averages then, and the seconds each named stage took."""

    start: float = field(default_factory=time.perf_counter)
    load: tuple[float, float, float] = field(default_factory=os.getloadavg)
    stages: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def stage(self, name: str):
        """Time the `with` block as the stage `name`."""
        began = time.perf_counter()
        yield
        self.stages[name] = time.perf_counter() - began

    def minutes(self) -> float:
        """Minutes since the start."""
        return (time.perf_counter() - self.start) / 60


def quiet() -> None:
    """No progress bars for the demo's many small saves and loads (each takes milliseconds)."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def load_data(setting: Setting, work: Path, train_bytes: int | None) -> dict:
    return corpus(work, setting.vocab, setting.max_files, train_bytes)


def check_blocks(data: dict, s: Setting) -> torch.Tensor:
    """Two held-out windows on which an upcycled model is checked against its dense source."""
    return windows(data["val"], torch.arange(2) * s.block, s.block)


def run_arm(root: str, setting: Setting, train_bytes: int | None, arm: str, seed: int) -> dict:
    """Train one arm for one seed (in a worker process, one thread); save its model and record; return the record.
    From-scratch arms start from `build` under `seed` and read batches drawn with `seed`; the upcycling arms start
    from the seed's final dense_scratch model and read batches drawn with seed + 1000."""
    torch.set_num_threads(1)
    quiet()
    root, s = Path(root), setting
    data = load_data(s, root, train_bytes)
    extra = {}
    if arm in SCRATCH_ARMS:
        model, steps, data_seed = build(s, data["tokenizer"], SCRATCH_ARMS[arm][1], seed), s.steps, seed
    else:
        model = GPTMoEForCausalLM.from_pretrained(root / "models" / f"dense_scratch-seed{seed}")
        steps, data_seed = s.upcycle_steps, seed + 1000
        if arm == "moe_upcycled":
            model, extra["logit_gap"] = upcycle_from(model, seed, check_blocks(data, s))
            if extra["logit_gap"] > 1e-4:
                raise RuntimeError(f"the upcycled model's logits differ from the dense model's by {extra['logit_gap']:.2e}")
    began = time.perf_counter()
    record = {**train(model, data, s, steps, data_seed, verbose=False), **extra, "arm": arm, "seed": seed,
              "data_seed": data_seed, "wall_s": time.perf_counter() - began}
    model.save_pretrained(root / "models" / f"{arm}-seed{seed}")
    (root / "runs").mkdir(exist_ok=True)
    (root / "runs" / f"{arm}-seed{seed}.json").write_text(json.dumps(record))
    return record


def workers_for(requested: int) -> int:
    """--workers, or one per CPU core this process may use (at most 4)."""
    return requested or max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()))


def run_all(root: Path, setting: Setting, train_bytes: int | None, seeds: list[int], scratch: list[str], workers: int,
            report=print) -> dict[tuple[str, int], dict]:
    """Every arm for every seed: the from-scratch arms first, and each seed's upcycling pair as soon as its
    dense_scratch model is saved. Returns {(arm, seed): record}."""
    jobs = [(arm, seed) for seed in seeds for arm in scratch]
    records = {}
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads or locks inherited
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        pending = {pool.submit(run_arm, str(root), setting, train_bytes, arm, seed): (arm, seed) for arm, seed in jobs}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                arm, seed = pending.pop(future)
                records[arm, seed] = record = future.result()
                report(f"      {arm:>15} seed {seed}: held-out loss {record['val_loss']:.4f} "
                       f"({record['train_tokens']:,} tokens, {record['wall_s']:.0f} s)")
                if arm == "dense_scratch":
                    for follow in ("dense_continued", "moe_upcycled"):
                        job = pool.submit(run_arm, str(root), setting, train_bytes, follow, seed)
                        pending[job] = (follow, seed)
    return records


def paired_speed(models: dict[str, torch.nn.Module], batch: torch.Tensor, rounds: int = 10, steps: int = 3) -> dict:
    """Training-step time of each model on one thread, measured in `rounds` short rounds that alternate the models
    (the order reversed every round), so that a change in the machine's load falls on all of them alike: per model
    the best and median step time, tokens/s at the best step, and the median (and range) over rounds of its step
    time divided by the first model's in the same round ("time_ratio")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    names = list(models)
    optimizers = {n: torch.optim.AdamW(m.parameters(), lr=1e-9) for n, m in models.items()}  # the step's cost, not its use

    def step(name: str) -> None:
        models[name](batch, labels=batch).loss.backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)

    for name in names:  # warm up: allocator and first-call work
        models[name].train()
        step(name)
    times = {n: [] for n in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            began = time.perf_counter()
            for _ in range(steps):
                step(name)
            times[name].append((time.perf_counter() - began) / steps)
    torch.set_num_threads(threads)
    tokens = batch.numel()
    base = names[0]
    return {n: {"best_step_s": min(t), "median_step_s": statistics.median(t), "tokens_per_s": tokens / min(t),
                "time_ratio": statistics.median(a / b for a, b in zip(t, times[base])),
                "time_ratio_range": [min(a / b for a, b in zip(t, times[base])), max(a / b for a, b in zip(t, times[base]))]}
            for n, t in times.items()}
