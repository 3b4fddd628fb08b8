"""The demo's plots (matplotlib, files only): held-out loss of every arm against training tokens, the MoE-minus-dense
difference per seed, and the share of routes each expert receives in each MoE layer."""

from __future__ import annotations

import statistics
from pathlib import Path


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what there is)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def mean_curve(rows: list[list[float]]) -> list[float]:
    """The pointwise mean of equally long curves."""
    return [sum(column) / len(column) for column in zip(*rows)]


def _curves(runs: dict[int, dict]) -> tuple[list[int], dict[int, list[float]]]:
    """(training tokens, {seed: held-out losses}) of one arm's runs."""
    first = next(iter(runs.values()))
    return [p["tokens"] for p in first["curve"]], {seed: [p["val_loss"] for p in r["curve"]] for seed, r in runs.items()}


def plot_comparison(arms: dict[str, dict[int, dict]], pairs: list[tuple[str, str, str]], path: Path) -> None:
    """One column per pair (title, arm, baseline): above, the held-out loss of both arms (and any other arm given
    for the pair's baseline tokens) against training tokens, each seed thin and the mean thick; below, arm minus
    baseline per seed (thin) and their mean (thick)."""
    plt = pyplot()
    fig, axes = plt.subplots(2, len(pairs), figsize=(6 * len(pairs), 7.5), squeeze=False)
    colors = {"dense_scratch": "tab:blue", "moe_scratch": "tab:red", "dense_wide": "tab:gray",
              "dense_continued": "tab:blue", "moe_upcycled": "tab:red"}
    for column, (title, arm, baseline) in enumerate(pairs):
        top, bottom = axes[0, column], axes[1, column]
        shown = [arm, baseline] + (["dense_wide"] if column == 0 and "dense_wide" in arms else [])
        tail = []
        for name in shown:
            tokens, losses = _curves(arms[name])
            for values in losses.values():
                top.plot(tokens, values, color=colors[name], alpha=0.3, linewidth=0.8)
            mean = mean_curve(list(losses.values()))
            top.plot(tokens, mean, color=colors[name], linewidth=2.2, label=f"{name} (mean of {len(losses)} seeds)")
            tail += mean[len(mean) // 3:]
        top.set_ylim(min(tail) - 0.05, max(tail) + 0.1)
        top.set(title=title, xlabel="training tokens", ylabel="held-out loss (nats per token)")
        tokens, mine = _curves(arms[arm])
        theirs = _curves(arms[baseline])[1]
        diffs = {seed: [a - b for a, b in zip(mine[seed], theirs[seed])] for seed in mine if seed in theirs}
        for seed, values in diffs.items():
            bottom.plot(tokens[1:], values[1:], color="tab:purple", alpha=0.45, linewidth=0.9, marker=".",
                        label=f"seed {seed}")
        bottom.plot(tokens[1:], mean_curve(list(diffs.values()))[1:], color="tab:purple", linewidth=2.4, label="mean")
        bottom.axhline(0.0, color="black", linewidth=0.8)
        bottom.set(title=f"{arm} minus {baseline} (< 0: MoE better)", xlabel="training tokens",
                   ylabel="held-out loss difference")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    save(fig, path)


def plot_expert_share(panels: dict[str, dict[str, list[float]]], path: Path) -> None:
    """Heatmaps of the share of routes each expert receives in each MoE layer, one panel per title:
    {title: {layer name: [share of expert 0, 1, ...]}}; cells annotated in percent, twice uniform or more is the
    top of each panel's scale."""
    plt = pyplot()
    rows = max(len(p) for p in panels.values())
    widths = [len(next(iter(p.values()))) for p in panels.values()]
    fig, axes = plt.subplots(1, len(panels), figsize=(sum(0.42 * w + 2.2 for w in widths), 0.55 * rows + 1.9),
                             squeeze=False, gridspec_kw={"width_ratios": widths})
    for ax, (title, shares) in zip(axes[0], panels.items()):
        layers = list(shares)
        grid = [[100 * v for v in shares[layer]] for layer in layers]
        uniform = 100 / len(grid[0])
        top = max(2 * uniform, *(v for row in grid for v in row))
        image = ax.imshow(grid, cmap="viridis", vmin=0, vmax=top, aspect="auto")
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=7,
                        color="white" if value < uniform else "black")
        ax.set_xticks(range(len(grid[0])))
        ax.set_yticks(range(len(layers)), layers)
        ax.set_xlabel(f"expert (uniform: {uniform:.1f}%)")
        ax.set_title(title, fontsize=9)
        fig.colorbar(image, ax=ax, label="% of routes")
    save(fig, path)


def spread(shares: dict[str, list[float]]) -> tuple[float, float]:
    """The smallest and largest share of any expert in any layer."""
    return min(min(r) for r in shares.values()), max(max(r) for r in shares.values())


def mean_and_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0
