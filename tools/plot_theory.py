#!/usr/bin/env python
"""Draw the paper's Figures 1-2: alpha+, alpha- and gamma of Theorem 3.1 vs p in (0, 1) for G in {4, 8, 16, 32}.

    python tools/plot_theory.py --out outputs/theory      (``make theory``; also run by ``make demo``)

Writes ``fig1_alpha.png`` (alpha+ and alpha-, two panels) and ``fig2_gamma.png`` (gamma, with gamma = 1 marked) into
``--out`` and prints their paths. Closed forms from ``da3po_megatron.algorithms.theory``; matplotlib with the Agg
backend (no display needed).
"""

from __future__ import annotations

import argparse
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from da3po_megatron.algorithms.theory import alpha_minus, alpha_plus, gamma  # noqa: E402 (after the Agg backend)

DEFAULT_GS = (4, 8, 16, 32)


def plot(out_dir: str, group_sizes: tuple[int, ...] = DEFAULT_GS, num_points: int = 999, dpi: int = 150) -> list[str]:
    """Write the two figures into ``out_dir`` and return their paths."""
    os.makedirs(out_dir, exist_ok=True)
    p = torch.linspace(0.0, 1.0, num_points + 2, dtype=torch.float64)[1:-1]  # open interval (0, 1)
    ps = p.numpy()
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for G in group_sizes:
        axes[0].plot(ps, alpha_plus(p, G).numpy(), label=f"G = {G}")
        axes[1].plot(ps, alpha_minus(p, G).numpy(), label=f"G = {G}")
    axes[0].set_title(r"$\alpha^+ = 1 / (1 - p^{G-1})$ (correct responses)")
    axes[1].set_title(r"$\alpha^- = 1 / (1 - (1-p)^{G-1})$ (incorrect responses)")
    for ax in axes:
        ax.set_xlabel("p (probability that a response is correct)")
        ax.set_ylim(0.9, 4.0)
        ax.set_xlim(0.0, 1.0)
        ax.axhline(1.0, color="gray", lw=0.8, ls=":")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("scaling of E[advantage] after filtering")
    fig.suptitle("Figure 1: dynamic sampling rescales expected advantages (Theorem 3.1)")
    fig.tight_layout()
    path = os.path.join(out_dir, "fig1_alpha.png")
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    paths.append(path)

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for G in group_sizes:
        ax.plot(ps, gamma(p, G).numpy(), label=f"G = {G}")
    ax.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax.axvline(0.5, color="gray", lw=0.8, ls=":")
    ax.set_xlim(0.0, 1.0)
    ax.set_ylim(0.0, 3.0)
    ax.set_xlabel("p (probability that a response is correct)")
    ax.set_ylabel(r"$\gamma = \alpha^+ / \alpha^-$")
    ax.set_title(r"Figure 2: imbalance $\gamma$ (< 1 iff p < 0.5; Corollary 3.2)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, "fig2_gamma.png")
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory (created if missing)")
    ap.add_argument("--G", type=int, nargs="+", default=list(DEFAULT_GS), help="group sizes to draw")
    ap.add_argument("--dpi", type=int, default=150)
    args = ap.parse_args(argv)
    if any(G < 2 for G in args.G):
        ap.error(f"--G values must be >= 2, got {args.G}")
    for path in plot(args.out, tuple(args.G), dpi=args.dpi):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
