#!/usr/bin/env bash
# A throw-away single-node SLURM cluster (munged + slurmctld + slurmd on this machine) for testing
# profiles/slurm end to end (tests/test_slurm.py). Root on Debian/Ubuntu; installs slurm-wlm and munge if missing.
#
#   scripts/slurm_single_node.sh start DIR [PARTITION]   # everything (config, state, logs, sockets) under DIR
#   export SLURM_CONF=DIR/slurm.conf                      # then sinfo, sbatch, squeue talk to this cluster
#   scripts/slurm_single_node.sh stop DIR
#
# Container limits worked around (no systemd, no writable cgroups): the daemons are started by hand, not as
# services; processes are tracked through /proc (proctrack/linuxproc) with no task or cgroup plugin; there is
# no slurmdbd, so no accounting (sacct says "accounting storage is disabled": job status comes from squeue).
# The cluster has its own munge key and socket and free ports, so it neither needs nor disturbs /etc/munge or
# another cluster's daemons. One global file: /etc/slurm/slurm.conf, a link to DIR/slurm.conf while it runs,
# because the SLURM executor's job step drops SLURM_* variables, SLURM_CONF included, before its nested `srun`,
# which then finds its configuration only at the default path. A machine with its own slurm.conf there is
# refused rather than redirected to this cluster.
set -euo pipefail
SYSTEM_CONF=/etc/slurm/slurm.conf
HEADER="# Written by scripts/slurm_single_node.sh"

cmd=${1:-}
dir=${2:-}
partition=${3:-test}
[ -n "$cmd" ] && [ -n "$dir" ] || { echo "usage: $0 start|stop DIR [PARTITION]" >&2; exit 2; }

stop_pidfile() {  # TERM, then KILL after 10 s: a daemon that hangs must not outlive the test
  local f=$1 pid
  [ -s "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

stop() {
  [ -d "$dir" ] || return 0
  dir=$(cd "$dir" && pwd)
  if [ -f "$dir/slurm.conf" ] && [ -s "$dir/slurmctld.pid" ]; then
    # Cancel what is still queued or running so that no job step survives its slurmd.
    export SLURM_CONF="$dir/slurm.conf"
    ids=$(timeout 10 squeue -h -o %i 2>/dev/null || true)
    if [ -n "$ids" ]; then
      # shellcheck disable=SC2086
      timeout 10 scancel $ids 2>/dev/null || true
      for _ in $(seq 20); do [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.5; done
    fi
  fi
  stop_pidfile "$dir/slurmd.pid"
  stop_pidfile "$dir/slurmctld.pid"
  stop_pidfile "$dir/munged.pid"
  if [ -s "$dir/socket_dir" ]; then
    case "$(cat "$dir/socket_dir")" in /tmp/idc-munge.*) rm -rf "$(cat "$dir/socket_dir")" ;; esac
    rm -f "$dir/socket_dir"
  fi
  if [ -L "$SYSTEM_CONF" ] && [ "$(readlink "$SYSTEM_CONF")" = "$dir/slurm.conf" ]; then rm -f "$SYSTEM_CONF"; fi
}

check_system_conf() {  # the default path must be free, or a link left by an earlier (killed) run of this script
  if [ -e "$SYSTEM_CONF" ] && ! head -n 1 "$SYSTEM_CONF" | grep -qF "$HEADER"; then
    echo "slurm_single_node: $SYSTEM_CONF belongs to another SLURM installation; not touching it" >&2
    exit 4
  fi
}

install_if_missing() {
  local need=0 b
  for b in munged slurmctld slurmd sinfo sbatch squeue scancel; do command -v "$b" >/dev/null 2>&1 || need=1; done
  [ "$need" = 0 ] && return 0
  # Exit 3 means "this machine cannot run a cluster" (tests/test_slurm.py skips on it), not a broken cluster.
  command -v apt-get >/dev/null 2>&1 || { echo "slurm_single_node: no SLURM binaries and no apt-get" >&2; exit 3; }
  # --no-install-recommends: the recommended extras (mail, docs) are not needed for one node.
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null 2>&1; } \
    || { echo "slurm_single_node: apt-get could not install slurm-wlm and munge" >&2; exit 3; }
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start() {
  [ "$(id -u)" = 0 ] || { echo "slurm_single_node: must run as root (slurmd runs jobs as their user)" >&2; exit 3; }
  install_if_missing
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  mkdir -p -m 700 "$dir/munge" "$dir/ctld" "$dir/d" "$dir/log"
  check_system_conf
  started=0
  # Whatever fails from here on, nothing of this cluster is left running.
  trap '[ "$started" = 1 ] || { echo "slurm_single_node: start failed; logs in $dir/log" >&2; tail -n 20 "$dir"/log/*.log >&2 || true; stop; }' EXIT

  # munged wants every directory above its socket searchable by all (DIR may sit under a private temporary
  # folder): the socket gets a folder of its own under /tmp, recorded for `stop`.
  sock_dir=$(mktemp -d /tmp/idc-munge.XXXXXX)
  chmod 755 "$sock_dir"
  echo "$sock_dir" >"$dir/socket_dir"
  [ -s "$dir/munge/munge.key" ] || { dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none; chmod 400 "$dir/munge/munge.key"; }
  munged --key-file="$dir/munge/munge.key" --socket="$sock_dir/munge.socket" --pid-file="$dir/munged.pid" \
    --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed"

  local host cpus mem_mb ctld_port d_port
  host=$(hostname -s)
  cpus=$(nproc)
  # 90 % of the memory `free` reports: slurmd drains a node whose configured RealMemory exceeds what it finds.
  mem_mb=$(free -m | awk '/^Mem:/ {print int($2 * 0.9)}')
  ctld_port=$(free_port)
  d_port=$(free_port)
  while [ "$d_port" = "$ctld_port" ]; do d_port=$(free_port); done
  cat >"$dir/slurm.conf" <<EOF
$HEADER: one node ($host), one partition ($partition), no accounting.
ClusterName=idctest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$d_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$sock_dir/munge.socket
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/d
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
# Pending jobs are looked at every 2 s, not every 60 s (30 s for backfill): a job that missed the pass at its
# submission would otherwise wait for the next one or for another job's end.
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=$partition Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  mkdir -p "$(dirname "$SYSTEM_CONF")"
  ln -sfn "$dir/slurm.conf" "$SYSTEM_CONF"
  export SLURM_CONF="$dir/slurm.conf"
  slurmctld -f "$SLURM_CONF"
  slurmd -f "$SLURM_CONF"
  local state=""
  for _ in $(seq 120); do
    state=$(sinfo -h -N -n "$host" -o %t 2>/dev/null || true)
    [ "$state" = idle ] && break
    sleep 0.5
  done
  [ "$state" = idle ] || { echo "slurm_single_node: node $host is '${state:-unreachable}', not idle, after 60 s" >&2; false; }
  started=1
  echo "slurm_single_node: $host idle in partition $partition ($cpus CPUs, $mem_mb MB); SLURM_CONF=$SLURM_CONF"
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop DIR [PARTITION]" >&2; exit 2 ;;
esac
