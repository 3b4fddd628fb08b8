"""The experiment's training loop: a `Run` (model, optimizer, data stream and step) trained on the
warmup-stable-decay schedule, saved and resumed exactly, evaluated on the held-out windows, and upcycled with its
optimizer state.

A run of B steps and a run of B' > B steps are the same run until their cool-downs start (step B - 0.2 B), so a
saved `Run` continues into any budget as an unbroken run of that budget would: `benchmarks/quality.py` trains one
run per seed and arm and branches every budget of its curve from it, and each branch is the run `hf-ppmoe demo
--tokens` makes at that budget (tests/demo checks both, to the last digit).
"""

from __future__ import annotations

import hashlib
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..modeling import GPTMoEForCausalLM
from ..moe import LoadBalancer
from ..training.steps import forward_backward, token_losses
from ..training.tracking import RouterMonitor
from ..utils.atomic import atomic_folder


def cooldown_start(s, steps: int) -> int:
    """The step at which a `steps`-step run's cool-down starts (the last `s.decay` of its steps)."""
    return steps - round(s.decay * steps)


def learning_rate(s, step: int, steps: int) -> float:
    """The rate of step `step` (0-based) of a `steps`-step run: linear warm-up over `s.warmup` steps, `s.lr`, then a
    (1 - sqrt) cool-down to 0 (Hägele et al. 2024); Transformers' `get_wsd_schedule(decay_type="1-sqrt")` rates."""
    if step < s.warmup:
        return s.lr * step / s.warmup
    start = cooldown_start(s, steps)
    if step < start:
        return s.lr
    return s.lr * (1.0 - math.sqrt((step - start) / (steps - start)))


def make_optimizer(model, s) -> torch.optim.AdamW:
    """AdamW, betas 0.9 / 0.95, weight decay 0.1 on matrices only."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
                             lr=s.lr, betas=(0.9, 0.95))


@dataclass
class Run:
    """A training run in progress: everything that decides its next step. `data_order` chains the SHA-1 of every
    batch read so far (equal chains: equal batches in equal order); `curve` holds the held-out evaluations;
    `timing` the training steps' wall and CPU seconds."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    generator: torch.Generator
    step: int = 0
    data_order: str = ""
    curve: list = field(default_factory=list)
    timing: dict = field(default_factory=lambda: {"steps": 0, "wall": 0.0, "cpu": 0.0})
    balancer: LoadBalancer | None = None  # made by __post_init__

    def __post_init__(self):
        if self.balancer is None:  # bias balancing / global-batch loss: after every optimizer step
            self.balancer = LoadBalancer(self.model)
            self.balancer.step_with(self.optimizer)

    @classmethod
    def start(cls, model, s, data_seed: int) -> Run:
        """A new run of `model` whose batches are drawn with `data_seed`."""
        model.to(s.device).train()
        return cls(model, make_optimizer(model, s), torch.Generator().manual_seed(data_seed))

    def save(self, folder: Path) -> None:
        """The model (safetensors) and the training state, written atomically. Only at an evaluation (the training
        loss and routing statistics since the last one are not kept)."""
        if not self.curve or self.curve[-1]["step"] != self.step:
            raise ValueError(f"a run is saved at an evaluation; step {self.step} is not one (eval_every)")
        with atomic_folder(folder, overwrite=True) as tmp:
            self.model.save_pretrained(tmp)
            torch.save({"optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state(),
                        "step": self.step, "data_order": self.data_order, "curve": self.curve, "timing": self.timing,
                        "balancer": self.balancer.state_dict()}, tmp / "run.pt")

    @classmethod
    def load(cls, folder: Path, s) -> Run:
        """The run `save` wrote, ready to continue exactly where it stopped."""
        state = torch.load(Path(folder) / "run.pt", weights_only=True)
        model = GPTMoEForCausalLM.from_pretrained(folder).to(s.device).train()
        optimizer = make_optimizer(model, s)
        optimizer.load_state_dict(state["optimizer"])
        generator = torch.Generator()
        generator.set_state(state["generator"])
        run = cls(model, optimizer, generator, state["step"], state["data_order"], state["curve"], state["timing"])
        run.balancer.load_state_dict(state["balancer"])
        return run


