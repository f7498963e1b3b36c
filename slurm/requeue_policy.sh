#!/usr/bin/env bash
# When a run that ended requeues its job, and what a requeue takes along: sourced by
# slurm/dapo_32b.sbatch and by the batch script NeMo-Run writes (nemo_dapo/commands/nemo_run_launcher.py),
# so both follow one policy.
#
#   requeue_wanted STATUS   # exit 0 (and a line saying why) when the job should requeue
#   requeue_job STATUS      # the same, acted on: `scontrol requeue`, the failed nodes excluded
#   startup_exit STATUS     # EXIT trap while Ray starts: a start-up that failed goes through the policy
#   job_cleanup             # EXIT trap after it: Ray stopped; the named containers removed unless requeued
#
# STATUS is the trainer's exit code (or the start-up's): 0 finished and 2 invalid configuration
# never requeue (the second would fail the same way again), nor does a job being cancelled
# (`scancel`: Slurm shows it COMPLETING or CANCELLED with no reason, where a time limit says
# Reason=TimeLimit and a preemption's grace time leaves it RUNNING); 3 (stopped by a signal or
# by checkpoint.save_by after training in this run, a checkpoint saved) always requeues; 4 (stopped
# before finishing a step in this run: no progress) and anything else (a crash: a node lost, a
# worker killed, a failed start-up, a bug) requeue at most MAX_CRASH_REQUEUES times (default 2)
# without progress: CRASH_COUNT_FILE holds the count and, on its second line, the newest
# checkpoint's step at the last such requeue (read from CHECKPOINTS_DIR/latest); a newer
# checkpoint counts from 1 again. A job that keeps training keeps requeueing after node
# failures; one that fails again, or stops again before a step, without saving anything new
# stops soon, naming why.
#
# Nodes that failed the start-up (RAY_FAILED_NODES, slurm/ray_cluster.sh) are added to the
# requeued job's ExcNodeList, unless every node of the job failed (then the nodes are not the cause).

requeue_wanted() {
    local status=$1 why
    case $status in
        0) return 1 ;;
        2) echo "requeue: invalid configuration (exit 2): not requeued" >&2; return 1 ;;
    esac
    if job_cancelled; then
        echo "requeue: the job was cancelled (scancel): not requeued; \`scontrol requeue $SLURM_JOB_ID\` would" \
            "bring it back to resume from its newest checkpoint" >&2
        return 1
    fi
    case $status in
        3) echo "requeue: stopped by a signal or before the time limit (exit 3): requeueing; the next run resumes from the newest checkpoint"
           return 0 ;;
        4) why="stopped before finishing a step in this run (exit 4: see the trainer's last lines)" ;;
        *) why="a crash (exit $status)" ;;
    esac
    requeue_without_progress "$why"
}

# Whether Slurm is cancelling the job (scancel), as opposed to its time limit or a preemption.
job_cancelled() {
    local said
    [ -n "${SLURM_JOB_ID:-}" ] || return 1
    said=$(command scontrol show job "$SLURM_JOB_ID" 2>/dev/null) || return 1
    grep -qE 'JobState=(COMPLETING|CANCELLED) ' <<<"$said" && grep -q 'Reason=None ' <<<"$said"
}

# Counts a requeue without progress (CRASH_COUNT_FILE); refuses past MAX_CRASH_REQUEUES.
requeue_without_progress() {
    local why=$1 crashes saved at_crash
    local count_file=${CRASH_COUNT_FILE:?set CRASH_COUNT_FILE to the file that counts crash requeues}
    local limit=${MAX_CRASH_REQUEUES:-2}
    saved=$(newest_checkpoint_step)
    { read -r crashes && read -r at_crash; } 2>/dev/null <"$count_file" || true
    [[ ${crashes:-} =~ ^[0-9]+$ ]] || crashes=0
    [[ ${at_crash:-} =~ ^[0-9]+$ ]] || at_crash=0
    if [ "$crashes" -gt 0 ] && [ "$saved" -gt "$at_crash" ]; then
        echo "requeue: checkpoint of step $saved saved since the last requeue without progress (step $at_crash):" \
            "count reset"
        crashes=0
    fi
    if [ "$crashes" -ge "$limit" ]; then
        echo "requeue: $why after $crashes requeue(s) without a new checkpoint (MAX_CRASH_REQUEUES=$limit):" \
            "not requeued" >&2
        return 1
    fi
    mkdir -p "$(dirname "$count_file")"
    printf '%s\n%s\n' $((crashes + 1)) "$saved" >"$count_file"
    echo "requeue: $why: requeueing ($((crashes + 1)) of $limit requeues without progress);" \
        "the next run resumes from the newest checkpoint"
    return 0
}

