"""The gloo weight path between a sending rank and the workers of TP=2 engines, each party in a
thread of this process over real gloo groups on loopback: every worker takes every bucket from
the sender itself, at its own rank, and never sends a CPU tensor over its engine's own device
group (NCCL on GPUs, which refuses them; here a group with only a CUDA backend, which refuses them
the same way). A worker that fails mid-receive ends the round for every party within moments,
not at gloo's timeout. vLLM's engines and policy ranks run the same path in
tests/test_cluster_loopback.py and tests/test_engine_recovery.py; this isolates the transport."""

import tempfile
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from nemo_dapo.transfer import members

ENGINES, TP = 2, 2
TIMEOUT_S = 60.0  # gloo's timeout in these groups: a failure must end the round long before it


def cuda_only_group(path: str, rank: int, size: int) -> dist.ProcessGroup:
    """An engine's device group as on GPUs: a CPU tensor sent over it raises ("No backend type
    associated with device type cpu"), as NCCL's does."""
    store = dist.PrefixStore("engine", dist.FileStore(path, size))
    group = dist.ProcessGroup(store, rank, size)
    group._register_backend(
        torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, dist.ProcessGroupGloo(store, rank, size)
    )
    return group


class Recorder(torch.nn.Module):
    """Stands for the model: keeps what ``load_weights`` is given; ``fail_at``: the bucket (1-based)
    whose load raises, as an engine failing mid-receive."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.loaded: dict[str, torch.Tensor] = {}
        self.buckets, self.fail_at = 0, fail_at

    def load_weights(self, bucket) -> None:
        self.buckets += 1
        if self.buckets == self.fail_at:
            raise RuntimeError("injected: the engine fails while loading a bucket")
        self.loaded.update({name: tensor.clone() for name, tensor in bucket})


def buckets() -> list[list[tuple[str, torch.Tensor]]]:
    torch.manual_seed(0)
    return [
        [(f"layers.{i}.w", torch.randn(33, 7)), (f"layers.{i}.b", torch.randn(5).to(torch.bfloat16))] for i in range(6)
    ] + [[("embed", torch.randint(0, 9, (11, 3)))]]


def run_round(monkeypatch, fail_worker: tuple[int, int] | None = None) -> dict:
    """One round: the sender's buckets to every worker of ``ENGINES`` engines of ``TP`` workers;
    ``fail_worker``: (engine, worker) whose second bucket raises. Each party's outcome and seconds."""
    import vllm.distributed.parallel_state as parallel_state

    from nemo_dapo.transfer import gloo

    gloo.register()
    world = threading.local()  # the engine group each worker thread would see as vLLM's world group
    monkeypatch.setattr(parallel_state, "get_world_group", lambda: world.group)
    sender = gloo.GlooSender()
    endpoints = [sender.endpoint()]
    offsets, world_size = members.rank_offsets([TP] * ENGINES)
    stores = [tempfile.mktemp() for _ in range(ENGINES)]
    outcomes: dict = {}

    def worker(engine: int, rank: int) -> None:
        started = time.monotonic()
        group = cuda_only_group(stores[engine], rank, TP)
        world.group = SimpleNamespace(world_size=TP, rank_in_group=rank, device_group=group)
        parallel = SimpleNamespace(rank=rank, world_size=TP, data_parallel_index=0)
        model = Recorder(2 if fail_worker == (engine, rank) else None)
        receiver = gloo.GlooWeightTransferEngine(
            None, SimpleNamespace(parallel_config=parallel, model_config=None), "cpu", model
        )
        info = members.engine_init_info("gloo", endpoints, offsets[engine], world_size, TIMEOUT_S)
        try:
            receiver.init_transfer_engine(receiver.parse_init_info(info))
            receiver.update_weights(members.update_info("gloo", endpoints, 1))
            outcomes[engine, rank] = (model.loaded, time.monotonic() - started)
        except RuntimeError as error:
            outcomes[engine, rank] = (error, time.monotonic() - started)

    threads = [threading.Thread(target=worker, args=(e, w)) for e in range(ENGINES) for w in range(TP)]
    for thread in threads:
        thread.start()
    sender.join(world_size, TIMEOUT_S)
    started = time.monotonic()
    try:
        outcomes["sender"] = (sender.send(iter(buckets())), time.monotonic() - started)
    except RuntimeError as error:
        outcomes["sender"] = (error, time.monotonic() - started)
    for thread in threads:
        thread.join(TIMEOUT_S + 30)
    sender.close()
    return outcomes


