#!/usr/bin/env bash
# The trainer's deadline inside a Slurm job: sourced by slurm/dapo_32b.sbatch and by the batch
# script NeMo-Run writes. Exports NEMO_DAPO_SAVE_BY, the Unix time by which the last checkpoint is
# due (checkpoint.save_by): the job's end (squeue's EndTime) less SAVE_MARGIN_S; left unset for a
# job without a time limit (its EndTime is not a date) or outside Slurm.
#
#   SAVE_MARGIN_S=300        seconds before the job's end; must cover a background save
#                            (checkpoint.async_save) and the teardown (`nemo-dapo plan` sizes a save)

SAVE_MARGIN_S=${SAVE_MARGIN_S:-300}
# (a heterogeneous job lists each component: they end together)
if job_end=$(squeue -h -j "${SLURM_JOB_ID:-}" -o %e 2>/dev/null | sed -n 1p) && job_end=$(date -d "$job_end" +%s 2>/dev/null); then
    export NEMO_DAPO_SAVE_BY=$((job_end - SAVE_MARGIN_S))
fi
