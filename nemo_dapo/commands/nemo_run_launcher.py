"""``nemo-dapo launch``: the training job as a NeMo-Run experiment, on Slurm or on this machine.

Slurm (``--executor slurm``): NeMo-Run packages the committed code (``git archive`` of HEAD), writes
the batch script and submits it, over SSH from a laptop (``--ssh-host``) or directly on a login
node. Inside the job the Ray cluster is the one of ``slurm/dapo_32b.sbatch``: the script's setup
sources ``slurm/ray_cluster.sh`` (head on the first node, a worker on every other, all in the
trainer's container), then NeMo-Run's ``srun`` runs ``nemo-dapo train`` once, on the head node.
Preemption: ``--signal=USR1@600`` reaches the trainer (Ray ignores USR1), which checkpoints and
exits 3; NeMo-Run's script requeues a run that exited non-zero while fewer than
``--max-restarts`` restarts happened, and the requeued run resumes (``checkpoint.resume=auto``).
Its requeue goes through ``slurm/requeue_policy.sh`` first (:func:`requeue_policy_lines`), as in
``slurm/dapo_32b.sbatch``: never after an invalid config (exit 2), after a crash only
``--max-crash-restarts`` times.

Local (``--executor local``): the same ``nemo-dapo train`` as a NeMo-Run task on this machine,
with its own Ray on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from pathlib import Path

from nemo_dapo.config import DEFAULT_PRESET, load_config
from nemo_dapo.errors import InputError

RUNDIR_NAME = "nemo_run"  # nemo_run.config.RUNDIR_NAME, here without importing NeMo-Run
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
PREEMPTION_SIGNAL = "USR1@600"  # 10 minutes before the time limit: enough to finish a step and save


def add_parser(subparsers) -> None:
    launch = subparsers.add_parser("launch", help="run `nemo-dapo train` as a NeMo-Run experiment (Slurm or local)")
    launch.add_argument("--config", default=DEFAULT_PRESET, help="preset name in conf/ or a YAML path")
    launch.add_argument("--executor", choices=("slurm", "local"), default="local")
    launch.add_argument("--dryrun", action="store_true", help="print the batch script (or command) and submit nothing")
    launch.add_argument("--name", help="experiment name (default: the config name)")
    launch.add_argument("--ckpt-dir", help="trainer.output_dir (Slurm default: REMOTE_JOB_DIR/NAME/outputs)")
    slurm = launch.add_argument_group("slurm")
    slurm.add_argument("--nodes", type=int, help="default: the preset's trainer.nnodes")
    slurm.add_argument(
        "--gpus-per-node",
        type=int,
        help="default: the preset's trainer.n_gpus_per_node; 0 runs Ray and the trainer on CPUs",
    )
    slurm.add_argument("--time", default="04:00:00", help="time limit per run, HH:MM:SS")
    slurm.add_argument("--account")
    slurm.add_argument("--partition")
    slurm.add_argument("--container-image", help="pyxis/enroot image; without one the nodes' own Python runs")
    slurm.add_argument("--container-mounts", default="", help="extra src:dst[,src:dst...] container mounts")
    slurm.add_argument("--data-dir", help="folder of the preset's parquet files (DAPO_DATA_DIR)")
    slurm.add_argument(
        "--hf-model", help="the base model's Hugging Face folder, on storage every node sees (HF_MODEL); not a hub name"
    )
    slurm.add_argument("--ssh-host", help="submit over SSH from this machine (else: on a login node)")
    slurm.add_argument("--ssh-user")
    slurm.add_argument("--ssh-identity", help="SSH private key file")
    slurm.add_argument(
        "--remote-job-dir",
        help="with --ssh-host: shared folder on the cluster for NeMo-Run's "
        "job folders (on a login node they are $NEMORUN_HOME/experiments, which must be shared)",
    )
    slurm.add_argument(
        "--max-restarts",
        type=int,
        default=20,
        help="requeues in all (preemptions, exit 3, and crashes); an invalid config (exit 2) never requeues",
    )
    slurm.add_argument(
        "--max-crash-restarts",
        type=int,
        default=2,
        help="of those, requeues after a crash (exit 1 or a signal): a failing job stops soon",
    )
    slurm.add_argument("--python", default="python3", help="interpreter in the container (or on the nodes)")
    launch.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_training_steps=10")
    launch.set_defaults(fn=run_launch)


def run_launch(args: argparse.Namespace) -> int:
    """Validate the config here (a typo fails now, not in the queue), then dry-run or run the experiment."""
    if args.executor == "slurm":
        args.remote_job_dir = remote_job_dir(args)
        allocation_from_preset(args)
    overrides = trainer_overrides(args)
    if args.executor == "slurm":
        refuse_rundir_paths(args, overrides)
    load_config(args.config, overrides)
    if args.executor == "local":
        return _launch_local(args, overrides)
    return _launch_slurm(args, overrides)


def allocation_from_preset(args: argparse.Namespace) -> None:
    """Nodes and GPUs per node the preset (with the user's overrides) was written for, unless given:
    a 16-node preset launched without ``--nodes`` asks for 16 nodes, not 1."""
    trainer = load_config(args.config, args.overrides, placement=False).trainer
    if trainer.rollout_pool.nnodes:
        raise InputError(
            f"trainer.rollout_pool.nnodes={trainer.rollout_pool.nnodes}: two pools need a Slurm heterogeneous job, "
            "which `nemo-dapo launch` does not submit (NeMo-Run's heterogeneous executor runs one task per "
            "component, and the rollout component here runs no task, only Ray steps the batch shell keeps alive); "
            'submit slurm/dapo_pools.sbatch with sbatch (docs/cluster.md, "Two pools")'
        )
    args.nodes = trainer.nnodes if args.nodes is None else args.nodes
    args.gpus_per_node = trainer.n_gpus_per_node if args.gpus_per_node is None else args.gpus_per_node


def remote_job_dir(args: argparse.Namespace) -> str:
    """Where the job folders live on the cluster. Without SSH NeMo-Run writes them in place, under
    $NEMORUN_HOME/experiments (it copies nothing), so that is the folder."""
    from nemo_run.config import get_nemorun_home

    if not args.ssh_host:
        local = f"{get_nemorun_home()}/experiments"
        if args.remote_job_dir and Path(args.remote_job_dir).resolve() != Path(local).resolve():
            raise SystemExit(
                f"nemo-dapo launch: without --ssh-host the job folders are {local}; "
                "set NEMORUN_HOME to a shared folder instead of --remote-job-dir"
            )
        return local
    if not (args.ssh_user and args.remote_job_dir):
        raise SystemExit("nemo-dapo launch: --ssh-host needs --ssh-user and --remote-job-dir")
    return args.remote_job_dir


def refuse_rundir_paths(args: argparse.Namespace, overrides: list[str]) -> None:
    """NeMo-Run 0.11 replaces every ``/nemo_run`` in the batch script it writes by the job's folder
    (its name for the code's place in a container), so a cluster path with such a part would
    point elsewhere at run time."""
    paths = [args.remote_job_dir, args.data_dir, args.hf_model, *overrides]
    bad = [path for path in paths if path and f"/{RUNDIR_NAME}" in path]
    if bad:
        raise InputError(
            f"nemo-dapo launch: {bad[0]} contains /{RUNDIR_NAME}, which NeMo-Run rewrites in its batch script; "
            f"use a folder name without it (e.g. nemo-run) for NEMORUN_HOME, --remote-job-dir and the data paths"
        )


def experiment_name(args: argparse.Namespace) -> str:
    preset = Path(args.config).name.removesuffix(".yaml").removesuffix(".yml")
    return args.name or f"nemo-dapo-{preset}"


def ckpt_dir(args: argparse.Namespace) -> str | None:
    if args.ckpt_dir:
        return args.ckpt_dir
    if args.executor == "slurm":
        return f"{args.remote_job_dir}/{experiment_name(args)}/outputs"
    return str(Path(load_config(args.config, args.overrides).trainer.output_dir).resolve())


def trainer_overrides(args: argparse.Namespace) -> list[str]:
    """The overrides `nemo-dapo train` gets: the allocation's shape, the output folder, then the user's."""
    fixed = [f"trainer.output_dir={ckpt_dir(args)}", "checkpoint.resume=auto"]
    if args.executor == "slurm":
        fixed += [f"trainer.nnodes={args.nodes}", f"trainer.n_gpus_per_node={args.gpus_per_node}"]
        if args.gpus_per_node > 0:  # one training rank per GPU of the allocation
            fixed.append(f"actor.num_workers={args.nodes * args.gpus_per_node}")
        fixed.append("checkpoint.save_by=${oc.env:NEMO_DAPO_SAVE_BY,null}")  # set in the job (job_deadline.sh)
    return fixed + list(args.overrides)


def train_task(python: str, config: str, overrides: list[str], *, shell: bool, env: dict[str, str] | None = None):
    """``python -m nemo_dapo.cli train ...``; quoted when it becomes a line of a batch script."""
    import nemo_run as run

    arguments = ["train", "--config", config, *overrides]
    return run.Script(
        path="nemo_dapo.cli",
        entrypoint=python,
        m=True,
        env=env or {},
        args=[shlex.quote(a) for a in arguments] if shell else arguments,
    )


# ----------------------------------------------------------------------------- local
def _launch_local(args: argparse.Namespace, overrides: list[str]) -> int:
    import nemo_run as run

    task = train_task(sys.executable, args.config, overrides, shell=False, env={"PYTHONPATH": str(PACKAGE_ROOT)})
    if args.dryrun:
        print(shlex.join([sys.executable, "-m", "nemo_dapo.cli", "train", "--config", args.config, *overrides]))
        return 0
    with run.Experiment(experiment_name(args), executor=run.LocalExecutor(), log_level="WARN") as experiment:
        experiment.add(task, name="train", tail_logs=True)
        experiment.run(sequential=True, tail_logs=True)
    state = next(iter(experiment.status(return_dict=True).values()))["status"]
    print(f"nemo-dapo launch: local run {state.name}; outputs in {ckpt_dir(args)}")
    return 0 if state.name == "SUCCEEDED" else 1


# ----------------------------------------------------------------------------- slurm
def container_mounts(args: argparse.Namespace) -> list[str]:
    """Every cluster path the job touches, mounted at the same path (the job folder holds code and outputs)."""
    paths = [args.remote_job_dir, args.data_dir, args.ckpt_dir]
    if args.hf_model and args.hf_model.startswith("/"):
        paths.append(args.hf_model)
    mounts = [f"{p}:{p}" for p in dict.fromkeys(filter(None, paths))]
    return mounts + [m for m in args.container_mounts.split(",") if m]


def slurm_env(args: argparse.Namespace) -> dict[str, str]:
    """Exported by the batch script: read by slurm/ray_cluster.sh and by the preset's ${oc.env:...}."""
    env = {
        "CONTAINER": args.container_image or "",
        "RAY_GPUS_PER_NODE": str(args.gpus_per_node),
        "LOG_DIR": f"{args.remote_job_dir}/{experiment_name(args)}/logs",
        "PYTHON": args.python,
    }
    if args.data_dir:
        env["DAPO_DATA_DIR"] = args.data_dir
    if args.hf_model:
        env["HF_MODEL"] = args.hf_model
    return {key: shlex.quote(value) for key, value in env.items()}  # NeMo-Run writes `export KEY=value`


# The trainer's step joins the node's named container that slurm/ray_cluster.sh made, with the
# node's Ray session folder bound (its sockets live there, and pyxis gives each container its own
# /tmp), and the node's CPUs. NeMo-Run writes srun's arguments unquoted: the shell expands these in
# the batch script, after ray_cluster_start set RAY_TEMP_DIR.
RAY_FOLDER_MOUNT = "${RAY_TEMP_DIR}:${RAY_TEMP_DIR}"
NAMED_CONTAINER = "--container-name=nemo-dapo-${SLURM_JOB_ID}"
NODE_CPUS = "--cpus-per-task=${SLURM_CPUS_ON_NODE}"


def requeue_policy_lines(max_crash_restarts: int, checkpoints_dir: str) -> str:
    """Batch-script lines that put slurm/requeue_policy.sh in front of NeMo-Run's requeue block,
    which runs ``scontrol requeue`` after any non-zero exit (``$exitcode``): the policy of
    ``slurm/dapo_32b.sbatch`` decides and acts (:func:`ray_setup_lines` sources it from the
    packaged code): a preemption (exit 3) requeues, a crash or a stop before a first step (exit 4)
    ``max_crash_restarts`` times with no new checkpoint in ``checkpoints_dir`` between them,
    counted per job in ``$LOG_DIR/$SLURM_JOB_ID/crash_requeues``, an invalid config (exit 2) and a
    cancelled job never; the nodes that failed the start-up are excluded. Every other ``scontrol``
    call passes through."""
    return "\n".join(
        [
            "# nemo-dapo's requeue policy (slurm/requeue_policy.sh) in front of NeMo-Run's requeue block",
            f"export MAX_CRASH_REQUEUES={max_crash_restarts} CHECKPOINTS_DIR={shlex.quote(checkpoints_dir)}",
            'export CRASH_COUNT_FILE="${LOG_DIR}/${SLURM_JOB_ID}/crash_requeues"',
            "scontrol() {",
            '    if [ "${1:-}" = requeue ]; then',
            '        requeue_job "${exitcode:-1}" || true',
            "        return 0",
            "    fi",
            '    command scontrol "$@"',
            "}",
        ]
    )


def ray_setup_lines(remote_task_dir: str, mounts: list[str]) -> str:
    """Batch-script lines that start Ray over the allocation before NeMo-Run's srun of the trainer.

    The Ray steps get the trainer's mounts (REMOTE_JOB_DIR holds the task folder) plus the task
    folder at /nemo_run, where NeMo-Run puts the code in the container: Ray's workers import
    nemo_dapo from there, like the trainer. A start-up that fails goes through the requeue policy
    (slurm/requeue_policy.sh ``startup_exit``); once Ray is up the EXIT trap only cleans up,
    NeMo-Run's own block deciding about the trainer's exit. SIGTERM (a preemption's, a requeue's,
    scancel's) does not end the batch shell, which must still requeue, or not.
    """
    ray_mounts = ",".join([*(m for m in mounts if m != RAY_FOLDER_MOUNT), f"{remote_task_dir}:/nemo_run"])
    return "\n".join(
        [
            "# Ray over the allocation, in the trainer's container: slurm/ray_cluster.sh, as in slurm/dapo_32b.sbatch",
            "set +vx  # keep the per-job Ray token out of the log",
            f"export CONTAINER_MOUNTS={shlex.quote(ray_mounts)}",
            f"cd {shlex.quote(remote_task_dir + '/code')}",
            "source slurm/requeue_policy.sh",
            "source slurm/site_env.sh",
            "source slurm/job_deadline.sh  # NEMO_DAPO_SAVE_BY: checkpoint.save_by (the trainer's deadline)",
            "source slurm/ray_cluster.sh",
            "trap 'STOP_SIGNAL=TERM' TERM  # the batch shell lives on to decide about the requeue",
            "trap 'startup_exit $?' EXIT",
            "ray_cluster_start",
            "trap job_cleanup EXIT",
        ]
    )


def slurm_executor(args: argparse.Namespace):
    import nemo_run as run

    if args.ssh_host:
        tunnel = run.SSHTunnel(
            host=args.ssh_host, user=args.ssh_user, job_dir=args.remote_job_dir, identity=args.ssh_identity
        )
    else:
        tunnel = run.LocalTunnel(job_dir="")  # job folders: $NEMORUN_HOME/experiments
    return run.SlurmExecutor(
        account=args.account,
        partition=args.partition,
        job_name_prefix=f"{experiment_name(args)}-",
        nodes=args.nodes,
        ntasks_per_node=1,
        gpus_per_node=args.gpus_per_node or None,
        time=args.time,
        exclusive=True,
        signal=PREEMPTION_SIGNAL,
        container_image=args.container_image,
        container_mounts=container_mounts(args) + ([RAY_FOLDER_MOUNT] if args.container_image else []),
        env_vars=slurm_env(args),
        # the trainer is one process on the head node, beside the Ray steps
        srun_args=["--nodes=1", "--ntasks=1", "--overlap", "--relative=0", NODE_CPUS]
        + ([NAMED_CONTAINER] if args.container_image else []),
        additional_parameters={"dependency": "singleton"},  # one job of this name at a time
        retries=args.max_restarts,
        tunnel=tunnel,
        packager=run.GitArchivePackager(),
    )


def _launch_slurm(args: argparse.Namespace, overrides: list[str]) -> int:
    import nemo_run as run

    executor = slurm_executor(args)
    task = train_task(args.python, args.config, overrides, shell=True)
    with run.Experiment(experiment_name(args), executor=executor, log_level="WARN") as experiment:
        experiment.add(task, name="train")
        job_executor = experiment.jobs[0].executor  # the experiment's copy, now with its cluster folders
        remote_task_dir = f"{job_executor.tunnel.job_dir}/{Path(job_executor.job_dir).name}"
        job_executor.setup_lines = "\n".join(
            [
                requeue_policy_lines(args.max_crash_restarts, f"{ckpt_dir(args)}/checkpoints"),
                ray_setup_lines(remote_task_dir, job_executor.container_mounts),
            ]
        )
        if args.dryrun:
            experiment.dryrun(log=False, delete_exp_dir=False)
            print(batch_script(job_executor))
            shutil.rmtree(job_executor.experiment_dir, ignore_errors=True)
            return 0
        experiment.run(detach=True)
    return 0


def batch_script(executor) -> str:
    """The batch script NeMo-Run wrote for submission (``<experiment dir>/<job>_sbatch.sh``)."""
    scripts = sorted(Path(executor.experiment_dir).glob("*_sbatch.sh"))
    assert len(scripts) == 1, f"expected one batch script in {executor.experiment_dir}, found {scripts}"
    return f"# submitted with: sbatch --requeue --parsable {scripts[0].name}\n{scripts[0].read_text()}"
