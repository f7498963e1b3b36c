#!/usr/bin/env bash
# When a run that ended requeues its job: sourced by slurm/dapo_32b.sbatch and by the batch
# script NeMo-Run writes (nemo_dapo/launch/nemo_run_launcher.py), so both follow one policy.
#
#   requeue_wanted STATUS   # exit 0 (and a line saying why) when the job should requeue
#
# STATUS is the trainer's exit code: 0 finished and 2 invalid configuration never requeue (the
# second would fail the same way again); 3 (stopped by a signal: the time limit's warning or a
# preemption, with a checkpoint after USR1; or by the trainer before the job's end, with one:
# checkpoint.save_by) always does; anything else is a crash (a node lost,
# a worker killed, a bug) and requeues at most MAX_CRASH_REQUEUES times (default 2) without
# progress: CRASH_COUNT_FILE holds the count and, on its second line, the newest checkpoint's
# step at the last crash (read from CHECKPOINTS_DIR/latest); a crash after a newer checkpoint
# counts from 1 again. A job that keeps training keeps requeueing after node failures, one that
# fails again without saving anything new stops soon.

requeue_wanted() {
    local status=$1 crashes
    case $status in
        0) return 1 ;;
        2) echo "requeue: invalid configuration (exit 2): not requeued" >&2; return 1 ;;
        3) echo "requeue: stopped by a signal or before the time limit (exit 3): requeueing; the next run resumes from the newest checkpoint"
           return 0 ;;
    esac
    local count_file=${CRASH_COUNT_FILE:?set CRASH_COUNT_FILE to the file that counts crash requeues}
    local limit=${MAX_CRASH_REQUEUES:-2} saved at_crash
    saved=$(newest_checkpoint_step)
    { read -r crashes && read -r at_crash; } 2>/dev/null <"$count_file" || true
    [[ ${crashes:-} =~ ^[0-9]+$ ]] || crashes=0
    [[ ${at_crash:-} =~ ^[0-9]+$ ]] || at_crash=0
    if [ "$crashes" -gt 0 ] && [ "$saved" -gt "$at_crash" ]; then
        echo "requeue: checkpoint of step $saved saved since the last crash (step $at_crash): crash count reset"
        crashes=0
    fi
    if [ "$crashes" -ge "$limit" ]; then
        echo "requeue: exit $status after $crashes crash requeue(s) without a new checkpoint" \
            "(MAX_CRASH_REQUEUES=$limit): not requeued" >&2
        return 1
    fi
    mkdir -p "$(dirname "$count_file")"
    printf '%s\n%s\n' $((crashes + 1)) "$saved" >"$count_file"
    echo "requeue: exit $status, a crash: requeueing ($((crashes + 1)) of $limit crash requeues);" \
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
