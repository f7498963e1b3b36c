#!/usr/bin/env bash
# A Ray cluster over the nodes of the current Slurm allocation: the head on the first node,
# one worker on each other node, all inside the job's container when CONTAINER is set.
#
# Sourced by a batch script (see slurm/dapo_32b.sbatch):
#     source slurm/ray_cluster.sh
#     ray_cluster_start                 # waits until every node (and GPU) joined; exports RAY_ADDRESS
#     ray_cluster_run CMD...            # runs CMD on the head node, in the container
#     ray_cluster_stop                  # ends the Ray steps (the batch scripts call it on exit)
# Executed inside an allocation: `slurm/ray_cluster.sh CMD...` does the three steps above and
# exits with CMD's status.
#
# Start-up, in order (a failing step exits 1 naming what failed):
#   1. every node's preflight, one blocking step outside any container (slurm/ray_node.sh): the
#      job's private folders (RAY_TEMP_DIR, NODE_CACHE_DIR) made or checked, free space, the
#      fabric's interface, GPUs and driver, NODE_CHECK;
#   2. pyxis: the job's named container created on every node in one blocking step, so no later
#      step races another into unpacking the image;
#   3. the head; the workers only once the head's port answers (probed from the batch shell,
#      outside any container), each retrying its `ray start`, the step ended if one gives up
#      (--kill-on-bad-exit);
#   4. one readiness step on the head node (slurm/ray_ready.py with $PYTHON) until every node
#      and GPU joined, naming the nodes that did not.
# A node that fails a step is written to $RAY_FAILED_NODES ("node: reason"); the batch scripts
# exclude those nodes before they requeue the job (slurm/requeue_policy.sh).
#
# A heterogeneous job of two components (slurm/dapo_pools.sbatch) has two pools: the head and
# the training pool on component 0, the rollout pool on component 1 (steps there take
# --het-group=1). Every node's Ray offers its pool as a resource (nemo_dapo_pool_train,
# nemo_dapo_pool_rollout: nemo_dapo/cluster/placement.py). Each rollout node's Ray is a step of
# its own, kept running by the batch shell: a rollout node's Ray that stops is started again
# every RAY_NODE_RESTART_S while the node is in the job, and a lost rollout node costs its engines,
# not the job (--no-kill; rollout.min_engines); a lost training node ends the training step.
#
# Settings (environment):
#   RAY_PORT=6379            GCS port of the head
#   RAY_GPUS_PER_NODE        GPUs each node gives Ray (default: the job's GPUs per node; 0 = CPU mode)
#   RAY_CPUS_PER_NODE        CPUs each node gives Ray (default: SLURM_CPUS_ON_NODE)
#   RAY_ROLLOUT_GPUS_PER_NODE, RAY_ROLLOUT_CPUS_PER_NODE   the same for the rollout pool (default:
#                            component 1's --gpus-per-node and CPUs, else RAY_GPUS_PER_NODE)
#   RAY_NODE_RESTART_S=30    seconds between tries to start a stopped rollout node's Ray again
#   RAY_START_TIMEOUT=600    seconds for the head to answer, and then for all nodes (and GPUs) to join
#   RAY_START_RETRIES=3      tries of a worker's `ray start` before its node is given up; a try that
#   RAY_START_FAIL_S=60      fails by itself within this many seconds is a start failure (retried)
#   RAY_HEAD_IP              address the nodes reach the head at (default: what its node name resolves to)
#   RAY_TEMP_DIR             the job's folder on each node (default /tmp/ray_<jobid>: never the one a local
#                            Ray uses), this user's alone (mode 0700, checked); Ray's session folder is
#                            its ray/ (Ray makes that writable by everyone: only the folder around it is
#                            private)
#   PYTHON=python3           the interpreter in the container (the readiness check)
#   CONTAINER                image to run in: pyxis/enroot (docker://..., .sqsh) or an Apptainer .sif
#   CONTAINER_RUNTIME=pyxis  pyxis | apptainer | podman (rootful, the node's network, processes and /dev/shm)
#   CONTAINER_MOUNTS         src:dst[,src:dst...] bound into the container
#   LOG_DIR=logs             Ray logs go to $LOG_DIR/$SLURM_JOB_ID/ (per job, suffixed by restart);
#                            each node's session logs to $LOG_DIR/$SLURM_JOB_ID/nodes/<node>/<restart>/
#   NODE_MIN_FREE_GIB=20     free space each node must have under RAY_TEMP_DIR (Ray's objects spill there)
#   MIN_DRIVER=580           the NVIDIA driver the image's CUDA 13 needs, checked on GPU nodes
#   NODE_CHECK               a site's own health check, a shell command run on every node in the preflight
#   RAY_HEAD_START_DELAY_S   (tests) seconds the head waits before starting: the workers must wait for it

