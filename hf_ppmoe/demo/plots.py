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
    """One column per pair (title, arm, baseline): above, the held-out loss of both arms (and `dense_wide` beside
    the first pair when it ran) against training tokens, each seed thin and the mean thick, on a log scale that
    shows every curve from its first point; below, arm minus baseline at the arm's points, each seed in its own
    colour, and their mean (thick)."""
    plt = pyplot()
    from matplotlib.ticker import ScalarFormatter

    fig, axes = plt.subplots(2, len(pairs), figsize=(6 * len(pairs), 7.5), squeeze=False)
    colors = {"dense": "tab:blue", "moe_scratch": "tab:red", "dense_wide": "tab:gray", "moe_upcycled": "tab:orange"}
    seed_colors = plt.get_cmap("tab10").colors
    for column, (title, arm, baseline) in enumerate(pairs):
        top, bottom = axes[0, column], axes[1, column]
        shown = [arm, baseline] + (["dense_wide"] if column == 0 and "dense_wide" in arms else [])
        for name in shown:
            tokens, losses = _curves(arms[name])
            for values in losses.values():
                top.plot(tokens, values, color=colors[name], alpha=0.3, linewidth=0.8)
            top.plot(tokens, mean_curve(list(losses.values())), color=colors[name], linewidth=2.2,
                     label=f"{name} (mean of {len(losses)} seeds)")
        top.set_yscale("log")
        top.yaxis.set_major_formatter(ScalarFormatter())
        top.yaxis.set_minor_formatter(ScalarFormatter())
        top.set(title=title, xlabel="training tokens", ylabel="held-out loss (nats per token, log scale)")
        tokens, mine = _curves(arms[arm])
        base_tokens, theirs = _curves(arms[baseline])
        at = {t: i for i, t in enumerate(base_tokens)}
        keep = [i for i, t in enumerate(tokens) if t in at and t > 0]
        xs = [tokens[i] for i in keep]
        diffs = {seed: [mine[seed][i] - theirs[seed][at[tokens[i]]] for i in keep] for seed in mine if seed in theirs}
        for n, (seed, values) in enumerate(diffs.items()):
            bottom.plot(xs, values, color=seed_colors[n % len(seed_colors)], alpha=0.8, linewidth=1.0, marker=".",
                        label=f"seed {seed}")
        bottom.plot(xs, mean_curve(list(diffs.values())), color="black", linewidth=2.4, label="mean")
        bottom.axhline(0.0, color="black", linewidth=0.8, linestyle=":")
        bottom.set(title=f"{arm} minus {baseline} (< 0: MoE better)", xlabel="training tokens",
                   ylabel="held-out loss difference (nats)")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    save(fig, path)


def plot_expert_share(panels: dict[str, dict[str, list[float]]], path: Path) -> None:
    """Heatmaps of the share of routes each expert receives in each MoE layer, one panel per title:
    {title: {layer name: [share of expert 0, 1, ...]}}, cells annotated in percent, as a multiple of uniform (1 =
    every expert equal) on one colour scale for all panels (their experts may differ in number)."""
    plt = pyplot()
    rows = max(len(p) for p in panels.values())
    widths = [len(next(iter(p.values()))) for p in panels.values()]
    grids = {title: [[v * len(row) for v in row] for row in shares.values()] for title, shares in panels.items()}
    top = max(2.0, *(v for grid in grids.values() for row in grid for v in row))
    fig, axes = plt.subplots(1, len(panels), figsize=(sum(0.42 * w + 1.6 for w in widths) + 1.2, 0.55 * rows + 2.2),
                             squeeze=False, gridspec_kw={"width_ratios": widths}, layout="constrained")
    for ax, (title, shares) in zip(axes[0], panels.items()):
        layers, grid = list(shares), grids[title]
        image = ax.imshow(grid, cmap="viridis", vmin=0, vmax=top, aspect="auto")
        for i, row in enumerate(shares.values()):
            for j, value in enumerate(row):
                ax.text(j, i, f"{100 * value:.0f}", ha="center", va="center", fontsize=7,
                        color="white" if grid[i][j] < 1 else "black")
        ax.set_xticks(range(len(grid[0])))
        ax.set_yticks(range(len(layers)), layers)
        ax.set_xlabel(f"expert (uniform: {100 / len(grid[0]):.1f}%)")
        ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=list(axes[0]), label="share of routes / uniform share")
    fig.suptitle("Share of routes each expert receives (cells: % of the layer's routes)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def spread(shares: dict[str, list[float]]) -> tuple[float, float]:
    """The smallest and largest share of any expert in any layer."""
    return min(min(r) for r in shares.values()), max(max(r) for r in shares.values())


def mean_and_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0
