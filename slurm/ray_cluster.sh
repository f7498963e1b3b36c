#!/usr/bin/env bash
# A Ray cluster over the nodes of the current Slurm allocation: the head on the first node,
# one worker on each other node, all inside the job's container when CONTAINER is set.
#
# Sourced by a batch script (see slurm/dapo_32b.sbatch):
#     source slurm/ray_cluster.sh
#     ray_cluster_start                 # waits until every node (and GPU) joined; exports RAY_ADDRESS
#     ray_cluster_run CMD...            # runs CMD on the head node, in the container
#     ray_cluster_stop                  # also runs at exit (EXIT trap set by ray_cluster_start)
# Executed inside an allocation: `slurm/ray_cluster.sh CMD...` does the three steps above and
# exits with CMD's status.
#
# Settings (environment):
#   RAY_PORT=6379            GCS port of the head
#   RAY_GPUS_PER_NODE        GPUs each node gives Ray (default: the job's GPUs per node; 0 = CPU mode)
#   RAY_CPUS_PER_NODE        CPUs each node gives Ray (default: SLURM_CPUS_ON_NODE)
#   RAY_START_TIMEOUT=600    seconds for all nodes (and their GPUs) to join, else exit 1 with the reason
#   RAY_HEAD_IP              address the nodes reach the head at (default: what its node name resolves to)
#   RAY_TEMP_DIR             Ray's session folder (default /tmp/ray_<jobid>: never the one a local Ray uses)
#   CONTAINER                image to run in: pyxis/enroot (docker://..., .sqsh) or an Apptainer .sif
#   CONTAINER_RUNTIME=pyxis  pyxis | apptainer | podman (rootful, the node's network, processes and /dev/shm)
#   CONTAINER_MOUNTS         src:dst[,src:dst...] bound into the container
#   LOG_DIR=logs             Ray logs go to $LOG_DIR/$SLURM_JOB_ID/ (per job, suffixed by restart);
#                            each node's session logs to $LOG_DIR/$SLURM_JOB_ID/nodes/<node>/<restart>/

RAY_PORT=${RAY_PORT:-6379}
RAY_START_TIMEOUT=${RAY_START_TIMEOUT:-600}
CONTAINER=${CONTAINER:-}
CONTAINER_RUNTIME=${CONTAINER_RUNTIME:-pyxis}
CONTAINER_MOUNTS=${CONTAINER_MOUNTS:-}
LOG_DIR=${LOG_DIR:-logs}

# Connects to the cluster once and says whether it is complete: exit 0 when every node and GPU is
# there, 1 (with what is missing) otherwise. Polled by ray_cluster_wait until RAY_START_TIMEOUT.
# The port probe comes first because ray.init retries for minutes while the head is starting.
RAY_CLUSTER_CHECK_PY='
import os, socket, sys
nodes, gpus, cpus = (float(x) for x in sys.argv[1:4])
host, port = os.environ["RAY_ADDRESS"].rsplit(":", 1)
try:
    socket.create_connection((host, int(port)), timeout=5).close()
except OSError as err:
    sys.exit(f"no Ray head answering at {host}:{port} yet ({err})")
import ray
ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
alive = sum(1 for node in ray.nodes() if node["Alive"])
have_gpus, have_cpus = (ray.cluster_resources().get(name, 0) for name in ("GPU", "CPU"))
print(f"nodes {alive}/{nodes:.0f}, GPU {have_gpus:.0f}/{gpus:.0f}, CPU {have_cpus:.0f}/{cpus:.0f}", flush=True)
sys.exit(0 if alive >= nodes and have_gpus >= gpus and have_cpus >= cpus else 1)
'

ray_cluster_die() {
    echo "ray_cluster: $*" >&2
    exit 1
}

