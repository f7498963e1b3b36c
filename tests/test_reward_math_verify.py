"""The math_verify scorer: symbolic equivalence and the hard, parent-enforced time limit."""

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from nemo_dapo.reward.math_verify_scorer import MathVerifyPool, compute_score

pytestmark = pytest.mark.quiet  # scoring deadlines

# Sympy never finishes comparing this tower of powers with 1 (it runs for minutes).
PATHOLOGICAL = "Answer: 9^{9^{9^{9}}}"

EQUIVALENT = [
    ("Answer: 0.5", "1/2"),
    ("Answer: \\frac12", "0.5"),
    ("Answer: 1/2", "\\frac{1}{2}"),
    ("Answer: \\dfrac{1}{2}", "0.5"),
    ("Answer: 2\\sqrt{2}", "\\sqrt{8}"),
    ("Answer: \\pi/2", "\\frac{\\pi}{2}"),
    ("Answer: x^2+2x+1", "(x+1)^2"),
    ("Answer: $x = 3$", "3"),
    ("Answer: 1,000", "1000"),
    ("Answer: 90^\\circ", "90"),
    ("Answer: 5 inches", "5"),
    ("Answer: (1, 2)", "(1,2)"),
    ("The answer is therefore \\boxed{\\frac{1}{2}}.", "0.5"),  # no Answer: line
]
NOT_EQUIVALENT = [
    ("Answer: 3", "4"),
    ("Answer: -7", "7"),
    ("Answer: 0.51", "1/2"),
    ("No idea.", "42"),
    ("Answer: 42\n" + "Let me double check. " * 40, "42"),  # outside the 300-char window
]


@pytest.fixture(scope="module")
def pool():
    with MathVerifyPool(num_workers=2, timeout_s=10.0) as shared:
        yield shared


