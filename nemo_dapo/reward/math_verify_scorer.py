"""The ``math_verify`` scorer: symbolic answer equivalence under a hard time limit (docs/algorithm.md §10).

``math_verify`` decides that ``0.5``, ``1/2`` and ``\\frac{1}{2}`` are the same answer, which
the exact-match ``math_dapo`` scorer cannot. Sympy can also run for minutes (or forever) on a
pathological answer such as ``9^{9^{9^{9}}}``, and math_verify's own guard is ``signal.alarm``,
which only works on the main thread of the main interpreter; reward scoring runs in worker
threads and Ray actors. So the work runs in child processes with math_verify's timeouts off,
and the parent enforces the limit: a worker that overruns is killed and replaced, and the
sample scores -1 with ``timeout: True``.

Scores are +1 / -1 like ``math_dapo`` so the two scorers are interchangeable.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import signal
import threading
import time
import weakref
from collections import deque
from multiprocessing.connection import wait as wait_for_connections

from nemo_dapo.reward.math_dapo import ANSWER_WINDOW_CHARS, CORRECT_SCORE, INCORRECT_SCORE, extract_answer
from nemo_dapo.reward.validation import require_ground_truth, require_str

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0  # math_verify's own default per-call limit
DEFAULT_STARTUP_TIMEOUT_S = 120.0
# Fork would copy a parent that may hold CUDA contexts, Ray threads and locks; these don't.
SAFE_START_METHODS = ("spawn", "forkserver")
_READY = "ready"


# --------------------------------------------------------------------------- worker side


def _score_with_math_verify(solution_str: str, ground_truth: str) -> dict:
    """Parse both sides and test symbolic equivalence; no time limit (the parent owns it).

    The ``Answer:`` line (as ``math_dapo`` reads it) is wrapped in ``\\boxed{}`` because
    math_verify only parses bare LaTeX such as ``\\frac{1}{2}`` inside a delimiter. Without
    such a line, math_verify's own extraction (boxed answers, ``$...$``) runs on the same
    tail window ``math_dapo`` uses.
    """
    from math_verify import parse, verify

    answer = extract_answer(solution_str)
    pred_text = f"\\boxed{{{answer}}}" if answer is not None else solution_str[-ANSWER_WINDOW_CHARS:]
    gold = parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=None)
    pred = parse(pred_text, parsing_timeout=None)
    correct = bool(gold and pred and verify(gold, pred, timeout_seconds=None))
    return _result(correct, pred=str(pred[-1]) if pred else "")


def _result(correct: bool, pred: str = "", timeout: bool = False) -> dict:
    """The scorer's output record (same keys as ``math_dapo`` plus ``timeout``)."""
    score = CORRECT_SCORE if correct else INCORRECT_SCORE
    return {"score": score, "acc": correct, "pred": pred, "timeout": timeout}


def _worker_main(conn) -> None:
    """Serve ``(solution, ground_truth)`` requests until the pipe closes or ``None`` arrives."""
    # Ctrl-C goes to the whole process group; the parent handles it and stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # math_verify warns that its timeout is disabled: expected, the parent enforces one.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    _score_with_math_verify("Answer: 1", "1")  # load sympy/antlr lazily-imported parts now
    conn.send(_READY)
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        try:
            conn.send(_score_with_math_verify(*task))
        except Exception:  # an answer math_verify cannot handle is a wrong answer
            logger.exception("math_verify failed on a sample; scoring it as incorrect")
            conn.send(_result(False))


# --------------------------------------------------------------------------- parent side


