#!/usr/bin/env bash
# A multi-node Slurm cluster on this machine, for the tests: every "node" is a network namespace
# with its own address on a private bridge, its own hostname (UTS namespace), its own /tmp and
# /dev/shm (a mount namespace with private tmpfs), and shares everything else (the repository,
# the output folders, $HOME) the way cluster nodes share a parallel filesystem.
#
#   tests/slurm/setup_netns_slurm.sh start         # idempotent; prints `export SLURM_CONF=...`
#   tests/slurm/setup_netns_slurm.sh stop          # kills every process of the namespaces, removes them
#   tests/slurm/setup_netns_slurm.sh kill-node n2  # SIGKILL of every process of one node (a node failure)
#   tests/slurm/setup_netns_slurm.sh start-node n2 # the node boots again: a fresh slurmd
#   tests/slurm/setup_netns_slurm.sh exec NODE CMD...  # CMD on that node (ctl: the login node)
#
# Layout: namespace nd-ctl holds the bridge (10.77.0.1, hostname ctl, slurmctld); nd-n1..nd-nN
# (10.77.0.2, ...) each hold one end of a veth pair whose other end is on the bridge, and run one
# slurmd. A second bridge in nd-ctl, fab0, is the nodes' fast network (a site's InfiniBand): each
# node's `ib0` on 10.78.0.2, ... (FABRIC_IFNAME=ib0 in slurm/site_env.sh puts traffic there). The subnet exists only inside these namespaces: no address or route is added to the
# machine's own namespace, so nothing can reach or leave the machine through it. Clients (sbatch,
# squeue, scontrol) must run in one of the namespaces (`exec ctl sbatch ...`). munged runs in the
# machine's namespace on a socket in the shared state folder. Needs root and the Debian packages
# of tools/install_slurm.sh; `nsenter --net` is used, not `ip netns exec`, which remounts /sys
# and hides the cgroup tree slurmd reads.
#
# Settings (environment): NETNS_SLURM_DIR (state, outside /tmp: default /var/tmp/nemo-dapo-netns),
# NETNS_NODES (2), NETNS_SUBNET (10.77.0), NETNS_FABRIC_SUBNET (10.78.0), NETNS_CPUS (CPUs each node declares: nproc),
# NETNS_SHARED_PATHS (colon-separated folders under /tmp that the nodes see, e.g. a repository
# cloned there; the nodes' /tmp is otherwise empty), NETNS_PARTITIONS (space-separated
# name=node,node...; the first is the default partition; default: one partition `nodes` of all).
set -euo pipefail

STATE=${NETNS_SLURM_DIR:-/var/tmp/nemo-dapo-netns}
NODES=${NETNS_NODES:-2}
SUBNET=${NETNS_SUBNET:-10.77.0}
FABRIC_SUBNET=${NETNS_FABRIC_SUBNET:-10.78.0}
CPUS=${NETNS_CPUS:-$(nproc)}
PREFIX=nd
CONF=$STATE/slurm.conf
MUNGE_SOCKET=$STATE/munge/munge.socket.2
SELF=$(readlink -f "${BASH_SOURCE[0]}")

die() { echo "setup_netns_slurm: $*" >&2; exit 1; }
pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
node_names() { local i; for i in $(seq "$NODES"); do echo "n$i"; done; }
node_ip() { if [ "$1" = ctl ]; then echo "$SUBNET.1"; else echo "$SUBNET.$((1 + ${1#n}))"; fi; }
fabric_ip() { echo "$FABRIC_SUBNET.$((1 + ${1#n}))"; }
netns_path() { echo "/var/run/netns/$PREFIX-$1"; }
in_netns() { local node=$1; shift; nsenter --net="$(netns_path "$node")" "$@"; }
# The node's daemon (slurmctld on ctl, slurmd on a node): its namespaces are the node's.
daemon_pid() { if [ "$1" = ctl ]; then cat "$STATE/run/slurmctld.pid"; else cat "$STATE/run/slurmd.$1.pid"; fi; }
# CMD on NODE as if logged in there: its network, hostname, /tmp and hosts file.
on_node() { local node=$1; shift; nsenter --target="$(daemon_pid "$node")" --net --uts --mount --wd="$PWD" env SLURM_CONF="$CONF" "$@"; }

