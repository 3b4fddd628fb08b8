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


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what there is)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _mean(rows: list[list[float]]) -> list[float]:
    return [sum(column) / len(column) for column in zip(*rows)]


def plot_paired_runs(runs: dict[str, list[list[dict]]], path, pretraining: list[dict] | None = None, window: int = 10) -> None:
    """Runs of two models trained on the same batches (one list of metrics records per seed, seed i of one model
    paired with seed i of the other), in panels: [pre-training,] both models' LM loss (train: mean over seeds, moving
    average of `window` steps; eval: mean over seeds, markers), and the first model minus the second per step and per
    seed (train, thin; their mean, moving average, thick; eval, markers). Steps are those of the paired runs."""
    (name_a, runs_a), (name_b, runs_b) = runs.items()
    plt = _pyplot()
    panels = 3 if pretraining else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    if pretraining:
        ax = axes[0]
        ax.plot(*curve(pretraining, "train/lm_loss"), color="gray", label="train")
        if (points := curve(pretraining, "eval/loss")) is not None:
            ax.plot(*points, color="black", marker="o", linestyle="--", label="held-out")
        ax.set_title("dense pre-training")
        ax.set_xlabel("step")
        ax.set_ylabel("LM cross-entropy")
    ax = axes[-2]
    for (name, seeds), color in zip(runs.items(), ("tab:red", "tab:blue")):
        steps = curve(seeds[0], "train/lm_loss")[0]
        ax.plot(steps, _smooth(_mean([curve(r, "train/lm_loss")[1] for r in seeds]), window), color=color, label=f"{name}, train")
        eval_steps = curve(seeds[0], "eval/loss")[0]
        ax.plot(eval_steps, _mean([curve(r, "eval/loss")[1] for r in seeds]), color=color, marker="o", linestyle="--",
                label=f"{name}, held-out")
    ax.set_title(f"fine-tuning (mean of {len(runs_a)} seed{'s' * (len(runs_a) > 1)})")
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel("LM cross-entropy")
    ax = axes[-1]
    train_diffs = []
    for seed, (a, b) in enumerate(zip(runs_a, runs_b)):
        steps, va = curve(a, "train/lm_loss")
        train_diffs.append([x - y for x, y in zip(va, curve(b, "train/lm_loss")[1])])
        ax.plot(steps, train_diffs[-1], color="tab:purple", alpha=0.25, linewidth=0.7, label="train, per seed" if seed == 0 else None)
        eval_steps, ea = curve(a, "eval/loss")
        ax.plot(eval_steps, [x - y for x, y in zip(ea, curve(b, "eval/loss")[1])], color="black", marker="o",
                linestyle="none", label="held-out, per seed" if seed == 0 else None)
    ax.plot(steps, _smooth(_mean(train_diffs), window), color="tab:purple", linewidth=2,
            label=f"train, mean ({window}-step average)")
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_title(f"{name_a} minus {name_b} (below 0: {name_a} is better)")
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel("LM cross-entropy difference")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    _save(fig, path)


def plot_expert_share(panels: dict[str, dict[str, list[float]]], path) -> None:
    """Heatmaps of the share of routes each expert receives in each MoE layer, one panel per title:
    {title: {layer name: [share of expert 0, 1, ...]}}; cells annotated in percent."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 0.6 + 0.55 * max(len(p) for p in panels.values()) + 1.2),
                             squeeze=False)
    uniform = 100 / len(next(iter(next(iter(panels.values())).values())))
    top = max(2 * uniform, *(100 * v for shares in panels.values() for row in shares.values() for v in row))  # one scale
    for ax, (title, shares) in zip(axes[0], panels.items()):
        layers = list(shares)
        grid = [[100 * v for v in shares[layer]] for layer in layers]
        image = ax.imshow(grid, cmap="viridis", vmin=0, vmax=top, aspect="auto")
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=7,
                        color="white" if value < uniform else "black")
        ax.set_xticks(range(len(grid[0])))
        ax.set_yticks(range(len(layers)), layers)
        ax.set_xlabel("expert")
        ax.set_title(title, fontsize=9)
        fig.colorbar(image, ax=ax, label=f"% of routes (uniform: {uniform:.1f})")
    _save(fig, path)
