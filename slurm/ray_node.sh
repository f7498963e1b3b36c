#!/usr/bin/env bash
# What slurm/ray_cluster.sh runs on each node of the job, one task per node:
#
#   ray_node.sh preflight           outside any container: the node can host the job (below)
#   ray_node.sh container           inside the job's container: the image started here
#   ray_node.sh ray head|worker ARGS...   inside it: `ray start ARGS`, until the job stops it
#
# A node that fails is named in $RAY_FAILED_NODES ("node: reason", one line each, on storage the
# batch shell sees): the batch scripts exclude those nodes before the job requeues
# (slurm/requeue_policy.sh). Settings come from the job's environment (slurm/ray_cluster.sh):
# RAY_TEMP_DIR, RAY_LOG_DIR, RAY_RUN_TAG, RAY_FAILED_NODES, RAY_GPUS_PER_NODE, RAY_ADDRESS,
# RAY_START_RETRIES, RAY_START_FAIL_S, NODE_MIN_FREE_GIB, MIN_DRIVER, FABRIC_IFNAME, NODE_CHECK,
# RAY_HEAD_START_DELAY_S, NODE_CACHE_DIR (slurm/site_env.sh).
set -uo pipefail

NODE=${SLURMD_NODENAME:-$(uname -n)}

failed() {
    echo "$NODE: $*" >>"$RAY_FAILED_NODES"
    echo "ray_node: $NODE: $*" >&2
    exit 1
}