def test_every_tp_worker_takes_the_buckets_at_its_own_rank_over_no_device_group(monkeypatch):
    assert members.rank_offsets([TP] * ENGINES) == ([1, 3], 5)
    outcomes = run_round(monkeypatch)
    expected = {name: tensor for bucket in buckets() for name, tensor in bucket}
    sent, _ = outcomes.pop("sender")
    assert sent == sum(-(-t.numel() * t.element_size() // 64) * 64 for t in expected.values())
    assert len(outcomes) == ENGINES * TP
    for loaded, _ in outcomes.values():  # a relay over the engine's device group raised here instead
        assert not isinstance(loaded, Exception), loaded
        assert loaded.keys() == expected.keys()
        assert all(torch.equal(loaded[name], tensor) for name, tensor in expected.items())


@pytest.mark.parametrize("fail_worker", [(1, 1), (0, 0)], ids=["last_worker", "first_worker"])
def test_a_worker_failing_mid_receive_ends_the_round_for_all_at_once(monkeypatch, fail_worker):
    """Engine 1's second worker (a leaf), or engine 0's first, raises at its second bucket: it drops
    its groups, the sender's broadcast fails and the sender leaves, so every worker fails within
    seconds, not at the groups' 60-second timeout."""
    outcomes = run_round(monkeypatch, fail_worker)
    assert len(outcomes) == ENGINES * TP + 1
    for party, (outcome, seconds) in outcomes.items():
        assert isinstance(outcome, RuntimeError), (party, outcome)
        assert seconds < 10, (party, seconds, outcome)
    assert "injected" in str(outcomes[fail_worker][0])


def test_auto_picks_nccl_only_where_it_can_work_and_the_cuda_paths_are_refused_elsewhere():
    """auto: gloo on CPUs, colocated and with pipeline stages; nccl for engines on GPUs of their own
    and one exporting rank. nccl where it cannot work and ipc anywhere fail at load (exit 2),
    naming the field."""
    from nemo_dapo.config.load import load_config
    from nemo_dapo.errors import ConfigError

    def path(preset: str, *overrides: str) -> str:
        return load_config(preset, list(overrides), placement=False).rollout.weight_transfer

    separate = ["trainer.colocate=false"]
    assert path("tiny_cpu") == path("dapo_qwen2.5_32b") == path("dapo_qwen2.5_32b", *separate) == "gloo"
    assert path("dapo_qwen2.5_32b", *separate, "actor.megatron.pipeline_model_parallel_size=1") == "nccl"
    assert path("dapo_qwen2.5_32b", "rollout.weight_transfer=object_store") == "object_store"
    refusals = {
        ("tiny_cpu", "rollout.weight_transfer=nccl"): "on CPUs use gloo",
        ("dapo_qwen2.5_32b", "rollout.weight_transfer=nccl"): "trainer.colocate=true",
        ("dapo_qwen2.5_32b", "rollout.weight_transfer=nccl", *separate): "2 pipeline stages export",
        ("dapo_qwen2.5_32b", "rollout.weight_transfer=ipc", *separate): "ipc backend needs every training rank",
        ("tiny_cpu", "rollout.weight_transfer=ipc"): "ipc backend needs every training rank",
    }
    for (preset, *overrides), message in refusals.items():
        with pytest.raises(ConfigError, match=rf"rollout\.weight_transfer='(nccl|ipc)': .*{message}"):
            load_config(preset, overrides, placement=False)


def test_nccl_engine_workers_join_the_sender_at_their_own_ranks_in_vllms_own_engine(monkeypatch):
    """What the driver tells each engine (members.engine_init_info), read by vLLM's own nccl engine
    as every worker builds it from weight_transfer_config (the NCCL rendezvous itself, which needs
    CUDA, is replaced by a recorder): two TP=4 engines' workers take ranks 1-8 of a group of 9 at
    the sender's address, with the sender's wire parameters; the round's update info is the
    sender's declaration. Not run on a GPU."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import nccl_common
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    from nemo_dapo.rollout.vllm_worker import weight_transfer_config
    from nemo_dapo.transfer.nccl import NCCLSender, declare

    joined = []
    monkeypatch.setattr(nccl_common, "stateless_init_process_group", lambda *args, **kwargs: joined.append(args))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    sender = NCCLSender(declare(buckets()), bucket_bytes=1 << 20)
    endpoints = [sender.endpoint()]
    offsets, world_size = members.rank_offsets([4, 4])
    config = WeightTransferConfig(**weight_transfer_config("nccl"))
    for offset in offsets:
        for rank in range(4):
            parallel = SimpleNamespace(rank=rank, world_size=4, data_parallel_index=0)
            vllm_config = SimpleNamespace(parallel_config=parallel, model_config=None)
            engine = WeightTransferEngineFactory.create_engine(config, vllm_config, "cpu", Recorder())
            engine.init_transfer_engine(
                engine.parse_init_info(members.engine_init_info("nccl", endpoints, offset, world_size, 60))
            )
            assert (engine.packed, engine.packed_buffer_size_bytes, engine.packed_num_buffers) == (True, 1 << 20, 2)
    assert isinstance(engine, NCCLWeightTransferEngine) and weight_transfer_config("object_store") is None
    assert sorted(rank for _, _, rank, _ in joined) == list(range(1, 9))
    assert {(host, port, size) for host, port, _, size in joined} == {(sender.address, sender.port, 9)}
    update = engine.parse_update_info(members.update_info("nccl", endpoints, version=3))
    expected = [(name, tensor) for bucket in buckets() for name, tensor in bucket]
    assert update.names == [name for name, _ in expected]
    assert update.dtype_names == [str(t.dtype).removeprefix("torch.") for _, t in expected]
    assert update.shapes == [list(t.shape) for _, t in expected]
    with pytest.raises(RuntimeError, match="2 exporting ranks"):
        members.engine_init_info("nccl", endpoints * 2, 1, world_size, 60)


def test_each_nccl_round_iterates_its_export_as_vllm_checks_it_against_the_declaration():
    """vLLM's nccl trainer engine checks every tensor of a round against the declaration the
    workers sized their buffers from: our source passes it, and an export that drifted fails
    naming the tensor instead of corrupting the transfer."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    from nemo_dapo.transfer.nccl import ExportSource, declare

    source = ExportSource(declare(buckets()))
    source.take(buckets())
    sent = list(NCCLTrainerWeightTransferEngine._checked_iter(source, source.metadata()))
    assert [name for name, _ in sent] == [meta.name for meta in source.metadata()]
    with pytest.raises(RuntimeError, match="no export this round"):
        list(source)
    drifted = buckets()
    drifted[2][0] = ("layers.2.w", torch.randn(33, 8))
    source.take(drifted)
    with pytest.raises(ValueError, match="'layers.2.w'"):
        list(NCCLTrainerWeightTransferEngine._checked_iter(source, source.metadata()))
