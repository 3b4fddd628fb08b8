"""What a user watches during training: router statistics, a JSON-lines tracker for Accelerate, PNG plots."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate.tracking import GeneralTracker

from ..moe.observe import RoutingHooks
from ..moe.routing import Routing


class RouterMonitor:
    """Sums, per MoE layer of `model`, the tokens each expert received and the routes the router chose but capacity
    dropped, until `collect()` is called (no global state: one monitor per model). It reads the `Routing` every layer
    returns through `hf_ppmoe.moe.observe.RoutingHooks`; names are `model.named_modules()`'s."""

    def __init__(self, model: torch.nn.Module):
        self.hooks = RoutingHooks(model, self._add)
        self.reset()

    @property
    def layers(self) -> dict:
        return self.hooks.layers

    def keep_only(self, module: torch.nn.Module) -> None:
        """Forget the layers `module` does not hold (a pipeline stage cut from the model): names stay the whole
        model's."""
        self.hooks.keep_only(module)

    def _add(self, name: str, routing: Routing) -> None:
        if routing.tokens_per_expert is None:  # losses/statistics were not computed (inference)
            return
        self.tokens[name] = self.tokens.get(name, 0) + routing.tokens_per_expert.detach().float()
        self.dropped[name] = self.dropped.get(name, 0) + routing.dropped_fraction.detach().float()
        self.calls[name] = self.calls.get(name, 0) + 1

    def reset(self):
        self.tokens, self.dropped, self.calls = {}, {}, {}

    @contextmanager
    def separately(self):
        """Statistics gathered (and collected) inside the block are kept apart from those gathered outside it, which
        go on accumulating afterwards: an evaluation in the middle of a logging interval."""
        saved = self.tokens, self.dropped, self.calls
        self.reset()
        try:
            yield
        finally:
            self.tokens, self.dropped, self.calls = saved

    def collect(self, reduce=lambda t: t) -> dict[str, float]:
        """Per layer: coefficient of variation of expert load (0 = perfectly balanced), the largest expert's load over
        the mean (1 = balanced; the capacity a dropless step needed), the experts that received no route ("dead") and
        the dropped-route fraction. Loads are the routes each expert received over the interval (real tokens, after
        capacity: they sum to tokens x k minus the dropped routes). `reduce` sums a tensor over data-parallel
        processes (e.g. accelerator.reduce)."""
        metrics = {}
        for name, tokens in self.tokens.items():
            tokens = reduce(tokens)
            short = name.removeprefix("model.").removesuffix(".mlp")
            mean = tokens.mean().clamp(min=1e-9)
            metrics[f"expert_load_cv/{short}"] = (tokens.std(unbiased=False) / mean).item()
            metrics[f"load_max_over_mean/{short}"] = (tokens.max() / mean).item()
            metrics[f"dead_experts/{short}"] = int((tokens == 0).sum())
            metrics[f"dropped_fraction/{short}"] = (reduce(self.dropped[name]) / reduce(torch.tensor(float(self.calls[name])))).item()
        self.reset()
        return metrics

    def remove(self):
        self.hooks.remove()


class JSONLinesTracker(GeneralTracker):
    """An Accelerate tracker writing one JSON object per `log` call to `<logging_dir>/metrics.jsonl`.

    Nothing is written before `init_trackers` (`store_init_configuration`), called when training starts: a run that
    fails before it leaves the folder's earlier logs as they were. Then a new run starts an empty file, and a resumed
    one drops the entries after its step (and a line torn by a kill), so the file reads as one uninterrupted run."""

    name = "jsonl"
    requires_logging_directory = True
    main_process_only = True

    def __init__(self, run_name: str, logging_dir: str, resume_step: int | None = None):
        super().__init__()
        self.path = Path(logging_dir) / "metrics.jsonl"
        self.resume_step = resume_step

    @property
    def tracker(self):
        return self.path

    def store_init_configuration(self, values: dict):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if self.resume_step is not None and self.path.exists():
            kept = [line for line in read_jsonl(self.path) if line.get("step", 0) <= self.resume_step]
        self.path.write_text("".join(json.dumps(line) + "\n" for line in kept))
        (self.path.parent / "run_config.json").write_text(json.dumps(values, indent=2, default=str))

    def log(self, values: dict, step: int | None = None, **kwargs):
        record = {"step": step, **{k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in values.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def read_jsonl(path) -> list[dict]:
    """The records of a metrics file. A last line without its newline that is not JSON was torn by a kill mid-write
    and is left out; any other line that is not JSON raises ValueError naming it."""
    text = Path(path).read_text()
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError as error:
            if number == len(lines) and not text.endswith("\n"):
                break
            raise ValueError(f"{path}:{number} is not a JSON line ({error}).") from error
    return records


def curve(records: list[dict], key: str) -> tuple[list, list] | None:
    """(steps, values) of `key` in metrics records, or None where it never appears."""
    points = [(r["step"], r[key]) for r in records if key in r]
    return ([s for s, _ in points], [v for _, v in points]) if points else None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)


def plot_expert_load(records: list[dict], path, xlabel: str = "step") -> bool:
    """PNG of the expert-load coefficient of variation of every MoE layer over training; False if there is none."""
    layers = sorted({k.split("/", 1)[1] for r in records for k in r if k.startswith("expert_load_cv/")})
    if not layers:
        return False
    fig, ax = _pyplot().subplots(figsize=(6.5, 4))
    for layer in layers:
        ax.plot(*curve(records, f"expert_load_cv/{layer}"), label=layer)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("coefficient of variation of expert load")
    ax.set_title("expert load per MoE layer (0 = perfectly balanced)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(fig, path)
    return True


def plot_training(metrics_path, out_dir) -> list[Path]:
    """loss.png (train and eval loss) and expert_load.png (load CV per MoE layer) from the metrics log."""
    records = read_jsonl(metrics_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    fig, ax = _pyplot().subplots(figsize=(6, 4))
    for key, label in (("train/lm_loss", "train LM loss"), ("eval/loss", "eval loss")):
        if (s := curve(records, key)) is not None:
            ax.plot(*s, label=label, marker="o" if key.startswith("eval") else None)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.legend()
    ax.grid(alpha=0.3)
    _save(fig, out_dir / "loss.png")
    written = [out_dir / "loss.png"]
    if plot_expert_load(records, out_dir / "expert_load.png"):
        written.append(out_dir / "expert_load.png")
    return written
