"""Figures of the comparison report (matplotlib, Agg): every curve is the mean over seeds with a +-std band,
against training steps, generated samples or generated tokens; plus held-out accuracy per group (difficulty bucket or
benchmark) at equal steps, the
filtered fraction, DAA activation and the Theorem 3.1 diagnostic. matplotlib is imported only when figures are drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from da3po_megatron.studies.compare.data import ReportData
from da3po_megatron.studies.compare.stats import mean_std, seed_values, series


def _band(ax, xs_list: Sequence[Sequence[float]], ys_list: Sequence[Sequence[float]], label: str, color: str,
          grid_pts: int = 60, marker: str | None = None) -> None:
    """Mean line +- std band of several runs' curves, interpolated onto a common x grid (the overlap of the runs)."""
    pairs = [(list(x), list(y)) for x, y in zip(xs_list, ys_list) if len(x) > 0]
    if not pairs:
        return
    lo, hi = max(x[0] for x, _ in pairs), min(x[-1] for x, _ in pairs)
    if len(pairs) == 1 or hi <= lo:
        x, y = max(pairs, key=lambda p: len(p[0]))
        ax.plot(x, y, label=label, color=color, marker=marker, markersize=3)
        return
    same_x = all(x == pairs[0][0] for x, _ in pairs)
    grid = np.asarray(pairs[0][0], dtype=float) if same_x else np.linspace(lo, hi, grid_pts)
    ys = np.stack([np.interp(grid, x, y) for x, y in pairs])
    m, s = ys.mean(0), ys.std(0, ddof=1)
    ax.plot(grid, m, label=f"{label} (n={len(pairs)})", color=color, marker=marker if same_x else None, markersize=3)
    ax.fill_between(grid, m - s, m + s, color=color, alpha=0.15, linewidth=0)


