"""The data plane of the asynchronous trainer: a key-value store of rollout fields with tags.

Names follow the KV vocabulary of the ``transferqueue`` package (``kv_batch_put``,
``kv_batch_get``, ``kv_list``, ``kv_clear``, a metadata handle with keys, tags, partition),
so that package can become a backend later. Unlike transferqueue 0.1.11 (measured), this
store never answers silently wrong: a missing key or field, or a field whose dtype changes,
is an error; a dead store raises promptly instead of hanging.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


class DataPlaneError(RuntimeError):
    """The store refused a request (bad key, field, dtype) or is unreachable."""


@dataclass
class KVMeta:
    """What ``kv_list`` returns: the matching keys, in insertion order, with their tags."""

    partition: str
    keys: list[str] = field(default_factory=list)
    tags: list[dict] = field(default_factory=list)


def _dtype_of(value: Any) -> str:
    return str(value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__


class KVStore:
    """The store itself: plain Python, run inside a Ray actor (or in-process in tests)."""

    def __init__(self) -> None:
        self._rows: dict[str, dict[str, dict[str, Any]]] = {}  # partition -> key -> field -> value
        self._tags: dict[str, dict[str, dict]] = {}  # partition -> key -> tags
        self._dtypes: dict[str, dict[str, str]] = {}  # partition -> field -> dtype name

    def ping(self) -> bool:
        return True

    def kv_batch_put(
        self,
        keys: Sequence[str],
        fields: dict[str, Sequence],
        tags: Sequence[dict] | None = None,
        partition: str = "default",
    ) -> int:
        """Write ``fields[name][i]`` under ``keys[i]``; existing keys gain/overwrite those fields."""
        tags = list(tags) if tags is not None else [{} for _ in keys]
        sizes = {name: len(values) for name, values in fields.items()} | {"tags": len(tags)}
        if any(size != len(keys) for size in sizes.values()):
            raise DataPlaneError(f"kv_batch_put: {len(keys)} keys but field lengths {sizes}")
        rows, known = self._rows.setdefault(partition, {}), self._dtypes.setdefault(partition, {})
        for name, values in fields.items():
            for value in values:
                dtype = _dtype_of(value)
                if known.setdefault(name, dtype) != dtype:
                    raise DataPlaneError(
                        f"kv_batch_put: field {name!r} in partition {partition!r} holds "
                        f"{known[name]}, refusing {dtype} (no silent casts)"
                    )
        partition_tags = self._tags.setdefault(partition, {})
        for i, key in enumerate(keys):
            rows.setdefault(key, {}).update({name: values[i] for name, values in fields.items()})
            partition_tags.setdefault(key, {}).update(tags[i])
        return len(keys)

    def kv_batch_get(self, keys: Sequence[str], fields: Sequence[str], partition: str = "default") -> dict[str, list]:
        """Values of ``fields`` for ``keys``, in the order asked; any gap is an error."""
        rows = self._rows.get(partition, {})
        missing = [k for k in keys if k not in rows]
        if missing:
            raise DataPlaneError(f"kv_batch_get: {len(missing)} keys not in partition {partition!r}: {missing[:5]}")
        out: dict[str, list] = {}
        for name in fields:
            lacking = [k for k in keys if name not in rows[k]]
            if lacking:
                raise DataPlaneError(f"kv_batch_get: field {name!r} missing for keys {lacking[:5]}")
            out[name] = [rows[k][name] for k in keys]
        return out

    def kv_list(self, partition: str = "default", tag_filter: dict | None = None) -> KVMeta:
        """Keys whose tags match every ``tag_filter`` item (a list value means 'any of')."""
        meta = KVMeta(partition)
        wanted = {k: frozenset(v) if isinstance(v, (list, tuple, set)) else v for k, v in (tag_filter or {}).items()}
        for key, tags in self._tags.get(partition, {}).items():
            if all(tags.get(k) in v if isinstance(v, frozenset) else tags.get(k) == v for k, v in wanted.items()):
                meta.keys.append(key)
                meta.tags.append(dict(tags))
        return meta

    def kv_update_tags(self, keys: Sequence[str], tags: dict, partition: str = "default") -> int:
        partition_tags = self._tags.get(partition, {})
        missing = [k for k in keys if k not in partition_tags]
        if missing:
            raise DataPlaneError(f"kv_update_tags: keys not in partition {partition!r}: {missing[:5]}")
        for key in keys:
            partition_tags[key].update(tags)
        return len(keys)

    def kv_clear(self, keys: Sequence[str], partition: str = "default") -> int:
        """Delete keys (their fields and tags); unknown keys are an error."""
        rows = self._rows.get(partition, {})
        missing = [k for k in keys if k not in rows]
        if missing:
            raise DataPlaneError(f"kv_clear: keys not in partition {partition!r}: {missing[:5]}")
        for key in keys:
            del rows[key]
            del self._tags[partition][key]
        return len(keys)

    def snapshot(self) -> dict:
        return copy.deepcopy({"rows": self._rows, "tags": self._tags, "dtypes": self._dtypes})

    def restore(self, state: dict) -> None:
        self._rows, self._tags, self._dtypes = (copy.deepcopy(state[k]) for k in ("rows", "tags", "dtypes"))


class DataPlane:
    """Client of a :class:`KVStore` living in a Ray actor; every call has a deadline."""

    def __init__(self, timeout_s: float = 60.0, actor=None) -> None:
        import ray

        self._ray = ray
        self.timeout_s = timeout_s
        self.actor = actor or ray.remote(num_cpus=0)(KVStore).remote()
        self._call("ping")

    def _call(self, method: str, *args, **kwargs):
        ray = self._ray
        try:
            return ray.get(getattr(self.actor, method).remote(*args, **kwargs), timeout=self.timeout_s)
        except ray.exceptions.RayActorError as err:
            raise DataPlaneError(f"data plane store is dead ({method}): {err}") from None
        except ray.exceptions.GetTimeoutError:
            raise DataPlaneError(f"data plane store did not answer {method} within {self.timeout_s} s") from None
        except ray.exceptions.RayTaskError as err:
            cause = err.as_instanceof_cause()
            raise (cause if isinstance(cause, DataPlaneError) else DataPlaneError(str(err))) from None

    def __getattr__(self, method: str):
        if method.startswith(("kv_", "snapshot", "restore")):
            return lambda *args, **kwargs: self._call(method, *args, **kwargs)
        raise AttributeError(method)
