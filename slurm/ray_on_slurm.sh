# shellcheck shell=bash
# Ray on a Slurm allocation: `source slurm/ray_on_slurm.sh` from inside an sbatch script (it runs on the first node).
#
# It starts the Ray head on the batch node and one Ray worker on every other node of the allocation, each as an srun
# step (`srun --nodes=1 --ntasks=1 -w <host> ray start ... --block`), waits until all nodes have joined, exports
# RAY_ADDRESS (so a driver's plain `ray.init()` connects), and installs an EXIT trap that stops Ray on all nodes.
# Scripts that need their own EXIT trap call `ray_on_slurm_stop` from it. The usual recipe (Ray docs "Deploying on
# Slurm", NeMo-RL's ray.sub); never `ray stop` here: on shared machines it kills other users' Ray processes too.
#
# Environment (all optional):
#   RAY_PORT=6379            GCS port of the head
#   RAY_GPUS_PER_NODE        GPUs each Ray node advertises (default: $GPUS_PER_NODE, else $SLURM_GPUS_ON_NODE -- what
#                            the allocation has on this node, from --gpus-per-node / --gres=gpu:N --, else 0); the
#                            log line says which one it used
#   RAY_CPUS_PER_NODE        CPUs each Ray node advertises and its srun step gets (default: $SLURM_CPUS_ON_NODE)
#   RAY_JOIN_TIMEOUT=300     seconds to wait for all nodes to join before failing
#   RAY_TMPDIR               Ray's temp dir root, $RAY_TMPDIR/<hostname> per node (default /tmp/ray_j$SLURM_JOB_ID)
#   RAY_HEAD_IP              head address workers and drivers connect to (default: `hostname --ip-address`, first one)
#   RAY_START_ARGS           extra arguments for every `ray start` (e.g. --object-store-memory=...)
#   RAY_HEAD_ARGS            extra arguments for the head only (default --include-dashboard=false)
#   RAY_AUTH_MODE=token      Ray's token authentication; with token (default) and neither RAY_AUTH_TOKEN nor
#                            RAY_AUTH_TOKEN_PATH set, a fresh random token is made for this job and exported to every
#                            node and the driver
# Exports: RAY_ADDRESS=<head ip>:<port>, RAY_HEAD_NODE, RAY_NODES (space-separated hostnames), RAY_NUM_NODES.

ray_on_slurm_log() { echo "[ray_on_slurm $(date +%T)] $*"; }

ray_on_slurm_stop() {
  # Stop every `ray start --block` step: srun forwards SIGUSR2 to the step's processes (SIGTERM is blocked in them,
  # see slurm/ray_node.sh), `ray start --block` exits and the raylet/GCS it started die with it (Ray's
  # kill-on-parent-death), the workers follow their raylet; Slurm escalates to SIGKILL after KillWait.
  [[ -n ${RAY_ON_SLURM_PIDS:-} ]] || return 0
  ray_on_slurm_log "stopping Ray on ${RAY_NODES:-?}"
  # shellcheck disable=SC2086  # one pid per word
  kill -USR2 $RAY_ON_SLURM_PIDS 2>/dev/null || true
  # shellcheck disable=SC2086
  wait $RAY_ON_SLURM_PIDS 2>/dev/null || true
  RAY_ON_SLURM_PIDS=""
  srun --overlap --nodes="$RAY_NUM_NODES" --ntasks-per-node=1 rm -rf "$RAY_TMPDIR" 2>/dev/null || true
  rm -rf "$RAY_TMPDIR"  # this (head) node's, also when the job is being cancelled and no new step can start
}

