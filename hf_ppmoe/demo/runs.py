"""The demo's training runs, side by side: one process per CPU core, one thread each (a run's numbers do not depend
on which process runs it or what runs beside it), every finished run written to root/runs/ and its model to
root/models/ at once; and the paired speed measurement of the trained models.

Per seed the jobs are: the dense run's first half (its state saved at step B / 2), then its second half and the
upcycled run (both from that state), and the from-scratch arms in one piece."""

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

from .loop import Run, train
from .protocol import SCRATCH_ARMS, UPCYCLED, Setting, build, check_blocks, corpus, result, upcycle_run


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


def load_data(setting: Setting, work: Path) -> dict:
    return corpus(work, setting.vocab, setting.max_files)


def half_state(root: Path, seed: int, s: Setting) -> Path:
    """Where the dense run of `seed` is saved at step B / 2."""
    return root / "states" / f"dense-seed{seed}-step{s.steps // 2}"


def run_job(root: str, setting: Setting, arm: str, seed: int, part: str = "") -> dict | None:
    """One job in a worker process (one thread): a from-scratch arm whole, the dense run's `part` "first" (to B / 2,
    saved) or "second" half, or the upcycled run from the dense run at B / 2. Saves the finished arm's model and record
    and returns the record (None for the first half). From-scratch arms start from `build` under `seed` and read
    batches drawn with `seed`."""
    torch.set_num_threads(1)
    quiet()
    root, s = Path(root), setting
    data = load_data(s, root)
    began, extra, half = time.perf_counter(), {}, s.steps // 2
    if arm == UPCYCLED[0]:
        run, extra["logit_gap"] = upcycle_run(Run.load(half_state(root, seed, s), s), s, seed, check_blocks(data, s))
        if extra["logit_gap"] > 1e-4:
            raise RuntimeError(f"the upcycled model's logits differ from the dense model's by {extra['logit_gap']:.2e}")
    elif part == "second":
        run = Run.load(half_state(root, seed, s), s)
    else:
        run = Run.start(build(s, data["tokenizer"], SCRATCH_ARMS[arm][1], seed), s, seed)
    train(run, data, s, half if part == "first" else s.steps, s.steps)
    if part == "first":
        run.save(half_state(root, seed, s))
        return None
    record = {**result(run, s, started=half if arm == UPCYCLED[0] else 0), **extra, "arm": arm, "seed": seed,
              "data_seed": seed, "wall_s": time.perf_counter() - began}
    run.model.save_pretrained(root / "models" / f"{arm}-seed{seed}")
    (root / "runs").mkdir(exist_ok=True)
    (root / "runs" / f"{arm}-seed{seed}.json").write_text(json.dumps(record))
    return record


def workers_for(requested: int) -> int:
    """--workers, or one per CPU core this process may use (at most 4)."""
    return requested or max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()))


def run_all(root: Path, setting: Setting, seeds: list[int], scratch: list[str], workers: int,
            report=print) -> dict[tuple[str, int], dict]:
    """Every arm for every seed: the dense runs' first halves first, then the other from-scratch arms; each seed's
    dense second half and upcycled run as soon as its first half is saved. Returns {(arm, seed): record}."""
    jobs = [("dense", seed, "first") for seed in seeds] + [(a, seed, "") for seed in seeds for a in scratch if a != "dense"]
    records = {}
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads or locks inherited
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        pending = {pool.submit(run_job, str(root), setting, *job): job for job in jobs}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                arm, seed, part = pending.pop(future)
                record = future.result()
                if part == "first":
                    for follow, second in (("dense", "second"), (UPCYCLED[0], "")):
                        pending[pool.submit(run_job, str(root), setting, follow, seed, second)] = (follow, seed, second)
                    continue
                records[arm, seed] = record
                report(f"      {arm:>15} seed {seed}: held-out loss {record['val_loss']:.4f} "
                       f"({record['train_tokens']:,} tokens, {record['wall_s']:.0f} s)")
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
