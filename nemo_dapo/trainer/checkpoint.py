"""Atomic, verifiable checkpoints with retention and ``resume: auto | disable | <path>``.

A checkpoint is written into a temporary folder, sealed with a manifest (size and digest of
every file), then renamed into place; the ``latest`` pointer is replaced last. A crash at any
instant therefore leaves the previous complete checkpoint loadable, and a damaged one is
detected by its manifest rather than by a confusing error deep inside a loader. The digests are
computed by a :data:`Hasher`: the trainer's spreads the files over the training ranks
(:mod:`nemo_dapo.digest`), the default hashes them here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from nemo_dapo.digest import ALGORITHM, digest_files, legacy_sha256
from nemo_dapo.errors import InputError
from nemo_dapo.folders import open_run_file, replace_file

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.pt"  # the trainer's own state: step, sampler, RNG (trainer/fit.py)
STEP_DIR = re.compile(r"^global_step_(\d+)$")
STAGING_PREFIX = ".tmp_global_step_"
ABANDONED = "abandoned"  # checkpoints of a branch left by a rollback, set aside under it
RESUMES = "resumes.jsonl"  # every explicit checkpoint.resume applied, with the Slurm job that applied it


class CheckpointError(InputError, RuntimeError):
    """A checkpoint that cannot be loaded (exit 2: another checkpoint is the fix); the message
    says which file and why."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written (disk full, quota, I/O error). The partial folder is
    gone and the previous checkpoint is still ``latest``; the message names the path and the cause."""


def saved_mode(state: dict) -> str:
    """The ``trainer.mode`` of the run that wrote a trainer state (told by what it holds when
    the state predates the ``mode`` entry)."""
    if "mode" in state:
        return state["mode"]
    return "stream" if "stream_untrained" in state else "async" if "data_plane" in state else "sync"


def refuse_mode_change(state: dict, mode: str, path: Path) -> None:
    """Each trainer keeps what it holds in flight in its own form (the stream's untrained rows,
    the sync carry-over): a checkpoint resumes in its own mode only. A checkpoint of the retired
    async trainer (its data plane) resumes in none."""
    if saved_mode(state) == "async":
        raise CheckpointError(
            f"{path}: written by a trainer.mode=async run; that trainer was replaced by trainer.mode=stream "
            f"(docs/architecture.md), which cannot continue its data plane: start the run in another "
            f"trainer.output_dir, or from its weights: `nemo-dapo export {path} OUT`, then model.path=OUT"
        )
    if saved_mode(state) != mode:
        raise CheckpointError(
            f"{path}: written by a trainer.mode={saved_mode(state)} run, which this trainer.mode={mode} run "
            f"cannot continue (the prompts it holds in flight are kept in that mode's form). Resume it with "
            f"trainer.mode={saved_mode(state)}, or start the {mode} run in another trainer.output_dir"
        )


# (folder, file names relative to it) -> {name: digest}
Hasher = Callable[[Path, Sequence[str]], dict[str, str]]


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def write_manifest(folder: Path, hasher: Hasher = digest_files) -> None:
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    digests = hasher(folder, names)
    files = {name: {"bytes": (folder / name).stat().st_size, "digest": digests[name]} for name in names}
    (folder / MANIFEST).write_text(json.dumps({"algorithm": ALGORITHM, "files": files}, indent=1))


def verify(folder: str | Path, hasher: Hasher = digest_files, only: Sequence[str] | None = None) -> Path:
    """Raise :class:`CheckpointError` unless the folder holds exactly the manifest's files (plain
    files inside it), each intact: sizes first (cheap), then the digests, all files in one
    ``hasher`` call. ``only``: digests of just these files of the manifest (the ones a caller is
    about to read; one not listed is missing)."""
    folder = Path(folder)
    manifest = folder / MANIFEST
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such folder; give a checkpoint folder (checkpoints/global_step_N)")
    if not manifest.is_file():
        raise CheckpointError(
            f"{folder}: no {MANIFEST}: not a checkpoint, or one never completed (crash during save?); give a "
            "checkpoint folder (checkpoints/global_step_N)"
        )
    try:
        record = json.loads(manifest.read_text())
        files = record["files"]
    except (ValueError, KeyError) as err:
        raise CheckpointError(f"{manifest}: unreadable manifest ({err})") from None
    _check_contents(folder, files)
    if only is not None:
        unlisted = sorted(set(only) - set(files))
        if unlisted:
            raise CheckpointError(f"{folder}: file {unlisted[0]} is not in the manifest")
        files = {name: files[name] for name in only}
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{folder}: file {name} listed in the manifest is missing")
        if path.stat().st_size != expected["bytes"]:
            raise CheckpointError(f"{folder}: file {name} is damaged (its size differs from the manifest)")
    if record.get("algorithm", "sha256") == ALGORITHM:
        found = hasher(folder, list(files))
    else:  # a manifest of sha256 digests, written before BLAKE3
        found = {name: legacy_sha256(folder / name) for name in files}
    for name, expected in files.items():
        if found[name] != expected.get("digest", expected.get("sha256")):
            raise CheckpointError(f"{folder}: file {name} is damaged (its checksum differs from the manifest)")
    return folder


def _check_contents(folder: Path, files: dict) -> None:
    """The folder holds the manifest's files and nothing else: no name leaving the folder, no
    file the manifest does not list (placed after the seal), no link (which a loader or an
    export would follow out of the checkpoint)."""
    for name in files:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"{folder}: the manifest names {name}, outside the checkpoint folder")
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            what = "a link" if path.is_symlink() else "not a file (a FIFO, a device, a socket)"
            raise CheckpointError(f"{folder}: {name} is {what}; a checkpoint holds plain files only")
        if path.is_file() and name not in files and name != MANIFEST:
            raise CheckpointError(f"{folder}: file {name} is not in the manifest (added after it was sealed)")


class CheckpointManager:
    """The ``global_step_<N>`` folders under one root: writes each atomically (staged, sealed with
    a manifest, renamed, then ``latest``), finds the newest complete one to resume from (a damaged
    one is skipped and said so), keeps the last ``keep_last``, and sets a rolled-back branch aside."""

    def __init__(self, root: str | Path, keep_last: int = 2, hasher: Hasher = digest_files) -> None:
        self.root = Path(root)
        self.keep_last = keep_last
        self.hasher = hasher

    def step_folders(self) -> list[tuple[int, Path]]:
        """Completed-by-name checkpoint folders, newest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
        return sorted(found, reverse=True)

    def save(self, step: int, write: Callable[[Path], None]) -> Path:
        """``write(folder)`` fills a temporary folder; it becomes ``global_step_<step>`` atomically."""
        return self.commit(self.stage(step, write))

    def stage(self, step: int, write: Callable[[Path], None]) -> Path:
        """The temporary folder of step ``step``, filled by ``write``; invisible until :meth:`commit`
        (files written in the background may still be arriving in it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self.root / f"{STAGING_PREFIX}{step}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        try:
            write(staging)
        except Exception as err:  # torch.save reports a full disk as a RuntimeError, safetensors as its own
            self._abandon(staging, err)
        return staging

    def commit(self, staging: Path) -> Path:
        """Seal a complete staged checkpoint (manifest, fsync), rename it into place, then point
        ``latest`` at it and prune the oldest."""
        final = self.root / f"global_step_{staging.name.removeprefix(STAGING_PREFIX)}"
        try:
            write_manifest(staging, self.hasher)
            _fsync_tree(staging)
        except OSError as err:  # a background write may only fail here, when its files are sealed
            self._abandon(staging, err)
        if final.exists():  # a checkpoint of the same step from an interrupted earlier run
            shutil.rmtree(final)
        os.replace(staging, final)
        self._point_latest_at(final)
        self._prune()
        return final

    def _abandon(self, staging: Path, error: Exception) -> None:
        """Remove a partly written checkpoint and say what is left to resume from."""
        shutil.rmtree(staging, ignore_errors=True)
        latest = self.root / "latest"
        previous = (
            f"the previous checkpoint {self.root / latest.read_text().strip()} is intact and still `latest`"
            if latest.is_file()
            else "there is no earlier checkpoint"
        )
        raise CheckpointWriteError(
            f"checkpoint of step {staging.name.removeprefix(STAGING_PREFIX)} could not be written to {staging}: "
            f"{error}; the partial folder was removed and {previous}. Free space (or fix the file system), then "
            f"run again with checkpoint.resume=auto"
        ) from error

    def _prune(self) -> None:
        for _, path in self.step_folders()[self.keep_last :]:
            shutil.rmtree(path, ignore_errors=True)
        for path in self.root.glob(f"{STAGING_PREFIX}*"):
            shutil.rmtree(path, ignore_errors=True)

    def resolve_resume(self, resume: str) -> Path | None:
        """The checkpoint to resume from, or None to start fresh.

        ``auto``: the newest intact checkpoint; a damaged newer one is reported and skipped.
        ``disable``: none. A path: exactly that checkpoint, which must be intact; an older one of
        this run is a rollback (see :meth:`_roll_back_to`). Within one Slurm job a path is applied
        once: its requeued runs, which get the same arguments, resume from the newest checkpoint
        (the rolled-back branch), unless there is none yet.
        """
        if resume == "disable":
            return None
        if resume != "auto":
            newest = self._newest_intact() if self.applied_in_this_job(resume) else None
            if newest is not None:
                log.warning(
                    "checkpoint.resume=%s was applied by an earlier run of Slurm job %s: resuming from the newest "
                    "checkpoint, %s (a requeue continues the rollback, it does not repeat it)",
                    resume,
                    os.environ["SLURM_JOB_ID"],
                    newest.name,
                )
                return newest
            path = self._roll_back_to(verify(resume, self.hasher))
            self._record_resume(resume)
            return path
        return self._newest_intact()

    def refuse_missing_resume(self, resume: str) -> None:
        """An explicit ``checkpoint.resume`` that is not a checkpoint folder (none there, or no
        manifest) is refused at start-up, before Ray, naming it (its files are verified at the
        load). A path an earlier run of this Slurm job applied is not looked at: that run's requeue
        resumes from the newest checkpoint, whatever became of the path."""
        if resume in ("auto", "disable") or self.applied_in_this_job(resume):
            return
        try:
            verify(resume, self.hasher, only=[])
        except CheckpointError as err:
            raise CheckpointError(f"checkpoint.resume: {err}; or resume=auto / disable") from None

    def _newest_intact(self) -> Path | None:
        for step, path in self.step_folders():
            try:
                return verify(path, self.hasher)
            except CheckpointError as err:
                log.warning("skipping checkpoint of step %d: %s", step, err)
        return None

    def applied_in_this_job(self, resume: str) -> bool:
        """Whether a run of this Slurm job (a requeue keeps the submission's arguments, and its
        job id) already resumed from ``resume``."""
        job, record = os.environ.get("SLURM_JOB_ID"), self.root / RESUMES
        if not job or not record.is_file():
            return False
        target = str(Path(resume).resolve())
        for line in record.read_text().splitlines():
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                entry = json.loads(line)
                if entry.get("job") == job and entry.get("resume") == target:
                    return True
        return False

    def _record_resume(self, resume: str) -> None:
        entry = {"resume": str(Path(resume).resolve()), "job": os.environ.get("SLURM_JOB_ID"), "time": time.time()}
        self.root.mkdir(parents=True, exist_ok=True)
        with open_run_file(self.root / RESUMES) as record:
            record.write(json.dumps(entry) + "\n")

    def _roll_back_to(self, path: Path) -> Path:
        """Resuming from an older checkpoint of this run starts a new branch: the later
        checkpoints are set aside (moved under ``abandoned/``, never deleted) and ``latest``
        points at ``path``, so retention and ``resume=auto`` see the new branch only and a crash
        after the rollback does not continue the abandoned one."""
        match = STEP_DIR.match(path.name)
        if match is None or path.resolve().parent != self.root.resolve():
            return path
        later = [folder for step, folder in self.step_folders() if step > int(match.group(1))]
        if later:
            aside = self._new_aside(path.name)
            for folder in later:
                os.replace(folder, aside / folder.name)
            log.warning(
                "rolled back to %s: the later checkpoints (%s) are set aside in %s, out of resume and retention",
                path.name,
                ", ".join(folder.name for folder in reversed(later)),
                aside,
            )
        self._point_latest_at(path)
        return path

    def _new_aside(self, name: str) -> Path:
        """A new folder under ``abandoned/`` for the branch after ``name`` (two rollbacks within a
        second get two folders)."""
        stamp = f"after_{name}_{time.strftime('%Y%m%d-%H%M%S')}"
        (self.root / ABANDONED).mkdir(parents=True, exist_ok=True)
        for suffix in ("", *(f".{n}" for n in range(1, 1000))):
            with contextlib.suppress(FileExistsError):
                (self.root / ABANDONED / f"{stamp}{suffix}").mkdir()
                return self.root / ABANDONED / f"{stamp}{suffix}"
        raise CheckpointWriteError(f"{self.root / ABANDONED}: no free name for {stamp}")

    def _point_latest_at(self, folder: Path) -> None:
        replace_file(self.root / "latest", folder.name)