# Runs "$@" as one task on each node of NODES, in the container, beside the job's other steps.
# Every container of a node sees the node's Ray session folder (RAY_TEMP_DIR, bound at its own
# path): the readiness check and the trainer reach the head's sockets there, whatever /tmp each
# runtime gives a step. Pyxis also names the container (one per node and job): later steps reuse
# the unpacked image instead of unpacking it again.
ray_cluster_srun() {
    local nodes=$1 count=$2
    shift 2
    local step=(srun --overlap --nodes="$count" --ntasks="$count" --ntasks-per-node=1 --nodelist="$nodes"
        --cpus-per-task="${SLURM_CPUS_ON_NODE:-1}")
    local mounts=${CONTAINER_MOUNTS:+$CONTAINER_MOUNTS,}$RAY_TEMP_DIR:$RAY_TEMP_DIR
    case "${CONTAINER:+$CONTAINER_RUNTIME}" in
        "") "${step[@]}" "$@" ;;
        pyxis) "${step[@]}" --container-image="$CONTAINER" --container-name="nemo-dapo-$SLURM_JOB_ID" \
            --container-mounts="$mounts" --container-workdir="$PWD" "$@" ;;
        apptainer)
            local gpu_flag=()
            [ "$RAY_GPUS_PER_NODE" -gt 0 ] && gpu_flag=(--nv)
            "${step[@]}" apptainer exec "${gpu_flag[@]}" --bind "$mounts" --pwd "$PWD" "$CONTAINER" "$@" ;;
        podman)
            # the node's network, processes and shared memory (Ray's object store), as pyxis gives;
            # the job's environment with the image's PATH (its Python first); labelled with the job
            # (ray_cluster_stop_containers)
            local volumes=() each mount
            IFS=, read -r -a each <<<"$mounts"
            for mount in "${each[@]}"; do volumes+=(--volume "$mount"); done
            "${step[@]}" podman run --rm --label="nemo-dapo.job=$SLURM_JOB_ID" --network=host --pid=host \
                --ipc=host --env-host --env "PATH=$CONTAINER_PATH" "${volumes[@]}" --workdir "$PWD" "$CONTAINER" "$@" ;;
        *) ray_cluster_die "CONTAINER_RUNTIME=$CONTAINER_RUNTIME: use pyxis, apptainer or podman" ;;
    esac
}

# Runs "$@" on the head node (in the container) with RAY_ADDRESS set: the driver of the job.
ray_cluster_run() {
    ray_cluster_srun "$RAY_HEAD_NODE" 1 "$@"
}

ray_cluster_settings() {
    [ -n "${SLURM_JOB_ID:-}" ] || ray_cluster_die "not inside a Slurm allocation (SLURM_JOB_ID unset)"
    mapfile -t RAY_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    RAY_HEAD_NODE=${RAY_NODES[0]}
    RAY_NUM_NODES=${#RAY_NODES[@]}
    local job_gpus=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-0}}
    RAY_GPUS_PER_NODE=${RAY_GPUS_PER_NODE:-${job_gpus##*:}}  # "h100:8" -> 8
    RAY_CPUS_PER_NODE=${RAY_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-1}}
    RAY_HEAD_IP=${RAY_HEAD_IP:-$(getent ahostsv4 "$RAY_HEAD_NODE" | awk 'NR == 1 {print $1}')}
    [ -n "$RAY_HEAD_IP" ] || ray_cluster_die "cannot resolve the head node $RAY_HEAD_NODE; set RAY_HEAD_IP"
    RAY_TEMP_DIR=${RAY_TEMP_DIR:-/tmp/ray_$SLURM_JOB_ID}
    if [ "${CONTAINER:+$CONTAINER_RUNTIME}" = podman ]; then
        CONTAINER_PATH=$(podman image inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "$CONTAINER" \
            | sed -n 's/^PATH=//p')
        [ -n "$CONTAINER_PATH" ] || ray_cluster_die "podman has no image $CONTAINER here (podman image inspect)"
    fi
    RAY_LOG_DIR=$LOG_DIR/$SLURM_JOB_ID
    RAY_RUN_TAG=r${SLURM_RESTART_COUNT:-0}
    mkdir -p "$RAY_LOG_DIR"
    export RAY_ADDRESS=$RAY_HEAD_IP:$RAY_PORT
    # Token authentication with a secret of this run: every step inherits it through srun's
    # environment; nothing else on the network can submit work to the cluster.
    export RAY_AUTH_MODE=token
    RAY_AUTH_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
    export RAY_AUTH_TOKEN
    # Stopping the cluster ends the job: skip Ray's 30 s drain of each node on SIGTERM.
    export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}
}