# A node-local folder of this user's alone: made here with mode 0700, or reused only when it is
# this user's, no link, and writable by no one else (then closed to 0700). /tmp is everyone's:
# a folder someone else made first, or one others could write, may hold planted files that the
# job then runs or trusts (TorchInductor's cache holds pickles; Ray's session folder, which Ray
# makes writable by everyone, its sockets and runtime environments). $2: the setting naming it.
private_folder() {
    local folder=$1 setting=$2
    if [ ! -e "$folder" ] && [ ! -L "$folder" ]; then
        mkdir -p "$(dirname "$folder")" 2>/dev/null
        mkdir -m 0700 "$folder" 2>/dev/null || [ -e "$folder" ] || failed "cannot make $folder ($setting)"
    fi
    if [ ! -d "$folder" ] || [ -L "$folder" ] || [ "$(stat -c %u "$folder")" != "$(id -u)" ] \
        || [ $((8#$(stat -c %a "$folder") & 8#022)) -ne 0 ]; then
        failed "$folder: not a folder of $(id -un)'s that only $(id -un) can write (someone else's, a link, or" \
            "one others could write may hold planted files); remove it, or set $setting to a new path"
    fi
    chmod 0700 "$folder" || failed "cannot make $folder private (chmod 0700)"
}

# The node's own health, before anything of the job starts there: a sick node is named and
# excluded instead of being handed the requeued job again.
preflight() {
    private_folder "$RAY_TEMP_DIR" RAY_TEMP_DIR
    [ -z "${NODE_CACHE_DIR:-}" ] || private_folder "$NODE_CACHE_DIR" NODE_CACHE_DIR
    local free_kib need_kib=$((${NODE_MIN_FREE_GIB:-20} * 1024 * 1024))
    free_kib=$(df -Pk "$RAY_TEMP_DIR" | awk 'NR == 2 {print $4}')
    [ "${free_kib:-0}" -ge "$need_kib" ] \
        || failed "$((${free_kib:-0} / 1024 / 1024)) GiB free under $RAY_TEMP_DIR, fewer than NODE_MIN_FREE_GIB=${NODE_MIN_FREE_GIB:-20}"
    if [ -n "${FABRIC_IFNAME:-}" ]; then  # netlink (`ip`): /sys may show another network namespace's
        local link
        link=$(ip -o link show "$FABRIC_IFNAME" 2>/dev/null) || failed "no interface FABRIC_IFNAME=$FABRIC_IFNAME"
        [[ $link != *"state DOWN"* ]] || failed "the fabric's interface $FABRIC_IFNAME is down"
    fi
    [ "${RAY_GPUS_PER_NODE:-0}" -eq 0 ] || gpu_preflight
    if [ -n "${NODE_CHECK:-}" ]; then
        bash -c "$NODE_CHECK" >&2 || failed "the site's health check NODE_CHECK failed (exit $?)"
    fi
}

# Every GPU the job asked for is there, on a driver the image's CUDA runs on.
gpu_preflight() {
    local listed driver
    listed=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null) \
        || failed "nvidia-smi fails: the GPUs or their driver are lost"
    [ "$(grep -c . <<<"$listed")" -ge "$RAY_GPUS_PER_NODE" ] \
        || failed "nvidia-smi lists $(grep -c . <<<"$listed") GPUs, the job needs $RAY_GPUS_PER_NODE"
    driver=$(head -n1 <<<"$listed")
    [ "${driver%%.*}" -ge "${MIN_DRIVER:-580}" ] || failed "NVIDIA driver $driver: the image's CUDA 13 needs" \
        "R${MIN_DRIVER:-580} or newer; update the driver, or see containers/README.md, \"Nodes on an older driver\""
}

# `ray start ARGS --block` with SIGUSR1 ignored (inherited by every Ray process: with
# `--signal=USR1@T` Slurm signals all processes of all steps, and the signal is meant for the
# trainer, which then needs Ray alive to save its checkpoint). A worker whose `ray start` fails
# by itself within RAY_START_FAIL_S of trying (not stopped by a signal: the job's end, a requeue)
# tries again, RAY_START_RETRIES times in all, then names its node. Once Ray stopped, its
# node-local session logs are copied to $RAY_LOG_DIR/nodes/<node>/<run tag>/.
run_ray() {
    local role=$1 status=0 try began start_failed=0 stopping=0
    shift
    trap "" USR1
    [ "$role" != head ] || sleep "${RAY_HEAD_START_DELAY_S:-0}"  # a test hook: the workers must wait for the head
    for try in $(seq "${RAY_START_RETRIES:-3}"); do
        began=$SECONDS
        ray start "$@" &
        local ray_pid=$!
        # shellcheck disable=SC2064  # this try's pid
        trap "stopping=1; kill -TERM $ray_pid 2>/dev/null" TERM INT
        wait "$ray_pid"
        status=$?
        if [ "$status" -gt 128 ]; then  # a signal cut the wait short: wait for ray itself
            wait "$ray_pid" 2>/dev/null
            local again=$?
            [ "$again" -eq 127 ] || status=$again
        fi
        trap - TERM INT
        start_failed=0
        if [ "$role" != worker ] || [ "$status" -eq 0 ] || [ "$stopping" -eq 1 ] \
            || [ $((SECONDS - began)) -ge "${RAY_START_FAIL_S:-60}" ]; then
            break  # the head, a clean or asked-for stop, or a worker that ran and died later
        fi
        start_failed=1
        echo "ray_node: $NODE: ray start failed (exit $status, try $try of ${RAY_START_RETRIES:-3})" >&2
        sleep 2
    done
    local keep=$RAY_LOG_DIR/nodes/$NODE/$RAY_RUN_TAG
    mkdir -p "$keep" && timeout 15 cp -r "$RAY_TEMP_DIR/ray/session_latest/logs/." "$keep/" 2>/dev/null
    [ "$start_failed" -eq 0 ] || failed "ray start failed ${RAY_START_RETRIES:-3} times (last exit $status):" \
        "see $RAY_LOG_DIR/ray-workers.$RAY_RUN_TAG.log"
    exit "$status"
}

# Says, on storage the batch shell sees, that this node got through $1 (a node that does not say
# so failed, however: even where this script could not run).
passed() {
    mkdir -p "$RAY_LOG_DIR/$1" && : >"$RAY_LOG_DIR/$1/$NODE.$RAY_RUN_TAG"
}

case ${1:-} in
    preflight) preflight && passed preflight ;;
    container) passed containers ;;
    ray) shift; run_ray "$@" ;;
    *) echo "usage: $0 preflight | container | ray head|worker ARGS..." >&2; exit 2 ;;
esac
