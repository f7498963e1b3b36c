"""`nemo-dapo bringup RUN_DIR [--job-log FILE]`: what a bring-up job showed, check by check.

Each rung of the ladder in docs/cluster.md ("Bring-up ladder") is a short job; this reads what
it left (the run folder, and the Slurm job's output for the network) and prints pass, FAIL or
"-" (not shown by this job) per check, exit 1 on a failure:

- steps: at least one training step finished (``metrics.jsonl``);
- stages: the last step's seconds per stage (generation, old log-probs, update, weight sync)
  and the bytes of its weight sync, to compare with ``nemo-dapo plan``'s expectations;
- checkpoint: the newest checkpoint is complete (its manifest verifies) and how big it is;
- stop: the stops in ``preemptions.jsonl`` (USR1, ``checkpoint.save_by``): the last one's
  checkpoint present, or a newer one (the run went on; retention may have removed it); with
  ``--signal-sent``, how long the stop after that signal took, against ``--stop-within``;
- fabric: with ``NCCL_DEBUG=INFO`` in the job's environment, NCCL's transport in the job log:
  ``NET/IB`` passes, ``NET/Socket`` (TCP: no InfiniBand reached the container) fails.

``--require``: checks the rung must show ("-" fails them). ``slurm/bringup_ladder.sh`` submits
each rung, waits for it and calls this with the rung's requirements.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.commands.plot import read_records
from nemo_dapo.errors import InputError
from nemo_dapo.trainer.checkpoint import CheckpointError, CheckpointManager, verify

STAGES = ("gen", "old_log_prob", "update_actor", "sync_weights")
CHECKS = ("steps", "stages", "checkpoint", "stop", "fabric")
NCCL_IB = re.compile(r"NCCL INFO .*NET/IB")
NCCL_SOCKET = re.compile(r"NCCL INFO .*NET/Socket")


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool | None  # None: this job shows nothing about it
    detail: str

    @property
    def verdict(self) -> str:
        return "-" if self.passed is None else "pass" if self.passed else "FAIL"


def step_records(run_dir: Path) -> list[dict]:
    """The step lines of ``metrics.jsonl`` (a partial last line of a killed run is skipped)."""
    path = run_dir / "metrics.jsonl"
    records = read_records(path)[0] if path.exists() else []
    return [record for record in records if mn.TIMING_S.of(stage="update_actor") in record]


def check_steps(records: list[dict]) -> list[Check]:
    if not records:
        return [Check("steps", False, "no training step finished (metrics.jsonl has none)")]
    last = records[-1]
    seconds = ", ".join(
        f"{stage} {last[mn.TIMING_S.of(stage=stage)]:.2f}" for stage in STAGES if mn.TIMING_S.of(stage=stage) in last
    )
    synced = last.get(mn.WEIGHT_SYNC_MB.name)
    sync = f"; weight sync {synced:.1f} MiB" if synced is not None else ""
    return [
        Check("steps", True, f"{len(records)} step(s), the last is step {last['step']}"),
        Check("stages", True, f"step {last['step']} s: {seconds}{sync}"),
    ]


def check_checkpoint(run_dir: Path) -> Check:
    folders = CheckpointManager(run_dir / "checkpoints").step_folders()
    if not folders:
        return Check("checkpoint", None, "none written")
    step, folder = folders[0]
    try:
        verify(folder)
    except CheckpointError as error:
        return Check("checkpoint", False, str(error))
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return Check("checkpoint", True, f"step {step} complete, {size / 2**30:.2f} GiB")


def check_stops(run_dir: Path, signal_sent: float | None = None, stop_within: float | None = None) -> Check:
    """``signal_sent`` (a Unix time): the drill's USR1; the first stop recorded after it must have
    been written (step finished, checkpoint saved) within ``stop_within`` seconds, the signal's
    lead before the time limit (``--signal=B:USR1@600``)."""
    path = run_dir / "preemptions.jsonl"
    stops = read_stops(path) if path.exists() else []
    if not stops:
        return Check("stop", None if signal_sent is None else False, "no stop recorded (USR1 or checkpoint.save_by)")
    said = "; ".join(f"step {s['step']} by {s['signal']}" for s in stops)
    last = stops[-1]
    newest = max((step for step, _ in CheckpointManager(run_dir / "checkpoints").step_folders()), default=-1)
    if last["checkpoint"] and not (run_dir / last["checkpoint"]).is_dir() and newest <= last["step"]:
        return Check("stop", False, f"{said}; the last stop's {last['checkpoint']} is missing")
    if signal_sent is None:
        return Check("stop", True, said)
    answer = next((s for s in stops if s["time"] >= signal_sent), None)
    if answer is None:
        return Check("stop", False, f"{said}; none after the signal sent at {signal_sent:.0f}")
    took = answer["time"] - signal_sent
    said += f"; saved and stopped {took:.1f} s after the signal"
    if stop_within is not None and took > stop_within:
        return Check(
            "stop", False, f"{said}, more than the signal's lead of {stop_within:g} s: raise it (--signal=B:USR1@)"
        )
    return Check("stop", True, said)


def read_stops(path: Path) -> list[dict]:
    """The stops ``preemptions.jsonl`` records; a line that is not one is refused, naming it."""
    stops = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            stop = json.loads(line)
        except ValueError:
            stop = None
        if not isinstance(stop, dict) or not {"step", "signal", "time", "checkpoint"} <= stop.keys():
            raise InputError(
                f"{path} line {number}: not a stop record ({line[:80]!r}); a run killed while it recorded a stop "
                "leaves a partial last line: delete that line, then run nemo-dapo bringup again"
            )
        stops.append(stop)
    return stops


def check_fabric(job_log: Path | None) -> Check:
    if job_log is None:
        return Check("fabric", None, "no job log given (--job-log)")
    if not job_log.is_file():
        raise InputError(
            f"--job-log {job_log}: no such file; give the Slurm job's output file (sbatch --output; "
            "slurm-<job id>.out by default), or leave --job-log out"
        )
    text = job_log.read_text(encoding="utf-8", errors="replace")
    if NCCL_SOCKET.search(text):
        return Check(
            "fabric",
            False,
            "NCCL uses NET/Socket (TCP): set NCCL_IB_HCA, and MELLANOX_VISIBLE_DEVICES=all in the "
            "container (docs/cluster.md, Site settings)",
        )
    if NCCL_IB.search(text):
        return Check("fabric", True, "NCCL uses NET/IB")
    return Check("fabric", None, "no NCCL transport line (run with NCCL_DEBUG=INFO on GPUs)")


def bringup_checks(
    run_dir: Path,
    job_log: Path | None = None,
    required: Sequence[str] = (),
    signal_sent: float | None = None,
    stop_within: float | None = None,
) -> list[Check]:
    """Every check; one named in ``required`` that this job does not show fails (a rung that must
    show it: the two-node rung's NCCL transport, the drill's checkpoint)."""
    checks = [
        *check_steps(step_records(run_dir)),
        check_checkpoint(run_dir),
        check_stops(run_dir, signal_sent, stop_within),
        check_fabric(job_log),
    ]
    return [replace(c, passed=False) if c.passed is None and c.name in required else c for c in checks]


def run_bringup(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"nemo-dapo bringup: {run_dir} is not a run folder (trainer.output_dir)", file=sys.stderr)
        return 2
    required = [name for name in args.require.split(",") if name]
    unknown = sorted(set(required) - set(CHECKS))
    if unknown:
        print(
            f"nemo-dapo bringup: --require {','.join(unknown)}: no such check (one of {', '.join(CHECKS)})",
            file=sys.stderr,
        )
        return 2
    job_log = Path(args.job_log) if args.job_log else None
    checks = bringup_checks(run_dir, job_log, required, args.signal_sent, args.stop_within)
    for check in checks:
        print(f"{check.verdict:<5} {check.name:<11} {check.detail}")
    return 1 if any(check.passed is False for check in checks) else 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "bringup", help="pass / FAIL of a bring-up job: steps, stage times, checkpoint, stops, NCCL's transport"
    )
    parser.add_argument("run_dir", help="the job's trainer.output_dir (CKPT_DIR)")
    parser.add_argument("--job-log", help="the Slurm job's output file (for NCCL's transport with NCCL_DEBUG=INFO)")
    parser.add_argument(
        "--require",
        default="",
        help=f"checks this job must show, comma-separated ({', '.join(CHECKS)}): '-' fails them",
    )
    parser.add_argument("--signal-sent", type=float, help="Unix time a stop signal (USR1) was sent to the job")
    parser.add_argument(
        "--stop-within", type=float, help="seconds the stop after --signal-sent may take (the signal's lead, e.g. 600)"
    )
    parser.set_defaults(fn=run_bringup)