# The step of the checkpoint CHECKPOINTS_DIR/latest names (global_step_N), 0 when there is none.
newest_checkpoint_step() {
    local name
    name=$(cat "${CHECKPOINTS_DIR:-/nonexistent}/latest" 2>/dev/null) || name=
    name=${name##*global_step_}
    [[ $name =~ ^[0-9]+$ ]] && echo "$name" || echo 0
}

# The requeue signals every process of the job (SIGTERM, SIGKILL after KillWait): the calls that
# follow it ignore SIGTERM, so that the exclusion is not cut short.
requeue_job() {
    requeue_wanted "$1" || return 1
    if ! (trap '' TERM; command scontrol requeue "$SLURM_JOB_ID"); then
        echo "requeue: scontrol requeue refused: Slurm is already requeueing the job, or it was cancelled" >&2
        return 1
    fi
    JOB_REQUEUED=1
    (trap '' TERM; exclude_failed_nodes)
}

# Adds the nodes RAY_FAILED_NODES names to the (requeued, so pending) job's ExcNodeList: in a
# heterogeneous job, to the ExcNodeList of the component each node belongs to.
exclude_failed_nodes() {
    [ -s "${RAY_FAILED_NODES:-}" ] || return 0
    local failed nodes=${RAY_NUM_NODES:-${SLURM_JOB_NUM_NODES:-1}} component
    failed=$(cut -d: -f1 "$RAY_FAILED_NODES" | sort -u)
    if [ "$(grep -c . <<<"$failed")" -ge "$nodes" ] && [ "$nodes" -gt 1 ]; then
        echo "requeue: every node of the job failed its start-up: none excluded (the site, not a node: see above)" >&2
        return 0
    fi
    for component in 0 1; do
        local job=${SLURM_JOB_ID:-} group=${SLURM_JOB_NODELIST:-}
        if [ "${SLURM_HET_SIZE:-1}" -gt 1 ]; then
            job=$(eval echo "\${SLURM_JOB_ID_HET_GROUP_$component:-}")
            group=$(eval echo "\${SLURM_JOB_NODELIST_HET_GROUP_$component:-}")
        elif [ "$component" -eq 1 ]; then
            break
        fi
        local mine
        mine=$(command scontrol show hostnames "$group" 2>/dev/null | grep -Fx -f - <(echo "$failed")) || continue
        exclude_nodes "$job" "$mine"
    done
}

# Adds NODES (one per line) to job JOB's ExcNodeList.
exclude_nodes() {
    local job=$1 failed=$2 excluded
    excluded=$(command scontrol show job "$job" | grep -o 'ExcNodeList=[^ ]*' | sed -n 1p | cut -d= -f2)
    [ "$excluded" != "(null)" ] || excluded=
    excluded=$({ [ -z "$excluded" ] || command scontrol show hostnames "$excluded"; echo "$failed"; } | sort -u |
        paste -sd, -)
    if command scontrol update JobId="$job" ExcNodeList="$excluded"; then
        echo "requeue: node(s) $(paste -sd, <<<"$failed") excluded from the requeued job (ExcNodeList=$excluded):" \
            "$(awk -F: 'NR == FNR {want[$1]; next} $1 in want' <(echo "$failed") "$RAY_FAILED_NODES" | paste -sd';' -)"
    else
        echo "requeue: could not exclude $(paste -sd, <<<"$failed") from the job" >&2
    fi
}

startup_exit() {
    local status=$1
    [ -z "${STOP_SIGNAL:-}" ] || [ "$status" -eq 2 ] || status=4  # stopped while starting: no progress
    echo "requeue: the job ended while starting (exit $status)" >&2
    requeue_job "$status" || true
    job_cleanup
    exit "$status"
}

job_cleanup() {
    ! declare -F ray_cluster_stop >/dev/null || ray_cluster_stop
    [ -n "${JOB_REQUEUED:-}" ] || ! declare -F ray_cluster_remove_containers >/dev/null || ray_cluster_remove_containers
}