RAY_PORT=${RAY_PORT:-6379}
RAY_START_TIMEOUT=${RAY_START_TIMEOUT:-600}
CONTAINER=${CONTAINER:-}
CONTAINER_RUNTIME=${CONTAINER_RUNTIME:-pyxis}
CONTAINER_MOUNTS=${CONTAINER_MOUNTS:-}
LOG_DIR=${LOG_DIR:-logs}
PYTHON=${PYTHON:-python3}
RAY_TRAIN_NODES=() RAY_ROLLOUT_NODES=() RAY_ROLLOUT_PIDS=()
RAY_CLUSTER_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

ray_cluster_die() {
    echo "ray_cluster: $*" >&2
    exit 1
}

# RAY_STEP: the srun command (and container prefix) that runs a command as one task on each
# node of NODES, beside the job's other steps; the caller appends the command, so that a step
# run in the background is `srun` itself ($! signals it). Every container of a node sees the
# node's Ray session folder (RAY_TEMP_DIR, bound at its own path): the readiness check and the
# trainer reach the head's sockets there, whatever /tmp each runtime gives a step. Pyxis also
# names the container (one per node and job), made once by ray_cluster_make_containers.
ray_cluster_step() {
    local nodes=$1 count=$2 mounts=${CONTAINER_MOUNTS:+$CONTAINER_MOUNTS,}$RAY_TEMP_DIR:$RAY_TEMP_DIR
    local cpus=${SLURM_CPUS_ON_NODE:-1} first=${1%%,*}
    RAY_STEP=(srun --overlap --nodes="$count" --ntasks="$count" --ntasks-per-node=1 --nodelist="$nodes")
    if [ ${#RAY_ROLLOUT_NODES[@]} -gt 0 ]; then  # a heterogeneous job: the component of the nodes
        if ray_cluster_is_rollout_node "$first"; then
            cpus=$RAY_ROLLOUT_CPUS_PER_NODE
            RAY_STEP+=(--het-group=1 --export="ALL,RAY_GPUS_PER_NODE=$RAY_ROLLOUT_GPUS_PER_NODE")
        else
            RAY_STEP+=(--het-group=0)
        fi
    fi
    RAY_STEP+=(--cpus-per-task="$cpus" "${@:3}")
    case "${CONTAINER:+$CONTAINER_RUNTIME}" in
        "") ;;
        pyxis) RAY_STEP+=(--container-image="$CONTAINER" --container-name="nemo-dapo-$SLURM_JOB_ID"
            --container-mounts="$mounts" --container-workdir="$PWD") ;;
        apptainer)
            RAY_STEP+=(apptainer exec)
            [ "$RAY_GPUS_PER_NODE" -eq 0 ] || RAY_STEP+=(--nv)
            RAY_STEP+=(--bind "$mounts" --pwd "$PWD" "$CONTAINER") ;;
        podman)
            # the node's network, processes and shared memory (Ray's object store), as pyxis gives;
            # the job's environment with the image's PATH (its Python first); labelled with the job
            # (ray_cluster_stop_containers)
            RAY_STEP+=(podman run --rm --label="nemo-dapo.job=$SLURM_JOB_ID" --network=host --pid=host --ipc=host
                --env-host --env "PATH=$CONTAINER_PATH")
            local each mount
            IFS=, read -r -a each <<<"$mounts"
            for mount in "${each[@]}"; do RAY_STEP+=(--volume "$mount"); done
            RAY_STEP+=(--workdir "$PWD" "$CONTAINER") ;;
        *) ray_cluster_die "CONTAINER_RUNTIME=$CONTAINER_RUNTIME: use pyxis, apptainer or podman" ;;
    esac
}

# Runs "$@" on the head node (in the container) with RAY_ADDRESS set: the driver of the job.
ray_cluster_run() {
    ray_cluster_step "$RAY_HEAD_NODE" 1
    "${RAY_STEP[@]}" "$@"
}

# Whether NODE belongs to the rollout pool (component 1 of a heterogeneous job).
ray_cluster_is_rollout_node() {
    local node
    for node in "${RAY_ROLLOUT_NODES[@]}"; do [ "$node" != "$1" ] || return 0; done
    return 1
}