# The node's memory in MiB, a little under what slurmd measures, shared by all nodes.
node_memory_mib() { awk -v n="$NODES" '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9 / n}' /proc/meminfo; }

make_network() {
    ip netns list | grep -qw "$PREFIX-ctl" && return
    ip netns add "$PREFIX-ctl"
    ip -n "$PREFIX-ctl" link set lo up
    ip -n "$PREFIX-ctl" link add br0 type bridge
    ip -n "$PREFIX-ctl" addr add "$(node_ip ctl)/24" dev br0
    ip -n "$PREFIX-ctl" link set br0 up
    local node
    for node in $(node_names); do
        ip netns add "$PREFIX-$node"
        ip link add "port-$node" netns "$PREFIX-ctl" type veth peer name eth0 netns "$PREFIX-$node"
        ip -n "$PREFIX-ctl" link set "port-$node" master br0 up
        ip -n "$PREFIX-$node" link set lo up
        ip -n "$PREFIX-$node" addr add "$(node_ip "$node")/24" dev eth0
        ip -n "$PREFIX-$node" link set eth0 up
    done
}

# The fast network: a bridge of its own, each node's ib0 on it (added to a cluster made without it).
make_fabric() {
    ip -n "$PREFIX-ctl" link show fab0 >/dev/null 2>&1 && return
    ip -n "$PREFIX-ctl" link add fab0 type bridge
    ip -n "$PREFIX-ctl" link set fab0 up
    local node
    for node in $(node_names); do
        ip link add "fab-$node" netns "$PREFIX-ctl" type veth peer name ib0 netns "$PREFIX-$node"
        ip -n "$PREFIX-ctl" link set "fab-$node" master fab0 up
        ip -n "$PREFIX-$node" addr add "$(fabric_ip "$node")/24" dev ib0
        ip -n "$PREFIX-$node" link set ib0 up
    done
}

write_hosts() {
    local node
    {
        echo "127.0.0.1 localhost"
        echo "::1 localhost ip6-localhost ip6-loopback"
        echo "$(node_ip ctl) ctl"
        for node in $(node_names); do echo "$(node_ip "$node") $node"; done
    } >"$STATE/hosts"
}

write_slurm_conf() {
    cat >"$CONF" <<EOF
ClusterName=nemodaponetns
SlurmctldHost=ctl($(node_ip ctl))
SlurmctldPort=6817
SlurmdPort=6818
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.%n.log
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
KillWait=10
MinJobAge=600
SlurmdTimeout=20
MessageTimeout=10
SchedulerParameters=bf_interval=5
EOF
    local node
    for node in $(node_names); do
        echo "NodeName=$node NodeAddr=$(node_ip "$node") CPUs=$CPUS RealMemory=$(node_memory_mib) State=UNKNOWN"
    done >>"$CONF"
    local partition default=YES
    for partition in ${NETNS_PARTITIONS:-nodes=$(node_names | paste -sd,)}; do
        echo "PartitionName=${partition%%=*} Nodes=${partition#*=} Default=$default MaxTime=INFINITE State=UP"
        default=NO
    done >>"$CONF"
}

start_munge() {
    pid_alive "$STATE/munge/munged.pid" && return
    [ -s "$STATE/munge/munge.key" ] || dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
    chmod 0600 "$STATE/munge/munge.key"
    munged --force --socket="$MUNGE_SOCKET" --key-file="$STATE/munge/munge.key" \
        --pid-file="$STATE/munge/munged.pid" --log-file="$STATE/log/munged.log" --seed-file="$STATE/munge/munged.seed"
}

# Runs inside a fresh UTS + mount namespace (see boot): the node's own hostname, hosts file,
# /tmp and /dev/shm, then the daemon. The machine's /tmp stays reachable at $STATE/hold/NODE long
# enough to bind the shared folders under it back into place.
node_init() {
    local node=$1
    shift
    hostname "$node"
    mount --bind "$STATE/hosts" /etc/hosts
    local hold=$STATE/hold/$node path
    mkdir -p "$hold"
    mount --bind /tmp "$hold"
    mount -t tmpfs -o mode=1777 "tmp-$node" /tmp
    mount -t tmpfs -o mode=1777 "shm-$node" /dev/shm
    local shared
    IFS=: read -r -a shared <<<"${NETNS_SHARED_PATHS:-}"
    for path in "${shared[@]}"; do
        case $path in
            /tmp/?*) mkdir -p "$path" && mount --bind "$hold/${path#/tmp/}" "$path" ;;
        esac
    done
    umount -l "$hold"
    exec "$@"
}

