"""The ranks' rendezvous stores (the driver's for every group, each weight sender's) are torch
TCPStores: anyone who reaches the port can list, read and write their keys. What the ranks keep
there is sealed with their group's secret (nemo_dapo/sealed_store.py), which they receive only
inside the rendezvous URL: a client without it (a stranger on the node, or another group's rank)
finds no key it can name, reads nothing, and what it writes there is refused by the ranks.
Real stores, real gloo groups, the real Rendezvous / join_store / join_group / gloo_group paths."""

import re
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from nemo_dapo.network import Rendezvous, join_group, join_store
from nemo_dapo.sealed_store import SealedStore, TamperedStoreValue, new_secret
from nemo_dapo.transfer.gloo import GlooSender, gloo_group, register
from nemo_dapo.transfer.wire import receive_buckets

WHERE = b"10.1.2.3:29400"  # what a rank keeps in the store: where the others connect to it


def stranger(rendezvous: Rendezvous) -> dist.TCPStore:
    """A client of the same store that knows its address (anyone can find the port), not the URL."""
    host, _, port = rendezvous.address.rpartition(":")
    return dist.TCPStore(host.strip("[]"), int(port), None, False, timedelta(seconds=5))


def assert_nothing_readable(outsider: dist.TCPStore) -> None:
    """Every key the stranger lists (torch's store lists them to anyone) has an opaque name, and
    no value holds a rank's address: gloo keeps each as a binary sockaddr, where 127.0.0.1 is the
    bytes 7f 00 00 01."""
    listed = outsider.list_keys()
    assert len(listed) >= 2 and all(re.fullmatch("[0-9a-f]{64}", name) for name in listed), listed
    assert not any(b"\x7f\x00\x00\x01" in outsider.get(name) for name in listed)


def test_a_client_without_the_secret_can_neither_find_read_nor_set_a_ranks_key():
    rendezvous = Rendezvous()
    try:
        assert rendezvous.url.startswith("tcp://") and rendezvous.address in rendezvous.url
        rank = join_store(rendezvous.url, 1)
        rank.set("rank_0", WHERE)
        outsider = stranger(rendezvous)
        listed = outsider.list_keys()  # torch's store lists every key to anyone
        assert listed and not any("rank" in name for name in listed), listed
        assert not outsider.check(["rank_0"])
        assert not any(WHERE in outsider.get(name) for name in listed)
        # another group's rank (its own secret) finds nothing under the same name
        assert not SealedStore(stranger(rendezvous), new_secret()).check(["rank_0"])
        # a key the stranger sets in the clear is not the rank's
        outsider.set("rank_0", b"6.6.6.6:1")
        assert rank.get("rank_0") == WHERE
        # overwriting what it lists is refused when a rank reads it, never used
        for name in listed:
            outsider.set(name, b"6.6.6.6:1")
        with pytest.raises(
            TamperedStoreValue,
            match=r"the rendezvous store at 127\.0\.0\.1:\d+: a value there was not written by this group.s ranks",
        ):
            rank.get("rank_0")
    finally:
        rendezvous.close()


def test_a_sealed_value_moved_to_another_key_is_refused_and_compare_set_keeps_torchs_semantics():
    rendezvous = Rendezvous()
    try:
        rank = join_store(rendezvous.url, 1)
        rank.set("a", b"one")
        rank.set("b", b"two")
        outsider, seal = stranger(rendezvous), rank._seal
        outsider.set(seal.name("b"), outsider.get(seal.name("a")))  # (a stranger cannot compute names: worst case)
        with pytest.raises(TamperedStoreValue):
            rank.get("b")
        assert rank.compare_set("c", b"", b"new") == b"new"
        assert rank.compare_set("c", b"old", b"newer") == b"new"
        assert rank.compare_set("c", b"new", b"newer") == b"newer" and rank.get("c") == b"newer"
        assert rank.compare_set("missing", b"x", b"y") == b"x" and not rank.check(["missing"])
        assert rank.add("count", 2) == 2 and rank.clone().get("a") == b"one" and rank.num_keys() >= 4
        assert rank.delete_key("c") and not rank.check(["c"])
    finally:
        rendezvous.close()


def test_a_rendezvous_url_without_its_secret_is_refused():
    rendezvous = Rendezvous()
    try:
        with pytest.raises(ValueError, match=r"not tcp://<secret>@host:port") as refused:
            join_store(f"tcp://{rendezvous.address}", 1)
        assert rendezvous.url.split("@")[0] not in str(refused.value)
    finally:
        rendezvous.close()


def test_a_weight_senders_gloo_group_works_and_keeps_nothing_readable_in_its_store():
    """The weight-transfer path: a sender serves its store (GlooSender), an engine worker joins
    through gloo_group from the endpoint the sender hands over Ray, a bucket crosses; the store
    then holds gloo's addresses, none of them readable by a stranger, under no name it can tell."""
    register()
    sender = GlooSender()
    url = sender.endpoint()["rendezvous"]
    received: list = []

    def engine_worker() -> None:
        group = gloo_group(url, 1, 2, timeout_s=60)
        received.extend(name for bucket in receive_buckets(group) for name, _ in bucket)

    worker = threading.Thread(target=engine_worker, daemon=True)
    worker.start()
    try:
        sender.join(world_size=2, timeout_s=60)
        sender.send([[("w", torch.ones(3))]])
        worker.join(timeout=60)
        assert received == ["w"]
        assert_nothing_readable(stranger(sender._rendezvous))
    finally:
        sender.close()


def run_default_group_rank(rank: int, world_size: int, url: str) -> None:
    """join_group, then use the store again after a collection (a process group keeps only the
    C++ half of a Python store: the Python half must stay alive) through a new group."""
    import gc

    join_group(rank, world_size, url, backend="gloo")
    gc.collect()
    total = torch.ones(1)
    dist.all_reduce(total, group=dist.new_group([0, 1]))
    assert total.item() == 2
    dist.destroy_process_group()


def test_the_default_groups_ranks_meet_through_join_group_and_their_keys_stay_sealed():
    import torch.multiprocessing as mp

    rendezvous = Rendezvous()
    try:
        mp.start_processes(run_default_group_rank, args=(2, rendezvous.url), nprocs=2, start_method="spawn")
        assert_nothing_readable(stranger(rendezvous))
    finally:
        rendezvous.close()