def _in_thread(fn):
    """Run ``fn`` on a non-main thread (where signal-based timeouts cannot work)."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(value=fn()))
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "scoring hung"
    return out["value"]


@pytest.mark.parametrize(("solution", "ground_truth"), EQUIVALENT)
def test_equivalent_answers_score_plus_one(pool, solution, ground_truth):
    result = pool.score(solution, ground_truth)
    assert result["score"] == 1.0 and result["acc"] is True and result["timeout"] is False
    assert result["pred"] != ""


@pytest.mark.parametrize(("solution", "ground_truth"), NOT_EQUIVALENT)
def test_different_answers_score_minus_one(pool, solution, ground_truth):
    result = pool.score(solution, ground_truth)
    assert result["score"] == -1.0 and result["acc"] is False and result["timeout"] is False


def test_pred_is_the_parsed_answer(pool):
    assert pool.score("Answer: 0.51", "1/2")["pred"] == "0.51"
    assert pool.score("No idea.", "42")["pred"] == ""


def test_batch_keeps_order(pool):
    cases = EQUIVALENT + NOT_EQUIVALENT
    results = pool.score_batch([s for s, _ in cases], [g for _, g in cases])
    assert [r["acc"] for r in results] == [True] * len(EQUIVALENT) + [False] * len(NOT_EQUIVALENT)
    assert pool.score_batch([], []) == []


def test_hard_timeout_from_a_thread_kills_only_the_stuck_worker(pool):
    pool.score_batch(["Answer: 1"] * 2, ["1"] * 2)  # workers warm, so only scoring is timed
    old_pids = set(pool.worker_pids)
    solutions = [PATHOLOGICAL, "Answer: 0.25", "Answer: \\frac{3}{4}"]
    started = time.monotonic()
    results = _in_thread(lambda: pool.score_batch(solutions, ["1", "1/4", "0.75"], timeout_s=1.0))
    elapsed = time.monotonic() - started
    assert results[0] == {"score": -1.0, "acc": False, "pred": "", "timeout": True}
    assert [r["acc"] for r in results[1:]] == [True, True]
    assert 1.0 <= elapsed < 20.0  # the limit, not the pathological answer (which never ends); loose for busy CI
    assert len(old_pids - set(pool.worker_pids)) == 1  # one worker replaced
    # The pool recovers: the replacement worker starts and scores correctly.
    after = _in_thread(lambda: pool.score_batch(["Answer: 0.5"] * 4, ["1/2"] * 4))
    assert all(r["acc"] and not r["timeout"] for r in after)


def test_tiny_timeout_fires_then_next_item_is_scored(pool):
    stuck = pool.score(PATHOLOGICAL, "1", timeout_s=1e-3)
    assert stuck["timeout"] is True and stuck["score"] == -1.0
    recovered = pool.score("Answer: 0.5", "1/2")
    assert recovered == {"score": 1.0, "acc": True, "pred": "\\frac{1}{2}", "timeout": False}


def test_dead_workers_are_replaced_and_close_stops_them():
    with MathVerifyPool(num_workers=1, timeout_s=60.0) as single:
        assert single.score("Answer: 1", "1")["acc"]  # worker is up
        busy_pid = single.worker_pids[0]
        killer = threading.Timer(0.5, os.kill, (busy_pid, signal.SIGKILL))
        killer.start()
        crashed = single.score(PATHOLOGICAL, "1")  # killed mid-task: one sample lost, no hang
        assert crashed == {"score": -1.0, "acc": False, "pred": "", "timeout": False}
        assert single.score("Answer: 2", "2")["acc"]
        idle_pid = single.worker_pids[0]
        assert idle_pid != busy_pid
        os.kill(idle_pid, signal.SIGKILL)  # dies while idle
        time.sleep(0.2)
        assert single.score("Answer: 3", "3")["acc"]
        last_pid = single.worker_pids[0]
        assert last_pid != idle_pid
    with pytest.raises(ProcessLookupError):
        os.kill(last_pid, 0)  # closed pools leave no workers behind
    with pytest.raises(RuntimeError, match="closed"):
        single.score("Answer: 1", "1")


def test_module_compute_score():
    assert compute_score("Answer: 0.5", "\\frac{1}{2}")["score"] == 1.0
    assert compute_score("Answer: 0.6", "\\frac{1}{2}")["score"] == -1.0


def _score_in_child(queue):
    queue.put(compute_score("Answer: \\frac{2}{4}", "0.5"))


def _start_pool_in_daemon(queue):
    try:
        MathVerifyPool(num_workers=1)
    except RuntimeError as error:
        queue.put(str(error))
    else:
        queue.put("started")


@pytest.mark.parametrize(
    ("target", "daemon", "expected"),
    [
        (_score_in_child, False, {"score": 1.0, "acc": True, "pred": "\\frac{2}{4}", "timeout": False}),
        (_start_pool_in_daemon, True, "MathVerifyPool cannot start inside a daemonic process"),
    ],
    ids=["inside_another_process", "daemonic_process_refused"],
)
def test_in_child_process(target, daemon, expected):
    context = mp.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=target, args=(queue,), daemon=daemon)
    child.start()
    value = queue.get(timeout=60)
    child.join(timeout=30)
    assert child.exitcode == 0
    if isinstance(expected, str):
        assert value.startswith(expected)
    else:
        assert value == expected


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_workers": 0}, "num_workers"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"start_method": "fork"}, "start_method"),
    ],
)
def test_invalid_pool_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MathVerifyPool(**kwargs)


@pytest.mark.parametrize(
    ("solutions", "truths", "timeout_s", "error", "match"),
    [
        (["Answer: 1"], [], None, ValueError, "differ in length"),
        (["Answer: 1", None], ["1", "2"], None, TypeError, r"solutions\[1\]"),
        (["Answer: 1"], [1], None, TypeError, r"ground_truths\[0\]"),
        (["Answer: 1"], [""], None, ValueError, r"ground_truths\[0\]"),
        (["Answer: 1"], ["1"], -1.0, ValueError, "timeout_s"),
    ],
)
def test_invalid_batch(pool, solutions, truths, timeout_s, error, match):
    with pytest.raises(error, match=match):
        pool.score_batch(solutions, truths, timeout_s=timeout_s)


def test_compute_score_names_bad_arguments():
    with pytest.raises(TypeError, match="solution_str"):
        compute_score(None, "1")
    with pytest.raises(TypeError, match="ground_truth"):
        compute_score("Answer: 1", 1)
