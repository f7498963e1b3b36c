"""A weight load between two steps waits for the batch vLLM's asynchronous scheduling has in
flight (nemo_dapo/rollout/vllm_stream.py, EngineStream._drain): every token carries the version
of the weights that drew it, under ``kv_after_update=keep``.

vLLM turns asynchronous scheduling off on CPUs, so the engine here is a stand-in for vLLM's
in-process LLMEngine (and, behind it, the EngineCore's batch queue and scheduler pause state:
the only parts of vLLM the drain touches); the real EngineStream runs it on its own stepping
thread. It models what vLLM does with a batch queue of two: a step launches a batch on the
weights loaded at that moment and returns the outputs of the batch launched before, each token
labelled with the weight version set when its output is processed (vLLM's EngineCore attaches
the version then); a held scheduler (PAUSED_ALL) launches nothing."""

import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

from vllm.v1.core.sched.interface import PauseState

from nemo_dapo.rollout.vllm_stream import EngineStream, StreamGroup


@dataclass
class Sample:
    budget: int
    drawn_by: list[int] = field(default_factory=list)  # the weights each token was computed with
    labels: list[int] = field(default_factory=list)  # the version each token was labelled with
    in_flight: int = 0


class Scheduler:
    def __init__(self) -> None:
        self.pause_state = PauseState.UNPAUSED

    def set_pause_state(self, state: PauseState) -> None:
        self.pause_state = state


class AsyncScheduledEngine:
    """Stands in for vLLM's LLMEngine with asynchronous scheduling (see the module doc)."""

    def __init__(self) -> None:
        self.weights = 0  # the version of the weights loaded now
        self.label = "0"  # vLLM's weight version, attached to outputs as they are processed
        self.samples: dict[str, Sample] = {}
        self.scheduler = Scheduler()
        core = SimpleNamespace(batch_queue=deque(), batch_queue_size=2, scheduler=self.scheduler)
        self.engine_core = SimpleNamespace(engine_core=core)
        self.steps = 0

    def set_weight_version(self, version: str) -> None:
        self.label = version

    def add_request(self, key, prompt, params) -> None:
        self.samples[key] = Sample(budget=params.max_tokens)

    def step(self) -> list:
        time.sleep(0.001)
        self.steps += 1
        queue = self.engine_core.engine_core.batch_queue
        if self.scheduler.pause_state == PauseState.UNPAUSED:
            batch = {key: self.weights for key, s in self.samples.items() if len(s.drawn_by) + s.in_flight < s.budget}
            for key in batch:
                self.samples[key].in_flight += 1
            queue.appendleft(batch)
            if len(queue) < 2:
                return []
        return self._process(queue.pop()) if queue else []

    def _process(self, batch: dict[str, int]) -> list:
        outputs = []
        for key, weights in batch.items():
            sample = self.samples[key]
            sample.in_flight -= 1
            sample.drawn_by.append(weights)
            sample.labels.append(int(self.label))
            finished = len(sample.drawn_by) == sample.budget
            token_ids = list(range(len(sample.drawn_by)))
            outputs.append(
                SimpleNamespace(request_id=key, finished=finished, outputs=[SimpleNamespace(token_ids=token_ids)])
            )
        return outputs


def test_a_weight_load_waits_for_the_batch_in_flight_so_each_token_carries_its_weights_version():
    engine = AsyncScheduledEngine()
    stream = EngineStream(engine, 0, max_inflight=4, kv_after_update="keep", to_generation=lambda group: group.output)
    try:
        stream.add([StreamGroup("g", [1, 2], SimpleNamespace(n=1, max_tokens=120))])
        while len(engine.samples.get("g", Sample(0)).drawn_by) < 5:
            time.sleep(0.002)
        assert engine.engine_core.engine_core.batch_queue  # a batch is in flight between two steps

        in_flight_at_load = []

        def load() -> None:
            in_flight_at_load.append(len(engine.engine_core.engine_core.batch_queue))
            engine.weights = 1

        stream.load_weights(load, version=1)
        assert engine.scheduler.pause_state == PauseState.UNPAUSED  # scheduling goes on after the load
        (finished,) = stream.take(wait_s=30, keys=["g"])
    finally:
        stream.stop()
    sample = engine.samples["g"]
    assert finished.key == "g" and len(sample.drawn_by) == 120
    assert 0 in sample.labels and 1 in sample.labels
    assert sample.labels == sample.drawn_by  # no token labelled with weights that did not draw it
    assert in_flight_at_load == [0]  # the weights changed with no batch running on them