# What runs on each node: `ray start ...` with SIGUSR1 ignored (inherited by every Ray process:
# with `--signal=USR1@T` (no B:) Slurm signals all processes of all steps, and the signal is meant
# for the trainer, which then needs Ray alive to save its checkpoint). Once the node's Ray has
# stopped, its session logs (node-local, in RAY_TEMP_DIR) are copied to
# $RAY_LOG_DIR/nodes/<node>/<run tag>/, where they outlive the node's /tmp; the copy gets 15 s,
# inside Slurm's KillWait. Arguments: RAY_TEMP_DIR, the nodes folder, the run tag, ray's arguments.
# shellcheck disable=SC2016  # expanded by the node's shell
RAY_NODE_SH='
trap "" USR1
temp=$1 keep=$2/${SLURMD_NODENAME:-$(uname -n)}/$3
shift 3
ray "$@" &
ray_pid=$!
trap "kill -TERM $ray_pid 2>/dev/null" TERM INT
wait "$ray_pid"
status=$?
if [ "$status" -gt 128 ]; then  # a signal cut the wait short: wait for ray itself
    wait "$ray_pid" 2>/dev/null
    again=$?
    [ "$again" -eq 127 ] || status=$again
fi
mkdir -p "$keep" && timeout 15 cp -r "$temp/session_latest/logs/." "$keep/" 2>/dev/null
exit "$status"
'

ray_cluster_srun_ray() {
    local nodes=$1 count=$2
    shift 2
    ray_cluster_srun "$nodes" "$count" bash -c "$RAY_NODE_SH" ray "$RAY_TEMP_DIR" "$RAY_LOG_DIR/nodes" "$RAY_RUN_TAG" "$@"
}

# Runs "$@" once on every node of the job, outside any container.
ray_cluster_on_every_node() {
    local all
    all=$(IFS=,; echo "${RAY_NODES[*]}")
    CONTAINER='' ray_cluster_srun "$all" "$RAY_NUM_NODES" "$@"
}

# The node-local Ray session folder, made on every node before the container steps bind it.
ray_cluster_make_temp_dirs() {
    [ -z "$CONTAINER" ] || ray_cluster_on_every_node mkdir -p "$RAY_TEMP_DIR"
}

ray_cluster_start_head() {
    ray_cluster_srun_ray "$RAY_HEAD_NODE" 1 start --head --block --node-ip-address="$RAY_HEAD_IP" \
        --port="$RAY_PORT" --num-cpus="$RAY_CPUS_PER_NODE" --num-gpus="$RAY_GPUS_PER_NODE" \
        --temp-dir="$RAY_TEMP_DIR" --include-dashboard=false --disable-usage-stats \
        >>"$RAY_LOG_DIR/ray-head.$RAY_RUN_TAG.log" 2>&1 &
    RAY_HEAD_PID=$!
}

ray_cluster_start_workers() {
    RAY_WORKERS_PID=''
    [ "$RAY_NUM_NODES" -gt 1 ] || return 0
    local workers
    workers=$(IFS=,; echo "${RAY_NODES[*]:1}")
    ray_cluster_srun_ray "$workers" $((RAY_NUM_NODES - 1)) start --block --address="$RAY_ADDRESS" \
        --num-cpus="$RAY_CPUS_PER_NODE" --num-gpus="$RAY_GPUS_PER_NODE" --temp-dir="$RAY_TEMP_DIR" \
        --disable-usage-stats >>"$RAY_LOG_DIR/ray-workers.$RAY_RUN_TAG.log" 2>&1 &
    RAY_WORKERS_PID=$!
}

