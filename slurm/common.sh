# shellcheck shell=bash
# Shared preamble of the sbatch scripts (sourced): strict mode, repository root, Python environment, a header line.
#   DA3PO_HOME   the repository checkout (default: the directory `sbatch` was called from)
#   DA3PO_VENV   Python environment to put first on PATH (default: $DA3PO_HOME/.venv). It must live on a filesystem
#                every node mounts; srun steps inherit PATH, so Ray and the driver use it on every node.
set -euo pipefail
DA3PO_HOME=${DA3PO_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$DA3PO_HOME"
DA3PO_VENV=${DA3PO_VENV:-$DA3PO_HOME/.venv}
[[ -x $DA3PO_VENV/bin/python ]] || { echo "error: DA3PO_VENV=$DA3PO_VENV has no bin/python" >&2; exit 1; }
export DA3PO_HOME DA3PO_VENV VIRTUAL_ENV=$DA3PO_VENV PATH=$DA3PO_VENV/bin:$PATH PYTHONUNBUFFERED=1
echo "[da3po $(date +%FT%T)] job ${SLURM_JOB_ID:-?} (${SLURM_JOB_NAME:-?}) run $((${SLURM_RESTART_COUNT:-0} + 1))" \
  "on ${SLURM_JOB_NODELIST:-?}; python $DA3PO_VENV/bin/python; cwd $PWD"
