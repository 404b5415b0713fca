#!/usr/bin/env bash
# A two-node Slurm cluster on this one machine, for the tests that submit what
# `dstrain deploy slurm` renders: munged, slurmctld, and two slurmd daemons ("node1" on port
# 6818, "node2" on 6819) from Debian's slurm-wlm packages (apt-get install slurmctld slurmd
# slurm-client munge). Everything lives in a private state dir; nothing under /etc changes
# except one /etc/hosts line that makes node1 and node2 resolve to 127.0.0.1 (the rendered
# script uses the first node's name as the rendezvous address).
#
#   scripts/slurm-localhost.sh up      # idempotent; waits until sinfo shows both nodes up
#   scripts/slurm-localhost.sh down    # stops the daemons it started (by their pid files)
#   scripts/slurm-localhost.sh status  # exit 0 when the four daemons it starts are running
#   scripts/slurm-localhost.sh env     # prints `export SLURM_CONF=...` for the client tools
#
# DSTRAIN_SLURM_DIR (default /tmp/dstrain-slurm) is the state dir; DSTRAIN_SLURM_TIMEOUT (30 s)
# how long `up` waits; DSTRAIN_SLURM_TASK_PLUGIN (task/affinity) binds each task to its CPUs.
# Runs as root: slurmd has to start jobs as any user, and the /etc/hosts line needs it.
set -euo pipefail

STATE="${DSTRAIN_SLURM_DIR:-/tmp/dstrain-slurm}"
TIMEOUT="${DSTRAIN_SLURM_TIMEOUT:-30}"
TASK_PLUGIN="${DSTRAIN_SLURM_TASK_PLUGIN:-task/affinity}"
CONF="$STATE/slurm.conf"
MUNGE_SOCKET="$STATE/munge/munge.socket"
NODES=(node1 node2)
export SLURM_CONF="$CONF"

die() {
  echo "slurm-localhost: $*" >&2
  exit 1
}

alive() { # alive PIDFILE: the process it names is running
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

need_tools() {
  local tool missing=()
  for tool in munged mungekey slurmctld slurmd sinfo sbatch scontrol; do
    command -v "$tool" >/dev/null || missing+=("$tool")
  done
  [ ${#missing[@]} -eq 0 ] || die "missing ${missing[*]}: apt-get install slurmctld slurmd slurm-client munge"
  [ "$(id -u)" -eq 0 ] || die "must run as root (slurmd starts jobs as their user; /etc/hosts)"
}

write_config() {
  # CPUs as this machine has them: slurmd drains a node that claims more than the hardware.
  local cpus host
  cpus="$(nproc)"
  host="$(hostname -s)"
  mkdir -p "$STATE/ctld" "$STATE/munge" && chmod 700 "$STATE" "$STATE/munge"
  cat >"$CONF.new" <<EOF
# Written by scripts/slurm-localhost.sh: two slurmd "nodes" on one host.
ClusterName=dstrain-localhost
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=6817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/slurmd-%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd-%n.log
# No cgroups in a container: track processes by parent pid.
ProctrackType=proctrack/linuxproc
TaskPlugin=$TASK_PLUGIN
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
# Keep finished jobs in scontrol's view for 10 minutes (the tests read their exit codes).
MinJobAge=600
KillWait=5
InactiveLimit=0
SlurmdTimeout=60
NodeName=node1 NodeAddr=127.0.0.1 NodeHostname=$host CPUs=$cpus Port=6818 State=UNKNOWN
NodeName=node2 NodeAddr=127.0.0.1 NodeHostname=$host CPUs=$cpus Port=6819 State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP
EOF
  if ! cmp -s "$CONF.new" "$CONF"; then
    mv "$CONF.new" "$CONF"
    return 0
  fi
  rm -f "$CONF.new"
  return 1
}

hosts_line() {
  local node
  for node in "${NODES[@]}"; do
    getent hosts "$node" >/dev/null && continue
    echo "127.0.0.1 ${NODES[*]}  # scripts/slurm-localhost.sh" >>/etc/hosts
    return
  done
}

start_munge() {
  alive "$STATE/munge/munged.pid" && return
  [ -s "$STATE/munge/munge.key" ] || mungekey --create --keyfile="$STATE/munge/munge.key"
  chmod 600 "$STATE/munge/munge.key"
  munged --force --key-file="$STATE/munge/munge.key" --socket="$MUNGE_SOCKET" \
    --pid-file="$STATE/munge/munged.pid" --log-file="$STATE/munge/munged.log" \
    --seed-file="$STATE/munge/munged.seed" || die "munged did not start: $STATE/munge/munged.log"
}

start_slurm() {
  local node
  alive "$STATE/slurmctld.pid" || slurmctld -f "$CONF" || die "slurmctld did not start: $STATE/slurmctld.log"
  for node in "${NODES[@]}"; do
    mkdir -p "$STATE/slurmd-$node"
    alive "$STATE/slurmd-$node.pid" || slurmd -f "$CONF" -N "$node" ||
      die "slurmd -N $node did not start: $STATE/slurmd-$node.log"
  done
}

wait_up() {
  local deadline=$((SECONDS + TIMEOUT)) states
  while :; do
    states="$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u | tr '\n' ' ')"
    # Ready: both nodes registered (idle, or already running someone's job).
    [[ "$states" =~ ^node1\ (idle|alloc|mix|comp)\ node2\ (idle|alloc|mix|comp)\ $ ]] && return
    if [[ "$states" =~ (down|drain) ]]; then
      scontrol update nodename=node1,node2 state=resume 2>/dev/null || true
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "slurm-localhost: nodes not up after ${TIMEOUT}s: ${states:-sinfo answered nothing}" >&2
      sinfo -R >&2 2>/dev/null || true
      tail -n 5 "$STATE"/slurmctld.log "$STATE"/slurmd-*.log >&2 2>/dev/null || true
      exit 1
    fi
    sleep 0.5
  done
}

up() {
  need_tools
  if write_config; then # a changed config: daemons started from the old one must restart
    down quiet
  fi
  hosts_line
  start_munge
  start_slurm
  wait_up
  echo "slurm-localhost: node1 and node2 up (SLURM_CONF=$CONF)"
}

down() {
  local pidfile pid
  for pidfile in "$STATE"/slurmd-*.pid "$STATE/slurmctld.pid" "$STATE/munge/munged.pid"; do
    alive "$pidfile" || continue
    pid="$(cat "$pidfile")"
    kill "$pid"
    for _ in $(seq 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
  done
  [ "${1:-}" = quiet ] || echo "slurm-localhost: stopped"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status)
    for pidfile in "$STATE/munge/munged.pid" "$STATE/slurmctld.pid" "$STATE"/slurmd-node{1,2}.pid; do
      alive "$pidfile" || exit 1
    done
    ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) die "usage: $0 up|down|status|env" ;;
esac
