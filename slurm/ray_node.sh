#!/bin/bash
# One Ray node of a Slurm job, run by slurm/ray_on_slurm.sh as an srun step:  ray_node.sh RELAY_FILE ray start ...
#
# Slurm ends a job (scancel, preemption, time limit) by sending SIGTERM to EVERY process of every step, then SIGKILL
# after KillWait (30 s by default). Ray's raylet and GCS stop at once on SIGTERM, which would take the policy and
# the engines with them before the driver can write its checkpoint. So `ray start` runs here with SIGTERM *blocked*
# (the mask is inherited by the raylet, the GCS, every worker and actor: the signal stays pending, never delivered),
# and this wrapper relays the SIGTERM it receives to the pid in RELAY_FILE (the driver; head node only, "-" = none).
# The policy ranks and engines ignore SIGTERM (DA3PO_IGNORE_SIGTERM=1, exported below). Ray is stopped with SIGUSR2 (slurm/ray_on_slurm.sh: ray_on_slurm_stop), or by Slurm's final SIGKILL.
set -uo pipefail
relay_file=$1
shift
# shellcheck disable=SC2329  # invoked by the trap below
relay() {
  local pid=""
  [[ $relay_file != - && -s $relay_file ]] && pid=$(<"$relay_file")
  if [[ -n $pid ]]; then
    echo "[ray_node $(date +%T)] SIGTERM: relayed to the driver (pid $pid); Ray keeps running until it is done"
    kill -TERM "$pid" 2>/dev/null || true
  fi
}
trap relay TERM
# Ray's process spawner unblocks the mask for its workers and Ray's worker exits on SIGTERM: our actors ignore it
# themselves when they see this (megatron/runtime.py: ignore_job_sigterm)
export DA3PO_IGNORE_SIGTERM=1
python -c 'import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}); os.execvp(sys.argv[1], sys.argv[1:])' "$@" &
child=$!
rc=0
while kill -0 "$child" 2>/dev/null; do
  rc=0; wait "$child" || rc=$?  # returns early (status > 128) when a trapped signal arrives: keep waiting
done
exit "$rc"
