#!/usr/bin/env bash
# A single-node Slurm on localhost for the tests: munged, slurmctld and slurmd run as root
# without systemd or cgroups, every file lives under $SLURM_LOCAL_DIR and every daemon binds
# to 127.0.0.1 (CommunicationParameters=NoCtldInAddrAny,NoInAddrAny).
#
#   tests/slurm/setup_local_slurm.sh start   # idempotent; prints `export SLURM_CONF=...`
#   tests/slurm/setup_local_slurm.sh stop
#
# Clients (sbatch, squeue, scontrol) find this cluster through SLURM_CONF; /etc/slurm is
# left untouched. Needs the Debian packages of tools/install_slurm.sh.
set -euo pipefail

SLURM_LOCAL_DIR=${SLURM_LOCAL_DIR:-/tmp/nemo-dapo-slurm}
SLURMCTLD_PORT=${SLURMCTLD_PORT:-6817}
SLURMD_PORT=${SLURMD_PORT:-6818}
CONF=$SLURM_LOCAL_DIR/slurm.conf
MUNGE_SOCKET=$SLURM_LOCAL_DIR/munge/munge.socket.2

die() { echo "setup_local_slurm: $*" >&2; exit 1; }

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# The node's memory in MiB, a little under what slurmd measures (more would mark it INVAL).
node_memory_mib() { awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo; }

write_slurm_conf() {
    cat >"$CONF" <<EOF
ClusterName=nemodapo
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$SLURMCTLD_PORT
SlurmdPort=$SLURMD_PORT
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
StateSaveLocation=$SLURM_LOCAL_DIR/state
SlurmdSpoolDir=$SLURM_LOCAL_DIR/spool
SlurmctldPidFile=$SLURM_LOCAL_DIR/slurmctld.pid
SlurmdPidFile=$SLURM_LOCAL_DIR/slurmd.pid
SlurmctldLogFile=$SLURM_LOCAL_DIR/log/slurmctld.log
SlurmdLogFile=$SLURM_LOCAL_DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=60
MinJobAge=600
SchedulerParameters=bf_interval=5
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=$(node_memory_mib) State=UNKNOWN
PartitionName=local Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
    pid_alive "$SLURM_LOCAL_DIR/munge/munged.pid" && return
    [ -s "$SLURM_LOCAL_DIR/munge/munge.key" ] || dd if=/dev/urandom of="$SLURM_LOCAL_DIR/munge/munge.key" bs=1024 count=1 status=none
    chmod 0600 "$SLURM_LOCAL_DIR/munge/munge.key"
    munged --force --socket="$MUNGE_SOCKET" --key-file="$SLURM_LOCAL_DIR/munge/munge.key" \
        --pid-file="$SLURM_LOCAL_DIR/munge/munged.pid" --log-file="$SLURM_LOCAL_DIR/log/munged.log" \
        --seed-file="$SLURM_LOCAL_DIR/munge/munged.seed"
}

wait_for_node() {
    local deadline=$((SECONDS + 60))
    until SLURM_CONF=$CONF sinfo --noheader --nodes=localhost --format=%t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; do
        [ $SECONDS -lt $deadline ] || die "node localhost not idle after 60 s; see $SLURM_LOCAL_DIR/log/"
        sleep 1
    done
}

# Jobs of an earlier run on a controller that was still up: cancel them and wait until they are gone.
cancel_leftover_jobs() {
    local deadline=$((SECONDS + 90))
    scancel --partition=local 2>/dev/null || true
    while [ -n "$(squeue --noheader --states=RUNNING,PENDING,COMPLETING,SUSPENDED 2>/dev/null)" ]; do
        [ $SECONDS -lt $deadline ] || die "earlier jobs still in the queue after 90 s; see $SLURM_LOCAL_DIR/log/"
        sleep 1
    done
}

start() {
    local daemon
    for daemon in munged slurmctld slurmd sinfo; do
        command -v "$daemon" >/dev/null || die "$daemon not installed (run tools/install_slurm.sh)"
    done
    mkdir -p "$SLURM_LOCAL_DIR"/{munge,state,spool,log}
    chmod 0755 "$SLURM_LOCAL_DIR" "$SLURM_LOCAL_DIR/munge"
    [ -s "$CONF" ] || write_slurm_conf
    start_munge
    export SLURM_CONF=$CONF
    # A fresh controller starts clean (-c): a run killed before its `stop` leaves saved jobs
    # behind that would come back RUNNING and hold every CPU of the node.
    pid_alive "$SLURM_LOCAL_DIR/slurmctld.pid" || slurmctld -c -f "$CONF"
    pid_alive "$SLURM_LOCAL_DIR/slurmd.pid" || slurmd -f "$CONF" -N localhost
    wait_for_node
    cancel_leftover_jobs
    echo "export SLURM_CONF=$CONF"
}

stop_daemon() {
    local pidfile=$1 pid
    pid_alive "$pidfile" || return 0
    pid=$(cat "$pidfile")
    kill "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
}

stop() {
    stop_daemon "$SLURM_LOCAL_DIR/slurmd.pid"
    stop_daemon "$SLURM_LOCAL_DIR/slurmctld.pid"
    stop_daemon "$SLURM_LOCAL_DIR/munge/munged.pid"
}

case ${1:-start} in
    start) start ;;
    stop) stop ;;
    *) die "usage: $0 start|stop" ;;
esac