def plot_report(d: ReportData, fig_dir: Path) -> list[Path]:
    """Write the report's PNG figures to ``fig_dir``; returns those written (a figure with nothing to draw,
    e.g. DAA activation without a DAA method, is skipped)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    colors = {m.label: f"C{i % 10}" for i, m in enumerate(d.methods)}
    x_names = {"step": "training step", "gen/cumulative_samples": "generated samples (responses)",
               "gen/cumulative_tokens": "generated tokens"}

    def save(fig, name: str) -> None:
        fig.tight_layout()
        p = fig_dir / name
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)

    def panel(ax, key: str, x_key: str, window: int, title: str, ylabel: str, methods=None, marker=None) -> bool:
        drawn = False
        for m in methods or d.methods:
            runs = d.grid.get(m.label, {})
            ss = [series(rows, key, x_key, window) for rows in runs.values()]
            ss = [s for s in ss if s[0]]
            if ss:
                _band(ax, [s[0] for s in ss], [s[1] for s in ss], m.label, colors[m.label], marker=marker)
                drawn = True
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(x_names.get(x_key, x_key))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7)
        return drawn

    # training accuracy vs steps / samples / tokens
    for x_key, name in (("step", "steps"), ("gen/cumulative_samples", "samples"), ("gen/cumulative_tokens",
                                                                                     "tokens")):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        if panel(ax, "acc/mean", x_key, d.window, f"Training accuracy ({d.window}-step trailing mean) vs {name}",
                 "fraction of rollouts correct"):
            save(fig, f"train_acc_vs_{name}.png")
        else:
            plt.close(fig)
    keys = d.keys
    if keys:
        metric, second = keys.names
        kind = keys.group_kind
        for x_key, name in (("step", "steps"), ("gen/cumulative_samples", "samples")):
            fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
            panel(axes[0], keys.key(0), x_key, 1, f"Held-out {metric}, all {kind}s", metric, marker="o")
            if keys.key(1):
                panel(axes[1], keys.key(1), x_key, 1, f"Held-out {second}, all {kind}s", second, marker="o")
            save(fig, f"heldout_vs_{name}.png")
        if d.groups:
            cols = min(4, len(d.groups))
            nrows = math.ceil(len(d.groups) / cols)
            fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 3.0 * nrows), squeeze=False)
            for ax, g in zip(axes.flat, d.groups):
                panel(ax, keys.key(0, g), "gen/cumulative_samples", 1,
                      f"{kind} {g}" + (" (hard)" if g in d.hard else ""), metric, marker="o")
                ax.get_legend() and g != d.groups[0] and ax.get_legend().remove()
            for ax in list(axes.flat)[len(d.groups):]:
                ax.set_visible(False)
            save(fig, "heldout_buckets_vs_samples.png")
        if d.step_point and d.groups:
            fig, ax = plt.subplots(figsize=(max(6.4, 0.9 * len(d.groups) * len(d.methods) / 3), 4.2))
            width = 0.8 / max(len(d.methods), 1)
            for i, m in enumerate(d.methods):
                ms = [mean_std(seed_values(d.grid, m.label, keys.key(0, g), d.step_point)) for g in d.groups]
                xs = np.arange(len(d.groups)) + (i - (len(d.methods) - 1) / 2) * width
                ax.bar(xs, [t[0] for t in ms], width, yerr=[t[1] for t in ms], label=m.label, color=colors[m.label],
                       capsize=2)
            if d.start_acc:
                ax.plot(range(len(d.groups)), [d.start_acc.get(g, math.nan) for g in d.groups], "k_",
                        markersize=18, label="starting policy")
            ax.set_xticks(range(len(d.groups)), d.groups)
            ax.set_xlabel("difficulty bucket (digits)" if kind == "bucket" else kind)
            ax.set_ylabel(metric)
            ax.set_title(f"Held-out {metric} per {kind} at {d.step_point.name} (mean ± std over seeds)", fontsize=10)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3, axis="y")
            save(fig, "heldout_by_bucket.png")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if panel(ax, "filter/frac_filtered", "step", 1, "Dynamic sampling: fraction of generated groups filtered",
             "fraction of groups with p_hat in {0, 1}", [m for m in d.methods if m.filters]):
        save(fig, "filtered_frac.png")
    else:
        plt.close(fig)
    daa_methods = [m for m in d.methods if m.daa]
    if daa_methods:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        panel(axes[0], "daa/activation_frac", "step", 1, "DAA activation (Eq. 14)", "fraction of responses amplified",
              daa_methods)
        panel(axes[1], "daa/lambda_mean", "step", 1, "Mean lambda of amplified responses", "lambda", daa_methods)
        save(fig, "daa_activation.png")
    written += _plot_theory(d, fig_dir, colors, plt)
    return written


def _plot_theory(d: ReportData, fig_dir: Path, colors: dict[str, str], plt) -> list[Path]:
    """Measured kept/all mean-advantage ratio per step vs the Thm 3.1 prediction alpha+/alpha- (filtering methods)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    drawn = False
    for ax, label, alpha in ((axes[0], "correct", "alpha_plus"), (axes[1], "incorrect", "alpha_minus")):
        for m in (m for m in d.methods if m.filters):
            px, py = [], []
            for rows in d.grid.get(m.label, {}).values():
                for r in rows:
                    for b in ("0.0-0.5", "0.5-1.0"):
                        kept, all_ = r.get(f"theory/{b}/adv_{label}_kept"), r.get(f"theory/{b}/adv_{label}_all")
                        pred = r.get(f"theory/{b}/{alpha}")
                        if None not in (kept, all_, pred) and abs(all_) > 1e-9 and r.get(
                                f"theory/{b}/n_{label}_kept", 1) > 0:
                            px.append(pred)
                            py.append(kept / all_)
            if px:
                ax.scatter(px, py, s=8, alpha=0.5, color=colors[m.label], label=m.label)
                drawn = True
        lim = ax.get_xlim() if drawn else (1, 2)
        ax.plot([min(lim[0], 1), lim[1]], [min(lim[0], 1), lim[1]], "k--", lw=0.8, label="y = x (Thm 3.1)")
        ax.set_xlabel(f"predicted {alpha.replace('_', '')} at the kept groups' mean p_hat")
        ax.set_ylabel(f"mean advantage of {label} responses: kept / all")
        ax.set_title(f"Thm 3.1 diagnostic, {label} responses (per step and p_hat bin)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if not drawn:
        plt.close(fig)
        return []
    fig.tight_layout()
    p = fig_dir / "theory_diagnostic.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return [p]
