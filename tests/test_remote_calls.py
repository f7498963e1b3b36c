"""The driver never hangs on a worker group: a silent worker times out and a dead one fails at
once, both naming the group, the call, the ranks and where their logs are. (The local Ray is
shared: every module shuts its groups down, so none holds the CPUs these workers need.)"""

import psutil
import pytest

pytestmark = pytest.mark.quiet  # 3-second call deadlines


def test_a_silent_or_dead_worker_fails_the_call_naming_group_call_and_rank(local_ray):
    from nemo_dapo.cluster.worker_group import GroupSpec, WorkerGroup
    from nemo_dapo.errors import RemoteCallError
    from tests.flaky_worker import Napper

    def store_ports() -> set[int]:
        """The ports this process listens on: the groups' rendezvous (TCPStores it serves)."""
        return {c.laddr.port for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}

    before = store_ports()
    stuck, crashed = (
        WorkerGroup(Napper, GroupSpec(name, 2, num_cpus_per_worker=0.5, call_timeout_s=3))
        for name in ("stuck", "crashed")
    )
    try:
        assert stuck.call_all(Napper.nap, 0.1) == [0, 1]
        served = {int(group._rendezvous.address.rsplit(":", 1)[1]) for group in (stuck, crashed)}
        assert served <= store_ports() - before and all(
            group._rendezvous.address.startswith("127.0.0.1:") for group in (stuck, crashed)
        )
        with pytest.raises(
            RemoteCallError,
            match=r"stuck\.nap: rank\(s\) \[1\] gave no answer within 3 s "
            r"\(trainer\.remote_timeout_s\); their logs: /\S+/logs",
        ):
            stuck.call_all(Napper.nap, 60)
        with pytest.raises(RemoteCallError, match=r"crashed\.die: a worker died \(\w+"):
            crashed.call_all(Napper.die)
    finally:
        stuck.shutdown()
        crashed.shutdown()
    # the groups' rendezvous stop listening with them
    assert store_ports() == before