# Runs "$@" once on every node of the job, outside any container: one step per pool, side by side.
ray_cluster_on_every_node() {
    CONTAINER='' ray_cluster_on_each_pool "$@"
}

# Runs "$@" as one step on the training pool's nodes and, in a heterogeneous job, one on the
# rollout pool's beside it; fails if either failed. A signal the batch shell traps meanwhile (USR1)
# runs its trap without cutting the steps short.
ray_cluster_on_each_pool() {
    ray_cluster_step "$(IFS=,; echo "${RAY_TRAIN_NODES[*]}")" ${#RAY_TRAIN_NODES[@]}
    if [ ${#RAY_ROLLOUT_NODES[@]} -eq 0 ]; then
        "${RAY_STEP[@]}" "$@"
        return
    fi
    "${RAY_STEP[@]}" "$@" &
    local pids=($!) pid status=0 each
    ray_cluster_step "$(IFS=,; echo "${RAY_ROLLOUT_NODES[*]}")" ${#RAY_ROLLOUT_NODES[@]}
    "${RAY_STEP[@]}" "$@" &
    pids+=($!)
    for pid in "${pids[@]}"; do
        until wait "$pid"; each=$?; ! kill -0 "$pid" 2>/dev/null; do :; done
        [ "$each" -eq 0 ] || status=$each
    done
    return "$status"
}

ray_cluster_settings() {
    [ -n "${SLURM_JOB_ID:-}" ] || ray_cluster_die "not inside a Slurm allocation (SLURM_JOB_ID unset)"
    RAY_ROLLOUT_NODES=()
    mapfile -t RAY_TRAIN_NODES < <(scontrol show hostnames "${SLURM_JOB_NODELIST_HET_GROUP_0:-$SLURM_JOB_NODELIST}")
    [ "${SLURM_HET_SIZE:-1}" -lt 2 ] \
        || mapfile -t RAY_ROLLOUT_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_1")
    RAY_NODES=("${RAY_TRAIN_NODES[@]}" "${RAY_ROLLOUT_NODES[@]}")
    RAY_HEAD_NODE=${RAY_NODES[0]}
    RAY_NUM_NODES=${#RAY_NODES[@]}
    local job_gpus=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-0}} rollout_gpus=${SLURM_GPUS_PER_NODE_HET_GROUP_1:-}
    RAY_GPUS_PER_NODE=${RAY_GPUS_PER_NODE:-${job_gpus##*:}}  # "h100:8" -> 8
    RAY_CPUS_PER_NODE=${RAY_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-1}}
    rollout_gpus=${rollout_gpus##*:}
    RAY_ROLLOUT_GPUS_PER_NODE=${RAY_ROLLOUT_GPUS_PER_NODE:-${rollout_gpus:-$RAY_GPUS_PER_NODE}}
    local rollout_cpus=${SLURM_JOB_CPUS_PER_NODE_HET_GROUP_1:-$RAY_CPUS_PER_NODE}
    RAY_ROLLOUT_CPUS_PER_NODE=${RAY_ROLLOUT_CPUS_PER_NODE:-${rollout_cpus%%(*}}  # "64(x4)" -> 64
    RAY_NODE_RESTART_S=${RAY_NODE_RESTART_S:-30}
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
    RAY_FAILED_NODES=$RAY_LOG_DIR/failed_nodes.$RAY_RUN_TAG
    mkdir -p "$RAY_LOG_DIR"
    rm -f "$RAY_FAILED_NODES"
    # what slurm/ray_node.sh reads on each node
    export RAY_TEMP_DIR RAY_LOG_DIR RAY_RUN_TAG RAY_FAILED_NODES RAY_GPUS_PER_NODE
    export RAY_ADDRESS=$RAY_HEAD_IP:$RAY_PORT
    # Token authentication with a secret of this run: every step inherits it through srun's
    # environment; nothing else on the network can submit work to the cluster.
    export RAY_AUTH_MODE=token
    RAY_AUTH_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
    export RAY_AUTH_TOKEN
    # Stopping the cluster ends the job: skip Ray's 30 s drain of each node on SIGTERM.
    export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}
}

# The nodes named in RAY_FAILED_NODES, comma-separated (empty: none).
ray_cluster_failed_nodes() {
    [ -s "$RAY_FAILED_NODES" ] || return 0
    cut -d: -f1 "$RAY_FAILED_NODES" | sort -u | paste -sd, -
}

ray_cluster_die_naming_nodes() {
    ray_cluster_die "$* on node(s) $(ray_cluster_failed_nodes): $(paste -sd';' "$RAY_FAILED_NODES")"
}

# Names in RAY_FAILED_NODES the nodes that did not say they passed KIND (slurm/ray_node.sh), with
# WHY, unless they named their failure themselves; dies naming them all if any failed.
ray_cluster_check_passed() {
    local kind=$1 why=$2 node
    for node in "${RAY_NODES[@]}"; do
        [ -e "$RAY_LOG_DIR/$kind/$node.$RAY_RUN_TAG" ] || grep -q "^$node:" "$RAY_FAILED_NODES" 2>/dev/null \
            || echo "$node: $why" >>"$RAY_FAILED_NODES"
    done
    [ ! -s "$RAY_FAILED_NODES" ] || ray_cluster_die_naming_nodes "the $kind step failed"
}

ray_cluster_preflight() {
    ray_cluster_on_every_node bash "$RAY_CLUSTER_DIR/ray_node.sh" preflight || true
    ray_cluster_check_passed preflight "its preflight did not run to its end (see the job output)"
}

# Pyxis unpacks the image into the node's named container at the first step that names it; made
# here for every node at once, before any other step could race it there. A node whose marker
# is missing could not start the image.
ray_cluster_make_containers() {
    [ "${CONTAINER:+$CONTAINER_RUNTIME}" = pyxis ] || return 0
    ray_cluster_on_each_pool bash "$RAY_CLUSTER_DIR/ray_node.sh" container || true
    ray_cluster_check_passed containers "the container of $CONTAINER did not start (pyxis/enroot)"
}

# `ray_node.sh ray RAY_ARGS...` as the step of NODES in the background, with more srun options after
# LOG; its output appended to LOG, RAY_STEP_PID srun's pid.
ray_cluster_start_ray() {
    local nodes=$1 count=$2 log=$3
    ray_cluster_step "$nodes" "$count" "${@:4}"
    "${RAY_STEP[@]}" bash "$RAY_CLUSTER_DIR/ray_node.sh" ray "${RAY_ARGS[@]}" >>"$log" 2>&1 &
    RAY_STEP_PID=$!
}

# Adds to RAY_ARGS the `ray start` option naming the pool of NODE's Ray (a heterogeneous job only).
ray_cluster_add_pool() {
    [ ${#RAY_ROLLOUT_NODES[@]} -gt 0 ] || return 0
    local pool=train
    ! ray_cluster_is_rollout_node "$1" || pool=rollout
    RAY_ARGS+=("--resources={\"nemo_dapo_pool_$pool\": 1}")
}

ray_cluster_start_head() {
    RAY_ARGS=(head --head --block --node-ip-address="$RAY_HEAD_IP" --port="$RAY_PORT"
        --num-cpus="$RAY_CPUS_PER_NODE" --num-gpus="$RAY_GPUS_PER_NODE" --temp-dir="$RAY_TEMP_DIR/ray"
        --include-dashboard=false --disable-usage-stats)
    ray_cluster_add_pool "$RAY_HEAD_NODE"
    ray_cluster_start_ray "$RAY_HEAD_NODE" 1 "$RAY_LOG_DIR/ray-head.$RAY_RUN_TAG.log"
    RAY_HEAD_PID=$RAY_STEP_PID
}

# Until the head's GCS port accepts a connection, from the batch shell (outside any container).
ray_cluster_wait_for_head() {
    local deadline=$((SECONDS + RAY_START_TIMEOUT))
    # shellcheck disable=SC2016  # $1 and $2 belong to the probe's shell
    until timeout 5 bash -c 'exec 3<>"/dev/tcp/$1/$2"' probe "$RAY_HEAD_IP" "$RAY_PORT" 2>/dev/null; do
        kill -0 "$RAY_HEAD_PID" 2>/dev/null \
            || ray_cluster_die "the Ray head exited before it answered; see $RAY_LOG_DIR/ray-head.$RAY_RUN_TAG.log"
        [ "$SECONDS" -lt "$deadline" ] \
            || ray_cluster_die "after ${RAY_START_TIMEOUT}s no Ray head answers at $RAY_ADDRESS; see $RAY_LOG_DIR/"
        sleep 0.5
    done
    RAY_HEAD_ANSWERED=$SECONDS
}

# The training pool's other nodes as one step (one node lost ends it: --kill-on-bad-exit), each
# rollout node as a step of its own, kept running (ray_cluster_keep_rollout_node).
ray_cluster_start_workers() {
    RAY_WORKERS_PID='' RAY_ROLLOUT_PIDS=()
    local node
    for node in "${RAY_ROLLOUT_NODES[@]}"; do
        ray_cluster_keep_rollout_node "$node" &
        RAY_ROLLOUT_PIDS+=($!)
    done
    [ ${#RAY_TRAIN_NODES[@]} -gt 1 ] || return 0
    local workers
    workers=$(IFS=,; echo "${RAY_TRAIN_NODES[*]:1}")
    RAY_ARGS=(worker --block --address="$RAY_ADDRESS" --num-cpus="$RAY_CPUS_PER_NODE"
        --num-gpus="$RAY_GPUS_PER_NODE" --temp-dir="$RAY_TEMP_DIR/ray" --disable-usage-stats)
    ray_cluster_add_pool "${RAY_TRAIN_NODES[1]}"
    ray_cluster_start_ray "$workers" $((${#RAY_TRAIN_NODES[@]} - 1)) "$RAY_LOG_DIR/ray-workers.$RAY_RUN_TAG.log" \
        --kill-on-bad-exit=1
    RAY_WORKERS_PID=$RAY_STEP_PID
}

# Runs in the background for the job's life: rollout NODE's Ray as a step, started again
# RAY_NODE_RESTART_S after it stopped, for as long as the node is in the job (Slurm removes a
# failed node from a --no-kill job). SIGTERM ends the step and the loop (ray_cluster_stop).
ray_cluster_keep_rollout_node() {
    local node=$1 log=$RAY_LOG_DIR/ray-rollout-$1.$RAY_RUN_TAG.log step='' status
    # shellcheck disable=SC2064  # the step's pid when the signal comes
    trap 'kill -TERM $step 2>/dev/null; wait $step 2>/dev/null; exit 0' TERM
    RAY_ARGS=(worker --block --address="$RAY_ADDRESS" --num-cpus="$RAY_ROLLOUT_CPUS_PER_NODE"
        --num-gpus="$RAY_ROLLOUT_GPUS_PER_NODE" --temp-dir="$RAY_TEMP_DIR/ray" --disable-usage-stats)
    ray_cluster_add_pool "$node"
    while :; do
        ray_cluster_start_ray "$node" 1 "$log"
        step=$RAY_STEP_PID
        status=0
        wait "$step" || status=$?  # (the batch scripts run under set -e)
        echo "ray_cluster: the Ray of rollout node $node stopped (exit $status); its engines are out of the run"
        ray_cluster_node_in_job "$node" || break
        sleep "$RAY_NODE_RESTART_S"
        ray_cluster_node_in_job "$node" || break
        echo "ray_cluster: starting the Ray of rollout node $node again"
    done
    echo "ray_cluster: rollout node $node left the job: the run goes on without it"
}

# Whether NODE is still allocated to the job's rollout component.
ray_cluster_node_in_job() {
    local nodes
    nodes=$(scontrol show job "${SLURM_JOB_ID_HET_GROUP_1:-$SLURM_JOB_ID}" 2>/dev/null | sed -n 's/^ *NodeList=//p')
    [ -n "$nodes" ] && scontrol show hostnames "$nodes" | grep -qx "$1"
}

# One readiness step on the head node until every node and GPU joined (CPUs in CPU mode), while
# the batch shell watches the Ray steps: a step that died ends the wait at once.
ray_cluster_wait() {
    local train=${#RAY_TRAIN_NODES[@]} rollout=${#RAY_ROLLOUT_NODES[@]}
    local want=("$RAY_NUM_NODES" $((train * RAY_GPUS_PER_NODE + rollout * RAY_ROLLOUT_GPUS_PER_NODE))
        $((train * RAY_CPUS_PER_NODE + rollout * RAY_ROLLOUT_CPUS_PER_NODE)))
    local addresses=() node check_log=$RAY_LOG_DIR/ray-check.$RAY_RUN_TAG.log
    for node in "${RAY_NODES[@]}"; do
        addresses+=("$node=$(getent ahostsv4 "$node" | awk 'NR == 1 {print $1}')")
    done
    ray_cluster_run "$PYTHON" "$RAY_CLUSTER_DIR/ray_ready.py" $((RAY_START_TIMEOUT - SECONDS + RAY_HEAD_ANSWERED)) \
        "${want[@]}" "${addresses[@]}" >"$check_log" 2>&1 &
    local check=$!
    while kill -0 "$check" 2>/dev/null; do
        kill -0 "$RAY_HEAD_PID" 2>/dev/null \
            || ray_cluster_die "the Ray head exited; see $RAY_LOG_DIR/ray-head.$RAY_RUN_TAG.log"
        if [ -n "$RAY_WORKERS_PID" ] && ! kill -0 "$RAY_WORKERS_PID" 2>/dev/null; then
            [ -s "$RAY_FAILED_NODES" ] || ray_cluster_die "a Ray worker exited; see $RAY_LOG_DIR/ray-workers.$RAY_RUN_TAG.log"
            ray_cluster_die_naming_nodes "Ray did not start"
        fi
        sleep 0.5
    done
    if wait "$check"; then
        echo "ray_cluster: ready at $RAY_ADDRESS: $(tail -n1 "$check_log")"
        return 0
    fi
    sed -n 's/^missing \([^ ]*\) .*/\1: did not join the Ray cluster/p' "$check_log" >>"$RAY_FAILED_NODES"
    ray_cluster_die "the cluster is not complete after ${RAY_START_TIMEOUT}s: $(grep -v '^missing' "$check_log" \
        | tail -n1); missing: $(ray_cluster_failed_nodes); see $check_log"
}

ray_cluster_start() {
    ray_cluster_settings
    echo "ray_cluster: head $RAY_HEAD_NODE ($RAY_ADDRESS), $RAY_NUM_NODES node(s) x $RAY_GPUS_PER_NODE GPU," \
        "$RAY_CPUS_PER_NODE CPU; logs in $RAY_LOG_DIR"
    if [ ${#RAY_ROLLOUT_NODES[@]} -gt 0 ]; then
        echo "ray_cluster: two pools: training ${RAY_TRAIN_NODES[*]}, rollout ${RAY_ROLLOUT_NODES[*]}" \
            "(${RAY_ROLLOUT_GPUS_PER_NODE} GPU, ${RAY_ROLLOUT_CPUS_PER_NODE} CPU each)"
        [ ${#RAY_TRAIN_NODES[@]} -gt 1 ] || echo "ray_cluster: warning: a training component of one node: Slurm" \
            "requeues the whole job when a rollout node fails (it counts the job's first component on every" \
            "component's nodes and keeps a --no-kill component only above one node); give it two or more" >&2
    fi
    ray_cluster_preflight
    ray_cluster_make_containers
    ray_cluster_start_head
    ray_cluster_wait_for_head
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

# Ends the Ray steps (SIGTERM to their srun, which passes it to `ray start --block`); idempotent.
ray_cluster_stop() {
    local pids=("${RAY_ROLLOUT_PIDS[@]}")
    [ -z "${RAY_WORKERS_PID:-}" ] || pids+=("$RAY_WORKERS_PID")
    [ -z "${RAY_HEAD_PID:-}" ] || pids+=("$RAY_HEAD_PID")
    RAY_WORKERS_PID='' RAY_HEAD_PID='' RAY_ROLLOUT_PIDS=()
    ray_cluster_alive "${pids[@]}" || return 0
    echo "ray_cluster: stopping the Ray cluster"
    ray_cluster_stop_containers  # which can end the steps before the signals below reach them
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 150); do  # 30 s
        ray_cluster_alive "${pids[@]}" || return 0
        sleep 0.2
    done
    kill -KILL "${pids[@]}" 2>/dev/null || true
    return 0
}

# The job's named pyxis containers (~the image's size on each node's disk), removed when the job
# ends for good; a requeued job keeps them for its next run.
ray_cluster_remove_containers() {
    [ "${CONTAINER:+$CONTAINER_RUNTIME}" = pyxis ] || return 0
    # shellcheck disable=SC2016  # $1 belongs to the inner shell
    ray_cluster_on_every_node bash -c \
        'enroot list | grep -F -- "nemo-dapo-$1" | xargs --no-run-if-empty enroot remove --force' \
        remove "$SLURM_JOB_ID" >/dev/null 2>&1 || echo "ray_cluster: could not remove the named containers" >&2
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    set -euo pipefail
    [ $# -gt 0 ] || ray_cluster_die "usage: $0 COMMAND [ARGS...] (inside a Slurm allocation)"
    trap 'ray_cluster_stop; ray_cluster_remove_containers' EXIT
    ray_cluster_start
    ray_cluster_run "$@"
fi
