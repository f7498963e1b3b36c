"""Data plane: tags, filters, deletes, partitions, strict errors, snapshot/restore, dead store, recovery."""

import time

import pytest
import torch

from nemo_dapo.trainer.data_plane import DataPlane, DataPlaneError, KVStore
from nemo_dapo.trainer.prompt_queue import PromptQueue

pytestmark = pytest.mark.quiet  # a dead store noticed within a deadline


@pytest.fixture
def store():
    kv = KVStore()
    kv.kv_batch_put(
        ["a", "b", "c"],
        {"x": [torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([3.0])], "name": ["A", "B", "C"]},
        [{"status": "pending"}, {"status": "done"}, {"status": "running"}],
        partition="p",
    )
    return kv


def test_get_returns_rows_in_the_order_asked(store):
    got = store.kv_batch_get(["c", "a"], ["name", "x"], partition="p")
    assert got["name"] == ["C", "A"] and [t.item() for t in got["x"]] == [3.0, 1.0]


def test_missing_key_or_field_is_an_error_not_a_shorter_answer(store):
    with pytest.raises(DataPlaneError, match="keys not in partition 'p'.*zz"):
        store.kv_batch_get(["a", "zz"], ["x"], partition="p")
    store.kv_batch_put(["d"], {"name": ["D"]}, partition="p")
    with pytest.raises(DataPlaneError, match="field 'x' missing for keys \\['d'\\]"):
        store.kv_batch_get(["a", "d"], ["x"], partition="p")
    with pytest.raises(DataPlaneError, match="keys not in partition 'other'"):
        store.kv_batch_get(["a"], ["x"], partition="other")  # partitions are separate


def test_dtype_change_is_refused(store):
    with pytest.raises(DataPlaneError, match="holds torch.float32, refusing torch.int64"):
        store.kv_batch_put(["e"], {"x": [torch.tensor([1])]}, partition="p")
    with pytest.raises(DataPlaneError, match="field lengths"):
        store.kv_batch_put(["e", "f"], {"x": [torch.tensor([1.0])]}, partition="p")


def test_list_by_tags_update_and_delete(store):
    assert store.kv_list("p", {"status": ["pending", "running"]}).keys == ["a", "c"]
    store.kv_update_tags(["a"], {"status": "done", "global_steps": 3}, partition="p")
    meta = store.kv_list("p", {"status": "done"})
    assert meta.keys == ["a", "b"] and meta.tags[0] == {"status": "done", "global_steps": 3}
    assert store.kv_clear(["b"], partition="p") == 1
    assert store.kv_list("p").keys == ["a", "c"]
    with pytest.raises(DataPlaneError):
        store.kv_clear(["b"], partition="p")
    with pytest.raises(DataPlaneError):
        store.kv_update_tags(["nope"], {"status": "x"}, partition="p")


def test_snapshot_restore_round_trip(store):
    snap = store.snapshot()
    store.kv_clear(["a", "b", "c"], partition="p")
    store.kv_batch_put(["z"], {"x": [torch.tensor([9.0])]}, partition="p")
    store.restore(snap)
    assert store.kv_list("p").keys == ["a", "b", "c"]
    assert store.kv_batch_get(["b"], ["x"], partition="p")["x"][0].item() == 2.0
    snap["rows"]["p"]["a"]["name"] = "mutated"  # the snapshot is a copy, not a view
    assert store.kv_batch_get(["a"], ["name"], partition="p")["name"] == ["A"]


def test_reissue_deletes_partials_and_requeues_inflight_prompts():
    kv = KVStore()
    fields = {
        "prompt_ids": [[1], [2], [3]],
        "ground_truth": ["1", "2", "3"],
        "data_source": ["s"] * 3,
        "prompt_index": [0, 1, 2],
    }
    kv.kv_batch_put(
        ["q0", "q1", "q2"],
        fields,
        [
            {"is_prompt": True, "status": "running", "global_steps": 4, "attempt": 1},
            {"is_prompt": True, "status": "pending", "global_steps": 4, "attempt": 1},
            {"is_prompt": True, "status": "done", "global_steps": 4, "attempt": 1},
        ],
        partition="train",
    )
    kv.kv_batch_put(
        ["q0_0", "q2_0"],
        {"token_ids": [[5], [6]]},
        [{"is_prompt": False, "prompt_id": "q0"}, {"is_prompt": False, "prompt_id": "q2"}],
        partition="train",
    )
    assert PromptQueue(kv, rollout=None).reissue_inflight(global_step=7) == 2
    assert kv.kv_list("train", {"is_prompt": False}).keys == ["q2_0"]  # the partial q0_0 is gone, q2's stays
    requeued = kv.kv_list("train", {"is_prompt": True, "status": "pending"})
    assert sorted(requeued.keys) == ["q0", "q1"]
    assert all(t["global_steps"] == 7 and t["attempt"] == 2 for t in requeued.tags)
    assert kv.kv_batch_get(["q0"], ["ground_truth"], partition="train")["ground_truth"] == ["1"]


def test_ray_client_raises_promptly_when_the_store_dies(local_ray):
    plane = DataPlane(timeout_s=10)
    plane.kv_batch_put(["k"], {"v": [1]}, partition="p")
    with pytest.raises(DataPlaneError, match="keys not in partition"):  # the store's own error crosses Ray
        plane.kv_batch_get(["missing"], ["v"], partition="p")
    assert plane.kv_batch_get(["k"], ["v"], partition="p") == {"v": [1]}
    local_ray.kill(plane.actor)  # asynchronous: a call sent right after may still be answered
    started = time.time()
    with pytest.raises(DataPlaneError, match="dead"):
        while time.time() - started < 10:
            plane.kv_list("p")
            time.sleep(0.05)
    assert time.time() - started < 10
