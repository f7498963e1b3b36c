#!/usr/bin/env bash
# When a run that ended requeues its job: sourced by slurm/dapo_32b.sbatch and by the batch
# script NeMo-Run writes (nemo_dapo/launch/nemo_run_launcher.py), so both follow one policy.
#
#   requeue_wanted STATUS   # exit 0 (and a line saying why) when the job should requeue
#
# STATUS is the trainer's exit code: 0 finished and 2 invalid configuration never requeue (the
# second would fail the same way again); 3 (stopped by a signal: the time limit's warning or a
# preemption, with a checkpoint after USR1) always does; anything else is a crash (a node lost, a worker killed, a bug) and
# requeues at most MAX_CRASH_REQUEUES times per job (default 2), counted in CRASH_COUNT_FILE
# across the job's requeues, so that a failing job stops soon while a node failure costs one
# restart from the newest checkpoint.

requeue_wanted() {
    local status=$1 crashes
    case $status in
        0) return 1 ;;
        2) echo "requeue: invalid configuration (exit 2): not requeued" >&2; return 1 ;;
        3) echo "requeue: stopped by a signal (exit 3): requeueing; the next run resumes from the newest checkpoint"
           return 0 ;;
    esac
    local count_file=${CRASH_COUNT_FILE:?set CRASH_COUNT_FILE to the file that counts crash requeues}
    local limit=${MAX_CRASH_REQUEUES:-2}
    crashes=$(cat "$count_file" 2>/dev/null || echo 0)
    if [ "$crashes" -ge "$limit" ]; then
        echo "requeue: exit $status after $crashes crash requeue(s) (MAX_CRASH_REQUEUES=$limit): not requeued" >&2
        return 1
    fi
    mkdir -p "$(dirname "$count_file")"
    echo $((crashes + 1)) >"$count_file"
    echo "requeue: exit $status, a crash: requeueing ($((crashes + 1)) of $limit crash requeues);" \
        "the next run resumes from the newest checkpoint"
    return 0
}
