"""``nemo-dapo train``: claim the output folder, say so at once if the run is already complete,
start the workers (``assembly.py``), train in the configured mode, export the last checkpoint."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from nemo_dapo.config import Config
from nemo_dapo.config.gpu_fit import startup_memory_problems
from nemo_dapo.config.model_checks import fabric_warning
from nemo_dapo.config.problems import raise_problems
from nemo_dapo.config.topology import num_engines, policy_groups, total_optimizer_steps
from nemo_dapo.config.validate import combination_notes
from nemo_dapo.trainer import assembly
from nemo_dapo.trainer.checkpoint import CheckpointManager
from nemo_dapo.trainer.export import export_hf, exported_from
from nemo_dapo.trainer.preemption import PreemptionSignals
from nemo_dapo.trainer.run_folder import RunFolder, refuse_mixing
from nemo_dapo.trainer.summary import completed_run

log = logging.getLogger(__name__)


def run_training(cfg: Config) -> dict:
    """``nemo-dapo train``: claim the output folder, start the workers, train, export."""
    from nemo_dapo.logs import configure_logging
    from nemo_dapo.trainer.sinks import missing_packages

    configure_logging(cfg.trainer.log_level)  # before Ray starts: its workers inherit the level
    # a layout that cannot fit its GPUs is refused before the folder, the data or Ray is touched
    raise_problems(missing_packages(cfg.trainer.loggers) + startup_memory_problems(cfg))
    if warning := fabric_warning(cfg, os.environ):
        log.warning(warning)
    folder = RunFolder(cfg.trainer.output_dir)  # held until the run ends: one run per folder
    try:
        manager = CheckpointManager(Path(cfg.trainer.output_dir) / "checkpoints")
        manager.refuse_missing_resume(cfg.checkpoint.resume)
        if not manager.applied_in_this_job(cfg.checkpoint.resume):  # else a requeue continues its rollback
            refuse_mixing(manager.step_folders(), cfg.checkpoint.resume, cfg.trainer.output_dir)
        finished = completed_run(cfg, lambda: len(assembly.load_data(assembly.resolve_paths(cfg)).train))
        if finished is not None:  # said before Ray or any worker starts
            return {**finished, "hf_export": str(export_run(cfg, Path(finished["checkpoint"])))}
        return _run_claimed(cfg)
    finally:
        folder.release()


def _run_claimed(cfg: Config) -> dict:
    """Stop signals are caught from here on: one that comes while the workers start (a 32B model
    loads for minutes) stops the run before its first step, exit 4 (no progress)."""
    with PreemptionSignals() as preemption:
        return _train(cfg, preemption)


def _train(cfg: Config, preemption: PreemptionSignals) -> dict:
    from nemo_dapo.cluster.ray_env import init_ray, shutdown_ray
    from nemo_dapo.trainer.fit import DAPOTrainer

    cfg = assembly.resolve_paths(cfg)
    tokenizer = assembly.usable_inputs(cfg)  # a data file or tokenizer that cannot serve: refused before Ray
    for note in combination_notes(cfg):
        log.info(note)
    processes = cfg.actor.num_workers * policy_groups(cfg) + num_engines(cfg)
    init_ray(num_cpus=max(os.cpu_count() or 1, processes))
    reward = None
    try:
        # a run whose length the config fixes needs no data to size its schedule: its workers load
        # their models while the driver reads the data (an epoch-counted run reads it first)
        if cfg.trainer.total_training_steps:
            starting = assembly.launch_workers(cfg, total_optimizer_steps(cfg, dataset_size=0))
            data = assembly.load_data(cfg, tokenizer)
        else:
            data = assembly.load_data(cfg, tokenizer)
            starting = assembly.launch_workers(cfg, total_optimizer_steps(cfg, len(data.train)))
        reward = assembly.reward_manager(cfg)
        workers = starting.ready()
        policy, ref, rollout = workers.policy, workers.ref, workers.rollout
        trainer = DAPOTrainer(cfg, policy, rollout, data.tokenizer, data.train, data.val, reward, ref_policy=ref)
        summary = trainer.fit(preemption)
        return {**summary, "hf_export": str(export_run(cfg, trainer.checkpoints.step_folders()[0][1]))}
    finally:
        if reward is not None:
            reward.close()
        shutdown_ray()


def export_run(cfg: Config, checkpoint: Path) -> Path:
    """``hf_export`` holding the run's last checkpoint: exported unless a complete export of that
    checkpoint is there (a run found finished whose export failed or was cut short exports it)."""
    export_dir = Path(cfg.trainer.output_dir) / "hf_export"
    if exported_from(export_dir) != checkpoint.resolve():
        log.info("exporting %s to %s", checkpoint, export_dir)
        export_hf(checkpoint, assembly.resolve_paths(cfg).model.path, export_dir, overwrite=True)
    return export_dir