boot() {
    local node=$1
    shift
    in_netns "$node" unshare --uts --mount --propagation private bash "$SELF" node-init "$node" "$@"
}

start_node() {
    local node=$1
    pid_alive "$STATE/run/slurmd.$node.pid" && return
    mkdir -p "$STATE/spool/$node"
    boot "$node" slurmd -f "$CONF" -N "$node"
}

wait_for_nodes() {
    local deadline=$((SECONDS + 90)) node
    for node in "$@"; do
        until on_node ctl sinfo --noheader --nodes="$node" --format=%t 2>/dev/null \
            | grep -qE '^(idle|mix|alloc)'; do
            [ $SECONDS -lt $deadline ] || die "node $node not idle after 90 s; see $STATE/log/"
            sleep 1
        done
    done
}

# The state folder holds the munge key and slurm.conf the daemons trust: made here (root's, mode
# 0700), or reused only when it is that; /var/tmp is writable by every user, who could have made
# it first (or a link in its place) and planted their own key or configuration.
claim_state() {
    if [ ! -e "$STATE" ] && [ ! -L "$STATE" ]; then
        mkdir -p "$(dirname "$STATE")"
        mkdir -m 0700 "$STATE"
    fi
    if [ ! -d "$STATE" ] || [ -L "$STATE" ] || [ "$(stat -c %u:%a "$STATE")" != "0:700" ]; then
        die "$STATE: not a folder of root's with mode 0700 (someone else's could hold a planted munge key or slurm.conf); remove it, or set NETNS_SLURM_DIR to a new path"
    fi
}

start() {
    [ "$(id -u)" -eq 0 ] || die "needs root (network namespaces, mounts, slurmd)"
    local daemon
    for daemon in munged slurmctld slurmd sinfo ip nsenter unshare; do
        command -v "$daemon" >/dev/null || die "$daemon not installed (run tools/install_slurm.sh)"
    done
    claim_state
    pid_alive "$STATE/run/slurmctld.pid" || rm -rf "$STATE/log"
    mkdir -p "$STATE"/{munge,state,spool,log,run,hold}
    chmod 0700 "$STATE/munge"
    make_network
    make_fabric
    write_hosts
    pid_alive "$STATE/run/slurmctld.pid" || write_slurm_conf
    start_munge
    pid_alive "$STATE/run/slurmctld.pid" || boot ctl slurmctld -c -f "$CONF"
    local node
    for node in $(node_names); do start_node "$node"; done
    # shellcheck disable=SC2046  # one argument per node
    wait_for_nodes $(node_names)
    echo "export SLURM_CONF=$CONF"
}

# Until the namespace holds no process: one forked between the listing and the kill survives it.
kill_node() {
    local node=$1 pids deadline=$((SECONDS + 10))
    while pids=$(ip netns pids "$PREFIX-$node" 2>/dev/null) && [ -n "$pids" ]; do
        # shellcheck disable=SC2086  # one argument per pid
        kill -9 $pids 2>/dev/null || true
        [ $SECONDS -lt $deadline ] || { echo "kill-node $node: still running: $pids" >&2; break; }
        sleep 0.2
    done
    rm -f "$STATE/run/slurmd.$node.pid"
}

stop() {
    local netns
    for netns in $(ip netns list | awk -v p="$PREFIX-" 'index($1, p) == 1 {print $1}'); do
        kill_node "${netns#"$PREFIX"-}"
        ip netns del "$netns"
    done
    if pid_alive "$STATE/munge/munged.pid"; then kill "$(cat "$STATE/munge/munged.pid")"; fi
    rm -rf "$STATE/run" "$STATE/state" "$STATE/spool" "$STATE/hold"
}

case ${1:-start} in
    start) start ;;
    stop) stop ;;
    kill-node) kill_node "$2" ;;
    start-node) start_node "$2" && wait_for_nodes "$2" ;;
    node-init) shift; node_init "$@" ;;
    exec) shift; on_node "$@" ;;
    *) die "usage: $0 start|stop|kill-node NODE|start-node NODE|exec NODE CMD..." ;;
esac