def windows(stream: torch.Tensor, starts: torch.Tensor, block: int) -> torch.Tensor:
    return stream[starts[:, None] + torch.arange(block)].long()


def held_out_blocks(data: dict, s, count: int | None = None) -> torch.Tensor:
    """`count` (default `s.eval_blocks`) evenly spaced windows of the held-out stream."""
    val = data["val"]
    return windows(val, torch.linspace(0, len(val) - s.block - 1, count or s.eval_blocks).long(), s.block)


def window_losses(model, blocks: torch.Tensor, s) -> torch.Tensor:
    """Per held-out window, the mean next-token cross-entropy (`token_losses`: router losses excluded), float64."""
    model.eval()
    # written into one tensor: a list of small per-batch tensors, kept while an MoE's batches allocate tensors of
    # varying sizes, pins the allocator's heap (an upcycled MoE's 2,560 windows grew a process by 1.4 GB)
    losses = torch.empty(len(blocks), dtype=torch.float64)
    for start in range(0, len(blocks), s.batch):
        with torch.autocast(s.device, dtype=torch.bfloat16, enabled=s.bf16):
            ce, _ = token_losses(model, blocks[start : start + s.batch].to(s.device))
        losses[start : start + len(ce)] = ce.double().mean(1).cpu()
    model.train()
    return losses


def evaluate(model, blocks: torch.Tensor, s) -> float:
    """Mean held-out loss over the windows (every window has the same tokens)."""
    return window_losses(model, blocks, s).mean().item()


def train(run: Run, data: dict, s, until: int, steps: int, label: str = "", verbose: bool = False) -> Run:
    """Train `run` up to step `until` on the schedule of a `steps`-step run, on random windows of the train stream.
    The held-out loss is measured every `s.eval_every` steps and at step `steps` on `s.eval_blocks` windows (the
    curve's `val_loss`); at step `steps` also on `s.final_blocks` windows (`final_loss`: the run's result)."""
    model, optimizer = run.model, run.optimizer
    monitor = RouterMonitor(model)
    check, final = held_out_blocks(data, s), held_out_blocks(data, s, s.final_blocks)
    train_loss, interval = torch.zeros((), device=s.device), run.step
    while True:
        step = run.step
        if (step % s.eval_every == 0 or step == steps) and not (run.curve and run.curve[-1]["step"] == step):
            router = monitor.collect()
            point = {"step": step, "tokens": step * s.batch * s.block, "val_loss": evaluate(model, check, s),
                     "train_loss": (train_loss / (step - interval)).item() if step > interval else None}
            if step == steps:
                point["final_loss"] = point["val_loss"] if s.final_blocks == s.eval_blocks else evaluate(model, final, s)
            if router:
                for key, prefix in (("expert_load_cv", "expert_load"), ("dropped", "dropped"),
                                    ("load_max_over_mean", "load_max")):
                    point[key] = statistics.mean(v for k, v in router.items() if k.startswith(prefix))
            if not math.isfinite(point["val_loss"]):
                raise RuntimeError(f"held-out loss is {point['val_loss']} at step {step}: the run diverged")
            run.curve.append(point)
            if verbose:
                print(f"{label:>20} step {step:5d}/{steps}: held-out loss {point['val_loss']:.4f}", flush=True)
            train_loss.zero_()
            interval = step
        if step == until:
            break
        wall, cpu = time.perf_counter(), time.process_time()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(s, step, steps)
        x = windows(data["train"], torch.randint(len(data["train"]) - s.block, (s.batch,), generator=run.generator), s.block)
        run.data_order = hashlib.sha1(run.data_order.encode() + x.numpy().tobytes()).hexdigest()
        x = x.to(s.device, non_blocking=True)
        losses = forward_backward(model, {"input_ids": x, "labels": x}, causal=True, autocast=lambda: torch.autocast(
            s.device, dtype=torch.bfloat16, enabled=s.bf16))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train_loss += losses[0]
        run.step += 1
        if s.device == "cuda":
            torch.cuda.synchronize()
        run.timing["steps"] += 1
        run.timing["wall"] += time.perf_counter() - wall
        run.timing["cpu"] += time.process_time() - cpu
    monitor.remove()
    return run