class _Worker:
    """One child process and the parent's end of its pipe."""

    def __init__(self, context) -> None:
        self._context = context
        self.process = None
        self.conn = None
        self.ready = False
        self.started_at = 0.0

    def start(self) -> None:
        """Launch the child; it reports ``_READY`` once its imports are warm."""
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        self.process = self._context.Process(
            target=_worker_main, args=(child_conn,), daemon=True, name="math-verify-worker"
        )
        self.process.start()
        child_conn.close()
        self.conn, self.ready, self.started_at = parent_conn, False, time.monotonic()

    def kill(self) -> None:
        """SIGKILL: it cannot be caught or deferred, so the time limit is hard."""
        self.process.kill()
        self.process.join()
        self.conn.close()

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self, grace_s: float = 2.0) -> None:
        """Ask the child to exit, and kill it if it does not within ``grace_s``."""
        with contextlib.suppress(OSError):  # already gone
            self.conn.send(None)
        self.process.join(grace_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


def _stop_workers(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.stop()


class MathVerifyPool:
    """Reusable pool of math_verify worker processes with a hard per-sample time limit.

    Start once, score many batches, then :meth:`close` (or use it as a context manager).
    Safe to call from any thread (calls are serialised) and from inside another process,
    except a *daemonic* multiprocessing child, which Python forbids to have children.
    """

    def __init__(
        self,
        num_workers: int = 4,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        start_method: str = "spawn",
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    ) -> None:
        _check_positive(num_workers, "num_workers")
        _check_positive(timeout_s, "timeout_s")
        _check_positive(startup_timeout_s, "startup_timeout_s")
        if start_method not in SAFE_START_METHODS:
            raise ValueError(f"start_method={start_method!r}: use one of {SAFE_START_METHODS}")
        if mp.current_process().daemon:
            raise RuntimeError(
                "MathVerifyPool cannot start inside a daemonic process (for example a "
                "multiprocessing.Pool worker): Python forbids it to have child processes"
            )
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self._lock = threading.Lock()
        self._closed = False
        self._workers = [_Worker(mp.get_context(start_method)) for _ in range(num_workers)]
        for worker in self._workers:
            worker.start()
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    @property
    def worker_pids(self) -> list[int]:
        """Current worker process ids (they change when a worker is killed and replaced)."""
        return [worker.process.pid for worker in self._workers]

    def score(self, solution_str: str, ground_truth: str, timeout_s: float | None = None) -> dict:
        """Score one response; see :meth:`score_batch`."""
        return self.score_batch([solution_str], [ground_truth], timeout_s)[0]

    def score_batch(self, solutions: list[str], ground_truths: list[str], timeout_s: float | None = None) -> list[dict]:
        """Score responses in parallel: one dict per sample with score, acc, pred, timeout.

        ``timeout_s`` (default: the pool's) bounds each sample's time on a worker, measured
        from when the sample is handed to it.
        """
        if len(solutions) != len(ground_truths):
            raise ValueError(f"solutions ({len(solutions)}) and ground_truths ({len(ground_truths)}) differ in length")
        for i, (solution, truth) in enumerate(zip(solutions, ground_truths, strict=True)):
            require_str(solution, f"solutions[{i}]")
            require_ground_truth(truth, f"ground_truths[{i}]")
        limit_s = self.timeout_s if timeout_s is None else timeout_s
        _check_positive(limit_s, "timeout_s")
        with self._lock:
            if self._closed:
                raise RuntimeError("MathVerifyPool is closed")
            return self._run(list(zip(solutions, ground_truths, strict=True)), limit_s)

    def close(self) -> None:
        """Stop the workers; idempotent."""
        with self._lock:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> MathVerifyPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- scheduling ------------------------------------------------------------------

    def _run(self, tasks: list[tuple[str, str]], limit_s: float) -> list[dict]:
        """Feed tasks to ready idle workers until every task has a result."""
        results: list[dict | None] = [None] * len(tasks)
        pending = deque(range(len(tasks)))
        busy: dict[_Worker, tuple[int, float]] = {}  # worker -> (task index, deadline)
        try:
            while pending or busy:
                self._dispatch(tasks, pending, busy, limit_s)
                self._wait_and_collect(busy, results)
        finally:
            for worker in busy:  # only on an exception: their late answers must not leak
                worker.restart()
        return results

    def _dispatch(self, tasks: list, pending: deque, busy: dict, limit_s: float) -> None:
        """Hand the next pending task to every ready, idle worker."""
        for worker in self._workers:
            if not (pending and worker.ready and worker not in busy):
                continue
            try:
                worker.conn.send(tasks[pending[0]])
            except OSError:  # it died while idle (e.g. the OOM killer): replace it, keep the task
                logger.warning("math_verify worker %d died while idle; restarting it", worker.process.pid)
                worker.restart()
                continue
            busy[worker] = (pending.popleft(), time.monotonic() + limit_s)

    def _wait_and_collect(self, busy: dict, results: list) -> None:
        """Wait for the next reply or deadline, then handle every worker that has news."""
        watched = [worker for worker in self._workers if worker in busy or not worker.ready]
        first_deadline = min(self._deadline(worker, busy) for worker in watched)
        wait_for_connections([w.conn for w in watched], timeout=max(0.0, first_deadline - time.monotonic()))
        for worker in watched:
            if worker.conn.poll():
                self._receive(worker, busy, results)
            elif time.monotonic() >= self._deadline(worker, busy):
                self._expire(worker, busy, results)

    def _deadline(self, worker: _Worker, busy: dict) -> float:
        if worker in busy:
            return busy[worker][1]
        return worker.started_at + self.startup_timeout_s

    def _receive(self, worker: _Worker, busy: dict, results: list) -> None:
        """Take a reply: the startup handshake, a result, or the news that the child died."""
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            self._handle_crash(worker, busy, results)
            return
        if worker in busy:
            index, _ = busy.pop(worker)
            results[index] = message
        elif message == _READY:
            worker.ready = True

    def _handle_crash(self, worker: _Worker, busy: dict, results: list) -> None:
        """A dead busy worker (segfault, OOM kill) costs one sample; a dead new one is fatal."""
        worker.process.join(timeout=1.0)  # reap it so the exit code is known
        exitcode = worker.process.exitcode
        if worker not in busy:
            raise RuntimeError(f"math_verify worker died while starting (exit code {exitcode})")
        index, _ = busy.pop(worker)
        logger.warning("math_verify worker died (exit code %s) on sample %d; restarting it", exitcode, index)
        results[index] = _result(False)
        worker.restart()

    def _expire(self, worker: _Worker, busy: dict, results: list) -> None:
        """Kill an overrunning worker, score its sample as a timeout and start a fresh one."""
        if worker not in busy:
            raise RuntimeError(f"math_verify worker did not start within startup_timeout_s={self.startup_timeout_s}")
        index, _ = busy.pop(worker)
        results[index] = _result(False, timeout=True)
        worker.restart()


def _check_positive(value: float, name: str) -> None:
    if not value > 0:
        raise ValueError(f"{name}={value!r}: must be > 0")


# --------------------------------------------------------------------------- one-off scoring

_shared_pool: MathVerifyPool | None = None
_shared_pool_lock = threading.Lock()


def _get_shared_pool() -> MathVerifyPool:
    """A one-worker pool started on first use, so single calls don't pay a process start each."""
    global _shared_pool
    with _shared_pool_lock:
        if _shared_pool is None:
            _shared_pool = MathVerifyPool(num_workers=1)  # its finalizer stops it at exit
        return _shared_pool


def compute_score(solution_str: str, ground_truth: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """Score one response: ``{"score": +1.0 | -1.0, "acc", "pred", "timeout"}``.

    Runs on a shared single-worker pool; use :class:`MathVerifyPool` directly to score batches
    in parallel.
    """
    require_str(solution_str, "solution_str")
    require_ground_truth(ground_truth, "ground_truth")
    return _get_shared_pool().score(solution_str, ground_truth, timeout_s=timeout_s)
