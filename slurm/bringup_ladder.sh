#!/usr/bin/env bash
# The bring-up ladder of docs/cluster.md, one rung per call: submits the rung's job, waits for it
# (rung 4 sends its USR1 itself), then prints `nemo-dapo bringup`'s pass / FAIL for each check.
# Run it from a login node, rung after rung, before the full-size job:
#
#   CONTAINER=/images/nemo-dapo.sqsh DATA_DIR=/data HF_MODEL=/models/Qwen2.5-32B \
#       BRINGUP_DIR=/ckpt/bringup slurm/bringup_ladder.sh 1      # then 2, 3 and 4
#
# Each rung runs in CKPT_DIR=$BRINGUP_DIR/rung<N>, its job's output in $BRINGUP_DIR/rung<N>.out. What a rung
# submits comes from `nemo-dapo ladder CONFIG N` (nemo_dapo/commands/ladder.py), which refuses (exit 2) a rung
# that cannot fit before anything is queued:
#   1  one node, 3 steps: the preset's one-node sibling (Qwen2.5-7B for the 32B preset, Qwen3-8B for
#      the 30B-A3B one; SMALL_HF_MODEL names its folder), at the preset's engine TP
#   2  two nodes with NCCL_DEBUG=INFO, 3 steps: NCCL must report NET/IB (the fabric check must pass)
#   3  two nodes, 5 steps: the last step's seconds per stage and the weight sync's MiB
#   4  two nodes, a checkpoint every step; USR1 once the first is written: the job saves, exits 3,
#      requeues itself and completes; the stop must take less than USR1_LEAD_S
#   Rungs 2-4 run the preset itself, with the engines' memory share lowered (and the gradient buffers
#   released where that alone is not enough) so that it fits two nodes.
# Variables:
#   BRINGUP_DIR (required)    a new folder per ladder on the checkpoint storage every node sees
#   CONFIG=dapo_qwen2.5_32b   the preset being brought up
#   SMALL_HF_MODEL            rung 1's model folder where the preset's model needs more than one node
#   BATCH_SCRIPT              the job (slurm/dapo_32b.sbatch); its own variables (CONTAINER, HF_MODEL, ...)
#                             pass through sbatch as for a plain submission
#   NODES=2                   nodes of rungs 2-4
#   SBATCH_ARGS               more sbatch options, e.g. "--partition=debug --time=01:00:00"
#   USR1_LEAD_S=600           the batch script's --signal=B:USR1@ lead: the longest a stop may take
#   PYTHON=python3            an interpreter with nemo-dapo's dependencies, for ladder and bringup
#   POLL_S=10                 seconds between two looks at the job
# Arguments after the rung: key=value overrides for the job, after the rung's own (they win).
# Exit: 0 every check passed, 1 a check failed or the job did not complete, 2 bad usage or a rung that
# cannot fit.
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

nemo_dapo() {
    PYTHONPATH=$REPO_DIR${PYTHONPATH:+:$PYTHONPATH} "$PYTHON" -m nemo_dapo.cli "$@"
}

# The rung's job, fitted and checked: config, nodes, model variable, requirements, drill, overrides
rung_lines=$(nemo_dapo ladder --nodes "${NODES:-2}" "${CONFIG:-dapo_qwen2.5_32b}" "$rung" "$@") || {
    echo "bringup: rung $rung not submitted (nemo-dapo ladder refused it)" >&2
    exit 2
}
overrides=()
while IFS= read -r line; do
    value=${line#*=}
    case $line in
        config=*) export CONFIG=$value ;;
        nodes=*) nodes=$value ;;
        model=*) model_variable=$value ;;
        require=*) require=$value ;;
        drill=*) drill=$value ;;
        export=*) export "${value?}" ;;
        override=*) overrides+=("$value") ;;
    esac
done <<<"$rung_lines"
if [ "$model_variable" != HF_MODEL ]; then  # rung 1 on a smaller model of the preset's family
    if [ -z "${!model_variable:-}" ]; then
        echo "bringup: rung $rung runs $CONFIG: set $model_variable to its model's folder" >&2
        exit 2
    fi
    export HF_MODEL=${!model_variable}
fi

# shellcheck disable=SC2086  # SBATCH_ARGS: options separated by spaces
job=$(sbatch --parsable --nodes="$nodes" --output="$output" ${SBATCH_ARGS:-} "$BATCH_SCRIPT" "${overrides[@]}")
job=${job%%;*}
echo "bringup: rung $rung: job $job on $nodes node(s), output $output"

# The job's state, empty once Slurm no longer knows it ("Invalid job id"). Any other failure of
# scontrol (slurmctld busy or restarting) is asked again: the job is not taken for gone.
job_state() {
    local said tries=30
    while ! said=$(scontrol show job "$job" 2>&1); do
        case $said in *"Invalid job id"*) return 0 ;; esac
        tries=$((tries - 1))
        if [ "$tries" -eq 0 ]; then
            echo "bringup: scontrol failed 30 times in a row ($said); job $job may still run" >&2
            return 1
        fi
        echo "bringup: scontrol failed ($said): asking again in ${POLL_S}s" >&2
        sleep "$POLL_S"
    done
    grep -o 'JobState=[A-Z_]*' <<<"$said" | cut -d= -f2 || true
}

signal_sent=''
while :; do
    state=$(job_state) || exit 1
    case $state in
        COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | BOOT_FAIL | DEADLINE | '') break ;;
    esac
    if [ "$drill" = usr1 ] && [ -z "$signal_sent" ] && [ "$state" = RUNNING ] && [ -e "$CKPT_DIR/checkpoints/latest" ]; then
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
