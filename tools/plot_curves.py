#!/usr/bin/env python
"""Training curves of one or more runs, overlaid: reward, accuracy, validation avg@k (AIME24 = the paper's Figure 3),
DAA activation and the fraction filtered by dynamic sampling, from each ``RUN_DIR/metrics.jsonl``.

    python tools/plot_curves.py runs/dapo runs/da3po --out outputs/curves [--labels DAPO,DA3PO] [--x samples]
                                [--smooth 0.6]

Missing keys are skipped (a GRPO run has no ``daa/activation_frac``). The implementation is
``da3po_megatron.eval.curves.plot_runs`` (importable by the trainer and the demo).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from da3po_megatron.eval.curves import plot_runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories holding metrics.jsonl (or .jsonl files)")
    p.add_argument("--out", type=Path, required=True, help="directory for the PNG files")
    p.add_argument("--labels", default=None, help="comma-separated legend labels (default: run directory names)")
    p.add_argument("--x", default="step", choices=["step", "samples"],
                   help="x axis: training step or gen/cumulative_samples")
    p.add_argument("--smooth", type=float, default=0.0, help="EMA factor in [0, 1) for training curves")
    args = p.parse_args(argv)
    try:
        paths = plot_runs(args.runs, args.out, labels=args.labels.split(",") if args.labels else None, x=args.x,
                          smooth=args.smooth)
    except (FileNotFoundError, ValueError) as e:
        print(f"plot_curves: error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0 if paths else 1


if __name__ == "__main__":
    sys.exit(main())
