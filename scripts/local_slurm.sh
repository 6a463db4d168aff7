#!/usr/bin/env bash
# A real multi-node Slurm cluster on ONE machine, for tests and demos (Debian 12, Slurm 22.05, run as root).
#
#   scripts/local_slurm.sh up       install packages if missing, start munge + slurmctld + NODES slurmd; idempotent,
#                                   ~10 s from nothing, <1 s when already up
#   scripts/local_slurm.sh down     cancel jobs, stop the daemons it started, remove namespaces/config/state
#   scripts/local_slurm.sh status   daemons, nodes, queue (exit 0 when every node is usable, 1 otherwise)
#
# Each compute node nodeN is a slurmd in its own network namespace (IP $SUBNET.1N on bridge lslurmbr0) and UTS
# namespace (hostname nodeN); the controller listens on $SUBNET.1 on the host. Only network + hostname are separated:
# the filesystem (so /work/main/.venv or $DA3PO_VENV), the process table and the CPUs are shared, which is what lets
# jobs use the project's venv directly. Never run `ray stop` inside a job here: it would kill every Ray on the machine.
#
# Environment (all optional):
#   NODES=3             compute nodes node1..nodeN (2..9)
#   NODE_CPUS=2         CPUs Slurm believes each node has (virtual: all nodes share the machine's cores)
#   NODE_MEM_MB=4000    memory Slurm believes each node has
#   FAKE_GPUS=0         N > 0: each node advertises gres gpu:N, backed by dummy char devices (no real GPU)
#   LOCAL_SLURM_ROOT    state, logs and spool (default ${TMPDIR:-/tmp}/local-slurm)
#   SUBNET=10.250.0     /24 for the bridge and the node addresses
# Adapted from /work/shared/reference/local-slurm (measured there: setup ~9 s, 2 Ray nodes alive in 1.5-3 s).
set -euo pipefail

CMD=${1:-}
NODES=${NODES:-3}
NODE_CPUS=${NODE_CPUS:-2}
NODE_MEM_MB=${NODE_MEM_MB:-4000}
FAKE_GPUS=${FAKE_GPUS:-0}
ROOT=${LOCAL_SLURM_ROOT:-${TMPDIR:-/tmp}/local-slurm}
SUBNET=${SUBNET:-10.250.0}
BR=lslurmbr0
CONF=/etc/slurm/slurm.conf
GRESCONF=/etc/slurm/gres.conf
MARK="# managed-by: da3po-megatron scripts/local_slurm.sh"
PKGS=(slurmctld slurmd slurm-client munge iproute2 util-linux)
T0=$(date +%s.%N)

log() { printf '[local_slurm %5.1fs] %s\n' "$(awk -v a="$(date +%s.%N)" -v b="$T0" 'BEGIN{print a-b}')" "$*"; }
die() { echo "local_slurm: error: $*" >&2; exit 1; }
# A pid is running when /proc says so and it is not a zombie; a pid file is alive when its pid runs the right program.
running() { local st; st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1); [[ -n $st && $st != Z ]]; }
alive() { [[ -s $1 ]] && running "$(cat "$1")" && [[ $(cat "/proc/$(cat "$1")/comm" 2>/dev/null) == "$2" ]]; }
node_addr() { echo "$SUBNET.$((10 + $1))"; }
ready_count() { sinfo -h -N -o '%N %t' 2>/dev/null | grep -cE ' (idle|mix|alloc|comp)$' || true; }

usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[[ $CMD == up || $CMD == down || $CMD == status ]] || usage
[[ $(id -u) == 0 ]] || die "must run as root (it creates network namespaces and starts slurm daemons)"
[[ $NODES =~ ^[2-9]$ ]] || die "NODES=$NODES: must be 2..9"