ray_on_slurm_start() {
  : "${SLURM_JOB_ID:?ray_on_slurm.sh must run inside a Slurm allocation (SLURM_JOB_ID is not set)}"
  command -v ray >/dev/null || { echo "ray_on_slurm: error: no 'ray' on PATH (activate the venv first)" >&2; return 1; }
  local port=${RAY_PORT:-6379} gpus=${RAY_GPUS_PER_NODE:-${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}}
  local cpus=${RAY_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-1}} timeout=${RAY_JOIN_TIMEOUT:-300} gpu_src
  if [[ -n ${RAY_GPUS_PER_NODE:-} ]]; then gpu_src="RAY_GPUS_PER_NODE=$RAY_GPUS_PER_NODE"
  elif [[ -n ${GPUS_PER_NODE:-} ]]; then gpu_src="GPUS_PER_NODE=$GPUS_PER_NODE"
  elif [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then gpu_src="the allocation: SLURM_GPUS_ON_NODE=$SLURM_GPUS_ON_NODE"
  else gpu_src="none allocated: no --gpus-per-node / --gres=gpu"; fi
  export RAY_TMPDIR=${RAY_TMPDIR:-/tmp/ray_j$SLURM_JOB_ID}
  # Explicit auth mode: left unset, Ray >= 2.5x switches a head to token mode whenever ~/.ray/auth_token exists (any
  # local `ray.init()` on a shared home writes one) while drivers and workers stay disabled, and nothing can connect.
  export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
  if [[ $RAY_AUTH_MODE == token && -z ${RAY_AUTH_TOKEN:-} && -z ${RAY_AUTH_TOKEN_PATH:-} ]]; then
    RAY_AUTH_TOKEN=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')  # 256 bits, like `ray get-auth-token --generate`
    export RAY_AUTH_TOKEN
  fi

  # The head goes on the node running this script, so the driver started here finds a local raylet.
  local head=${SLURMD_NODENAME:-$(hostname -s)} nodes=() n
  for n in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do [[ $n == "$head" ]] || nodes+=("$n"); done
  nodes=("$head" "${nodes[@]}")
  local head_ip=${RAY_HEAD_IP:-$(hostname --ip-address | awk '{print $1}')}
  export RAY_HEAD_NODE=$head RAY_NODES="${nodes[*]}" RAY_NUM_NODES=${#nodes[@]} RAY_ADDRESS=$head_ip:$port
  ray_on_slurm_log "head $head ($RAY_ADDRESS), ${#nodes[@]} node(s): ${nodes[*]}; $cpus CPUs + $gpus GPUs per node ($gpu_src)"
  trap ray_on_slurm_stop EXIT

  # Every Ray node: its own IP (resolved on that node), CPUs/GPUs, and a per-node temp dir (short: sockets live there).
  # shellcheck disable=SC2016  # expanded on the node, not here
  local common='--node-ip-address="$(hostname --ip-address | cut -d" " -f1)" --temp-dir="$RAY_TMPDIR/$(hostname -s)"'
  common+=" --num-cpus=$cpus --num-gpus=$gpus --disable-usage-stats --block ${RAY_START_ARGS:-}"
  local srun_args=(--overlap --nodes=1 --ntasks=1 --cpus-per-task="$cpus" --kill-on-bad-exit=0)

  # ray_node.sh: SIGTERM blocked in Ray (a job-wide SIGTERM must not stop it before the driver's checkpoint); the
  # head's wrapper relays SIGTERM to the pid in $RAY_TMPDIR/driver.pid (written by train.sbatch)
  local node_sh
  node_sh="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/ray_node.sh"
  mkdir -p "$RAY_TMPDIR"
  srun "${srun_args[@]}" -w "$head" bash -c \
    "exec $node_sh $RAY_TMPDIR/driver.pid ray start --head --port=$port ${RAY_HEAD_ARGS:---include-dashboard=false} $common" &
  RAY_ON_SLURM_PIDS="$!"
  local t0=$SECONDS
  until (exec 3<>"/dev/tcp/${head_ip}/$port") 2>/dev/null; do  # the GCS port accepts connections
    if ((SECONDS - t0 > timeout)); then
      echo "ray_on_slurm: error: Ray head on $head did not open $RAY_ADDRESS within ${timeout}s" >&2; return 1
    fi
    kill -0 "$RAY_ON_SLURM_PIDS" 2>/dev/null || { echo "ray_on_slurm: error: Ray head on $head exited" >&2; return 1; }
    sleep 0.5
  done
  for n in "${nodes[@]:1}"; do
    srun "${srun_args[@]}" -w "$n" bash -c "exec $node_sh - ray start --address=$RAY_ADDRESS $common" &
    RAY_ON_SLURM_PIDS+=" $!"
  done

  # Wait until every node is alive in the GCS; name the missing ones on timeout.
  python - "$RAY_ADDRESS" "$timeout" "${nodes[@]}" <<'PY' || return 1
import sys, time
import ray
addr, timeout, want = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
t0 = time.time()
ray.init(address=addr, logging_level="ERROR", log_to_driver=False)
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= len(want) or time.time() - t0 > timeout:
        break
    time.sleep(0.5)
joined = sorted(n["NodeManagerHostname"] for n in alive)
ray.shutdown()
if len(alive) < len(want):
    missing = sorted(set(want) - set(joined))
    sys.exit(f"ray_on_slurm: error: only {len(alive)} of {len(want)} nodes joined Ray at {addr} within {timeout:.0f}s "
             f"(joined: {joined}; missing: {missing}); see the `ray start` output above")
print(f"[ray_on_slurm] all {len(alive)} nodes joined in {time.time() - t0:.1f}s: {joined}", flush=True)
PY
}

ray_on_slurm_start
