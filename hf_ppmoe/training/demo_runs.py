"""What the two demos (`demo.py`, `demo_seq2seq.py`) share: the run's clock, their data-order seeds, a training run
on the demo's data files, the runs' logged records and their speed."""

from __future__ import annotations

import json
import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .arguments import TrainArguments
from .tracking import curve, read_jsonl
from .train import main as train


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


def data_order_seeds(args) -> list[int]:
    """The seeds of the compared runs (`DemoArguments`: --seeds of them, from --seed + 1)."""
    return [args.seed + 1 + i for i in range(args.seeds)]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def train_run(args, root: Path, out: str, steps: int, seed: int, logging_steps: int, **options) -> dict:
    """Train with `hf_ppmoe.training.main` into root/out on root/data/{train,held-out}.jsonl and root/tokenizer, with
    the demo's batch size, learning rate, warm-up and evaluations (`options`: the model, and the family's own
    arguments); returns the final metrics."""
    return train(
        TrainArguments(
            output_dir=str(root / out), tokenizer_name=str(root / "tokenizer"), max_steps=steps,
            train_file=[str(root / "data" / "train.jsonl")], validation_file=[str(root / "data" / "held-out.jsonl")],
            per_device_train_batch_size=args.batch_size, learning_rate=args.learning_rate,
            warmup_steps=max(1, steps // 10), eval_steps=max(1, steps // args.evaluations), eval_batches=0, seed=seed,
            logging_steps=logging_steps, plots=False, **options,
        )
    )


def records(root: Path, run: str) -> list[dict]:
    """The metrics the run root/run logged."""
    return read_jsonl(root / run / "logs" / "metrics.jsonl")


def median_tokens_per_second(runs: list[list[dict]]) -> float:
    """Median over every step but each run's first (which includes start-up) of the logged tokens/s."""
    return statistics.median(v for r in runs for v in curve(r, "train/tokens_per_second")[1][1:])