# --------------------------------------------------------------------------------------------------------------- up
up_packages() {
  local missing=() p
  for p in "${PKGS[@]}"; do
    [[ $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null) == "install ok installed" ]] || missing+=("$p")
  done
  if ((${#missing[@]})); then
    # apt-get update only when the package lists are missing or older than a day
    if [[ -z $(find /var/lib/apt/lists -maxdepth 1 -name '*_Packages*' -mtime -1 2>/dev/null | head -1) ]]; then
      log "apt-get update"; apt-get update -q >/dev/null
    fi
    log "apt-get install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  fi
  log "packages: $(dpkg-query -W -f='${Package}=${Version} ' slurmctld slurmd munge)"
}

up_munge() {
  if [[ ! -s /etc/munge/munge.key ]]; then
    log "creating /etc/munge/munge.key"
    mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
      || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
  fi
  install -d -o munge -g munge -m 755 /run/munge
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged
    mkdir -p "$ROOT"; touch "$ROOT/munged.started-here"
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  fi
  munge -n | unmunge >/dev/null || die "munge does not work (see /var/log/munge/munged.log)"
}

hosts_block() {  # $1 = add|remove: our block in /etc/hosts (rewritten in place: /etc/hosts may be a bind mount)
  local tmp i; tmp=$(mktemp)
  awk '/^# BEGIN local-slurm/{skip=1} !skip{print} /^# END local-slurm/{skip=0}' /etc/hosts >"$tmp"
  if [[ $1 == add ]]; then
    { echo "# BEGIN local-slurm"; echo "$SUBNET.1 slurmctl"
      for i in $(seq "$NODES"); do echo "$(node_addr "$i") node$i"; done; echo "# END local-slurm"; } >>"$tmp"
  fi
  cmp -s "$tmp" /etc/hosts || { cat "$tmp" >/etc/hosts; log "/etc/hosts: $1 local-slurm block"; }
  rm -f "$tmp"
}

up_network() {
  if [[ ! -e /run/netns/lslurm1 ]]; then
    ip netns add lslurm-probe 2>/dev/null || die "cannot create network namespaces (needs CAP_NET_ADMIN)"
    ip netns del lslurm-probe
    unshare --uts true 2>/dev/null || die "cannot create UTS namespaces (unshare --uts)"
  fi
  ip link show "$BR" >/dev/null 2>&1 || { ip link add "$BR" type bridge; log "created bridge $BR"; }
  grep -q "inet $SUBNET.1/24" <<<"$(ip addr show dev "$BR")" || ip addr add "$SUBNET.1/24" dev "$BR"
  ip link set "$BR" up
  local i ns
  for i in $(seq "$NODES"); do
    ns=lslurm$i
    [[ -e /run/netns/$ns ]] || { ip netns add "$ns"; log "created netns $ns ($(node_addr "$i"))"; }
    if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
      ip link del "pvh$i" 2>/dev/null || true
      ip link add "pvh$i" type veth peer name "pvn$i"
      ip link set "pvn$i" netns "$ns"
      ip -n "$ns" link set "pvn$i" name eth0
    fi
    ip link set "pvh$i" master "$BR"; ip link set "pvh$i" up
    grep -q "inet $(node_addr "$i")/24" <<<"$(ip -n "$ns" addr show dev eth0)" \
      || ip -n "$ns" addr add "$(node_addr "$i")/24" dev eth0
    ip -n "$ns" link set eth0 up; ip -n "$ns" link set lo up
  done
  # No default route in the namespaces and ip_forward untouched: the nodes reach only each other and the controller.
  hosts_block add
}

write_config() {  # prints 1 when slurm.conf or gres.conf changed
  mkdir -p /etc/slurm "$ROOT/log"
  local new changed=0 i line
  new=$(mktemp)
  {
    cat <<EOF
$MARK
ClusterName=da3polocal
SlurmctldHost=$(hostname -s)($SUBNET.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=10
MailProg=/bin/true
StateSaveLocation=$ROOT/ctld
SlurmdSpoolDir=$ROOT/spool-%n
SlurmctldPidFile=$ROOT/slurmctld.pid
SlurmdPidFile=$ROOT/slurmd-%n.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
EOF
    ((FAKE_GPUS > 0)) && echo "GresTypes=gpu"
    for i in $(seq "$NODES"); do
      line="NodeName=node$i NodeAddr=$(node_addr "$i") CPUs=$NODE_CPUS RealMemory=$NODE_MEM_MB State=UNKNOWN"
      ((FAKE_GPUS > 0)) && line+=" Gres=gpu:$FAKE_GPUS"
      echo "$line"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } >"$new"
  if ! cmp -s "$new" "$CONF"; then
    [[ -f $CONF ]] && ! grep -q "$MARK" "$CONF" && die "$CONF exists and was not written by this script; move it away"
    install -m 644 "$new" "$CONF"; changed=1
  fi
  rm -f "$new"
  if ((FAKE_GPUS > 0)); then
    mkdir -p "$ROOT/fakedev"
    local g gres
    for g in $(seq 0 $((FAKE_GPUS - 1))); do
      [[ -c $ROOT/fakedev/nvidia$g ]] || mknod "$ROOT/fakedev/nvidia$g" c 1 3  # same major/minor as /dev/null
    done
    # gres/gpu needs File= in Slurm 22.05: with only "Name=gpu Count=N" slurmd reports 0 GPUs and slurmctld sets the
    # node INVAL ("gres/gpu count reported lower than configured (0 < 2)"; measured 2026-12-01), hence dummy devices
    gres="$MARK
NodeName=node[1-$NODES] Name=gpu File=$ROOT/fakedev/nvidia[0-$((FAKE_GPUS - 1))]"
    [[ $(cat "$GRESCONF" 2>/dev/null) == "$gres" ]] || { echo "$gres" >"$GRESCONF"; changed=1; }
  elif [[ -f $GRESCONF ]] && grep -q "$MARK" "$GRESCONF"; then
    rm -f "$GRESCONF"; changed=1
  fi
  echo "$changed"
}

stop_pidfile() {  # pidfile program-name: SIGTERM, wait up to 10 s, then SIGKILL
  alive "$1" "$2" || { rm -f "$1"; return 0; }
  local pid; pid=$(cat "$1"); kill "$pid"
  for _ in $(seq 100); do running "$pid" || break; sleep 0.1; done
  running "$pid" && kill -9 "$pid"
  rm -f "$1"; log "stopped $2 (pid $pid)"
}

up_daemons() {
  local changed=$1 all_up=1 i f
  alive "$ROOT/slurmctld.pid" slurmctld || all_up=0
  for i in $(seq "$NODES"); do alive "$ROOT/slurmd-node$i.pid" slurmd || all_up=0; done
  if [[ $changed == 0 && $all_up == 1 ]]; then log "daemons already running"; return; fi
  log "(re)starting slurm daemons (config changed=$changed, all running=$all_up)"
  for f in "$ROOT"/slurmd-*.pid; do [[ -e $f ]] && stop_pidfile "$f" slurmd; done
  stop_pidfile "$ROOT/slurmctld.pid" slurmctld
  rm -rf "$ROOT/ctld" "$ROOT"/spool-*; mkdir -p "$ROOT/ctld"
  slurmctld
  for _ in $(seq 100); do grep -q 'is UP' <<<"$(scontrol ping 2>/dev/null)" && break; sleep 0.2; done
  grep -q 'is UP' <<<"$(scontrol ping 2>&1)" || die "slurmctld did not come up; see $ROOT/log/slurmctld.log"
  for i in $(seq "$NODES"); do
    # nsenter (not `ip netns exec`) keeps the host's /sys, where slurmd 22.05 needs the mounted cgroup fs.
    nsenter --net="/run/netns/lslurm$i" unshare --uts -- sh -c "hostname node$i && exec slurmd -N node$i"
  done
}

up_wait_ready() {
  local bad
  for _ in $(seq 120); do
    [[ $(ready_count) == "$NODES" ]] && break
    bad=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 ~ /^(down|drain|drng|inval|fail)/{print $1}' | paste -sd, -)
    [[ -n $bad ]] && scontrol update nodename="$bad" state=resume 2>/dev/null || true
    sleep 0.5
  done
  [[ $(ready_count) == "$NODES" ]] || { sinfo -N; die "nodes not ready after 60 s; see $ROOT/log/"; }
}

do_up() {
  up_packages
  up_munge
  up_network
  local changed; changed=$(write_config)
  up_daemons "$changed"
  up_wait_ready
  sinfo -N -o '%N %t %c %m %G'
  log "cluster up: controller $(hostname -s) ($SUBNET.1), nodes node1..node$NODES ($(node_addr 1)..), logs $ROOT/log"
}

# ------------------------------------------------------------------------------------------------------------- down
do_down() {
  if alive "$ROOT/slurmctld.pid" slurmctld; then
    local jobs; jobs=$(squeue -h -o %i 2>/dev/null | paste -sd' ' -)
    if [[ -n $jobs ]]; then
      log "cancelling jobs: $jobs"
      # shellcheck disable=SC2086  # word splitting intended: one argument per job id
      scancel $jobs
      for _ in $(seq 60); do [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break; sleep 0.5; done
    fi
  fi
  local f ns l
  for f in "$ROOT"/slurmd-*.pid; do [[ -e $f ]] && stop_pidfile "$f" slurmd; done
  stop_pidfile "$ROOT/slurmctld.pid" slurmctld
  [[ -e $ROOT/munged.started-here ]] && stop_pidfile /run/munge/munged.pid munged
  for ns in $(ip netns list 2>/dev/null | awk '$1 ~ /^lslurm[0-9]+$/{print $1}'); do
    ip netns del "$ns" && log "deleted netns $ns"  # deleting a namespace deletes its veth pair
  done
  for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E '^pvh[0-9]+$' || true); do
    ip link del "$l" 2>/dev/null || true
  done
  if ip link show "$BR" >/dev/null 2>&1; then ip link del "$BR"; log "deleted bridge $BR"; fi
  hosts_block remove
  for f in "$CONF" "$GRESCONF"; do
    if [[ -f $f ]] && grep -q "$MARK" "$f"; then rm -f "$f"; log "removed $f"; fi
  done
  rm -rf "$ROOT"
  log "cluster down (packages kept; apt-get purge slurmctld slurmd slurm-client munge to remove them)"
}

# ----------------------------------------------------------------------------------------------------------- status
do_status() {
  local i ok=1
  if alive "$ROOT/slurmctld.pid" slurmctld; then echo "slurmctld: running (pid $(cat "$ROOT/slurmctld.pid"))"
  else echo "slurmctld: not running"; ok=0; fi
  for i in $(seq "$NODES"); do
    if alive "$ROOT/slurmd-node$i.pid" slurmd; then echo "slurmd node$i: running (pid $(cat "$ROOT/slurmd-node$i.pid"))"
    else echo "slurmd node$i: not running"; ok=0; fi
  done
  if ((ok)); then
    sinfo -N -o '%N %t %c %m %G'
    squeue -o '%.8i %.12j %.8T %.6D %R'
    [[ $(ready_count) == "$NODES" ]] || ok=0
  fi
  if ((ok)); then echo "status: up"; else echo "status: down (run: $0 up)"; return 1; fi
}

case $CMD in
  up) do_up ;;
  down) do_down ;;
  status) do_status ;;
esac
