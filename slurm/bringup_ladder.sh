#!/usr/bin/env bash
# The bring-up ladder of docs/cluster.md, one rung per call: submits the rung's job, waits for it
# (rung 4 sends its USR1 itself), then prints `nemo-dapo bringup`'s pass / FAIL for each check.
# Run it from a login node, rung after rung, before the full-size job:
#
#   CONTAINER=/images/nemo-dapo.sqsh DATA_DIR=/data HF_MODEL=/models/Qwen2.5-32B \
#       BRINGUP_DIR=/ckpt/bringup slurm/bringup_ladder.sh 1      # then 2, 3 and 4
#
# Rungs (each runs in CKPT_DIR=$BRINGUP_DIR/rung<N>, its job's output in $BRINGUP_DIR/rung<N>.out):
#   1  one node: `nemo-dapo plan` (refuses what cannot fit), then 3 steps at the preset's engine TP
#   2  two nodes with NCCL_DEBUG=INFO, 3 steps: NCCL must report NET/IB (the fabric check must pass)
#   3  two nodes, 5 steps: the last step's seconds per stage and the weight sync's MiB
#   4  two nodes, a checkpoint every step; USR1 once the first is written: the job saves, exits 3,
#      requeues itself and completes; the stop must take less than USR1_LEAD_S
# Variables:
#   BRINGUP_DIR (required)    a new folder per ladder on the checkpoint storage every node sees
#   BATCH_SCRIPT              the job (slurm/dapo_32b.sbatch); its own variables (CONFIG, CONTAINER, ...)
#                             pass through sbatch as for a plain submission
#   NODES                     nodes of rungs 2-4 (2)
#   SBATCH_ARGS               more sbatch options, e.g. "--partition=debug --time=01:00:00"
#   USR1_LEAD_S=600           the batch script's --signal=B:USR1@ lead: the longest a stop may take
#   PLAN=1                    rung 1 runs `nemo-dapo plan $CONFIG` first (0: skip, e.g. a built-in model)
#   PYTHON=python3            an interpreter with nemo-dapo's dependencies, for plan and bringup
#   POLL_S=10                 seconds between two looks at the job
# Arguments after the rung: key=value overrides for the job, after the rung's own (they win).
# Exit: 0 every check passed, 1 a check failed or the job did not complete, 2 bad usage.
set -euo pipefail

REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rung=${1:-}
if [[ ! $rung =~ ^[1-4]$ ]]; then
    echo "usage: BRINGUP_DIR=... slurm/bringup_ladder.sh 1|2|3|4 [key=value ...] (see the script's header)" >&2
    exit 2
fi
shift
if [ -z "${BRINGUP_DIR:-}" ]; then
    echo "bringup: set BRINGUP_DIR to a new folder on storage every node sees (each rung runs in a folder there)" >&2
    exit 2
fi
BATCH_SCRIPT=${BATCH_SCRIPT:-$REPO_DIR/slurm/dapo_32b.sbatch}
USR1_LEAD_S=${USR1_LEAD_S:-600}
PYTHON=${PYTHON:-python3}
POLL_S=${POLL_S:-10}
export CKPT_DIR=$BRINGUP_DIR/rung$rung
output=$BRINGUP_DIR/rung$rung.out
if [ -e "$CKPT_DIR" ] || [ -e "$output" ]; then  # a rung starts afresh, and nothing of an earlier one is lost
    echo "bringup: $CKPT_DIR or $output exists (an earlier try): move it away, or set BRINGUP_DIR to a new folder" >&2
    exit 2
fi
mkdir -p "$BRINGUP_DIR"

short=(trainer.save_freq=0 trainer.test_freq=0)
require=steps,stages
case $rung in
    1) nodes=1 overrides=(trainer.total_training_steps=3 "${short[@]}") ;;
    2) nodes=2 overrides=(trainer.total_training_steps=3 "${short[@]}") require+=,fabric
       export NCCL_DEBUG=INFO ;;
    3) nodes=2 overrides=(trainer.total_training_steps=5 "${short[@]}") ;;
    4) nodes=2 overrides=(trainer.total_training_steps=4 trainer.save_freq=1 trainer.test_freq=0)
       require+=,checkpoint,stop ;;
esac
[ "$rung" = 1 ] || nodes=${NODES:-$nodes}

nemo_dapo() {
    PYTHONPATH=$REPO_DIR${PYTHONPATH:+:$PYTHONPATH} "$PYTHON" -m nemo_dapo.cli "$@"
}

if [ "$rung" = 1 ] && [ "${PLAN:-1}" = 1 ]; then
    nemo_dapo plan "${CONFIG:-dapo_qwen2.5_32b}" "$@" || { echo "bringup: FAIL plan (rung 1 not submitted)"; exit 1; }
fi

# shellcheck disable=SC2086  # SBATCH_ARGS: options separated by spaces
job=$(sbatch --parsable --nodes="$nodes" --output="$output" ${SBATCH_ARGS:-} "$BATCH_SCRIPT" "${overrides[@]}" "$@")
job=${job%%;*}
echo "bringup: rung $rung: job $job on $nodes node(s), output $output"

job_state() {  # empty once Slurm no longer knows the job
    scontrol show job "$job" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2 || true
}

signal_sent=''
while :; do
    state=$(job_state)
    case $state in
        COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | BOOT_FAIL | DEADLINE | '') break ;;
    esac
    if [ "$rung" = 4 ] && [ -z "$signal_sent" ] && [ "$state" = RUNNING ] && [ -e "$CKPT_DIR/checkpoints/latest" ]; then
        signal_sent=$(date +%s.%N)
        scancel --batch --signal=USR1 "$job"
        echo "bringup: USR1 sent to job $job after its first checkpoint"
    fi
    sleep "$POLL_S"
done
echo "bringup: job $job ended: ${state:-unknown (no longer in scontrol)}"

checks=(bringup "$CKPT_DIR" --job-log "$output" --require "$require")
[ -z "$signal_sent" ] || checks+=(--signal-sent "$signal_sent" --stop-within "$USR1_LEAD_S")
status=0
nemo_dapo "${checks[@]}" || status=$?
if [ "$state" != COMPLETED ]; then
    echo "bringup: FAIL job ended ${state:-unknown (no longer in scontrol)}, not COMPLETED (see $output)"
    status=1
fi
exit "$status"