# Polls until every node joined with its GPUs (CPUs in CPU mode); fails fast if a ray step died.
ray_cluster_wait() {
    local deadline=$((SECONDS + RAY_START_TIMEOUT)) state
    local want=("$RAY_NUM_NODES" $((RAY_NUM_NODES * RAY_GPUS_PER_NODE)) $((RAY_NUM_NODES * RAY_CPUS_PER_NODE)))
    while true; do
        kill -0 "$RAY_HEAD_PID" 2>/dev/null \
            || ray_cluster_die "the Ray head exited; see $RAY_LOG_DIR/ray-head.$RAY_RUN_TAG.log"
        [ -z "$RAY_WORKERS_PID" ] || kill -0 "$RAY_WORKERS_PID" 2>/dev/null \
            || ray_cluster_die "a Ray worker exited; see $RAY_LOG_DIR/ray-workers.$RAY_RUN_TAG.log"
        if state=$(ray_cluster_run timeout 120 python3 -c "$RAY_CLUSTER_CHECK_PY" "${want[@]}" \
            2>"$RAY_LOG_DIR/ray-check.log"); then
            echo "ray_cluster: ready at $RAY_ADDRESS: $state"
            return 0
        fi
        [ "$SECONDS" -lt "$deadline" ] || ray_cluster_die "after ${RAY_START_TIMEOUT}s the cluster has" \
            "${state:-no head answering at $RAY_ADDRESS}; wanted nodes ${want[0]}, GPU ${want[1]}, CPU ${want[2]};" \
            "see $RAY_LOG_DIR/ (ray-check.log: the last check's errors)"
        sleep 2
    done
}

ray_cluster_start() {
    ray_cluster_settings
    trap ray_cluster_stop EXIT
    echo "ray_cluster: head $RAY_HEAD_NODE ($RAY_ADDRESS), $RAY_NUM_NODES node(s) x $RAY_GPUS_PER_NODE GPU," \
        "$RAY_CPUS_PER_NODE CPU; logs in $RAY_LOG_DIR"
    ray_cluster_make_temp_dirs
    ray_cluster_start_head
    ray_cluster_start_workers
    ray_cluster_wait
}

ray_cluster_alive() {
    local pid
    for pid in "$@"; do kill -0 "$pid" 2>/dev/null && return 0; done
    return 1
}

# A podman container lives outside its step's processes (conmon detaches from `podman run`), and
# Slurm's signals to a step also reach podman's forwarding of them, which can then fail and leave
# the container running after its step. So the job's containers are stopped first, by label, on
# every node (SIGTERM, then SIGKILL after 15 s), which also ends their steps.
ray_cluster_stop_containers() {
    [ "${CONTAINER:+$CONTAINER_RUNTIME}" = podman ] || return 0
    # shellcheck disable=SC2016  # $1 belongs to the inner shell
    ray_cluster_on_every_node bash -c \
        'podman ps --quiet --filter "label=nemo-dapo.job=$1" | xargs --no-run-if-empty podman stop --time 15' \
        stop "$SLURM_JOB_ID" >/dev/null || true
}

# Ends the ray steps (srun passes SIGTERM to `ray start --block`, which stops its node); idempotent.
ray_cluster_stop() {
    local pids=()
    [ -z "${RAY_WORKERS_PID:-}" ] || pids+=("$RAY_WORKERS_PID")
    [ -z "${RAY_HEAD_PID:-}" ] || pids+=("$RAY_HEAD_PID")
    RAY_WORKERS_PID='' RAY_HEAD_PID=''
    ray_cluster_alive "${pids[@]}" || return 0
    echo "ray_cluster: stopping the Ray cluster"
    ray_cluster_stop_containers  # which can end the steps before the signals below reach them
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 30); do
        ray_cluster_alive "${pids[@]}" || return 0
        sleep 1
    done
    kill -KILL "${pids[@]}" 2>/dev/null || true
    return 0
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    set -euo pipefail
    [ $# -gt 0 ] || ray_cluster_die "usage: $0 COMMAND [ARGS...] (inside a Slurm allocation)"
    ray_cluster_start
    ray_cluster_run "$@"
fi
