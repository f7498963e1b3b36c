"""A torch.distributed store that only the holders of one group's secret can read or write.

A TCPStore has no authentication: anyone who reaches its port can list its keys
(``list_keys``), read them and overwrite them, and the ranks keep there what they trust: each
rank's gloo address (a rank connects to the address it reads), NCCL's unique id (the key to its
bootstrap), barrier flags. A prefix alone hides nothing from ``list_keys``. So every key a rank
writes through :class:`SealedStore` is stored under an opaque name (an HMAC of the key), and
every value sealed: encrypted (SHAKE-256 keystream under a fresh 128-bit nonce) and then
authenticated (HMAC-SHA256 over the name, nonce and ciphertext), with keys derived from the
group's secret. A stranger sees opaque names and ciphertext; a value it writes, moves from
another key or replays from another group fails authentication, and the rank that reads it
raises naming the store instead of using it. What remains open is in docs/security.md:
counters (``add``) are plain integers, and a stranger can still delete keys or flood the store.

The secret (:func:`new_secret`) is made by the process that serves the store and reaches the
ranks inside the rendezvous URL, through Ray calls only: it is never logged.

Outside contract (``torch.distributed.Store``): see docs/architecture.md, "Outside contracts".
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import weakref
from datetime import timedelta

import torch.distributed as dist

SECRET_BYTES = 32
NONCE_BYTES = 16
TAG_BYTES = 32


def new_secret() -> str:
    """A fresh group secret, as hex (it travels inside a URL)."""
    return secrets.token_hex(SECRET_BYTES)


class TamperedStoreValue(RuntimeError):
    """A value in the store that this group's ranks did not write: a stranger's, or moved."""


class Seal:
    """The keyed functions of one secret: opaque key names, sealed and opened values."""

    def __init__(self, secret: str, where: str) -> None:
        self.where = where  # the store, as refusals name it
        master = bytes.fromhex(secret)
        if len(master) != SECRET_BYTES:
            raise ValueError(f"a rendezvous secret has {SECRET_BYTES} bytes, not {len(master)}")
        self._name_key, self._cipher_key, self._mac_key = (
            hmac.new(master, purpose, hashlib.sha256).digest() for purpose in (b"name", b"cipher", b"mac")
        )

    def name(self, key: str) -> str:
        """The name ``key`` is stored under: the same for every holder of the secret, opaque to others."""
        return hmac.new(self._name_key, key.encode(), hashlib.sha256).hexdigest()

    def _keystream_xor(self, nonce: bytes, data: bytes) -> bytes:
        stream = hashlib.shake_256(self._cipher_key + nonce).digest(len(data))
        return (int.from_bytes(data, "big") ^ int.from_bytes(stream, "big")).to_bytes(len(data), "big")

    def _tag(self, name: str, nonce: bytes, body: bytes) -> bytes:
        return hmac.new(self._mac_key, name.encode() + b"\0" + nonce + body, hashlib.sha256).digest()

    def seal(self, name: str, value: bytes) -> bytes:
        nonce = secrets.token_bytes(NONCE_BYTES)
        body = self._keystream_xor(nonce, value)
        return nonce + body + self._tag(name, nonce, body)

    def open(self, name: str, sealed: bytes) -> bytes:
        """The value sealed under ``name``; raises :class:`TamperedStoreValue` for anything else."""
        nonce, body, tag = sealed[:NONCE_BYTES], sealed[NONCE_BYTES:-TAG_BYTES], sealed[-TAG_BYTES:]
        if len(sealed) < NONCE_BYTES + TAG_BYTES or not hmac.compare_digest(tag, self._tag(name, nonce, body)):
            raise TamperedStoreValue(
                f"{self.where}: a value there was not written by this group's ranks (someone else who reached "
                "the store's port overwrote or planted it): refusing it; see docs/security.md, the rendezvous stores"
            )
        return self._keystream_xor(nonce, body)


class SealedStore(dist.Store):
    """``store`` (a TCPStore client) seen through :class:`Seal`, with every method torch's bridge
    for stores written in Python forwards (gloo's rendezvous uses set, get and wait; NCCL's
    also check and, for its flight-recorder flags, the others; ``add`` serves torch's barriers)."""

    def __init__(self, store: dist.TCPStore, secret: str) -> None:
        super().__init__()
        self._store, self._secret = store, secret
        self._seal = Seal(secret, where=f"the rendezvous store at {store.host}:{store.port}")

    def set(self, key: str, value: bytes | str) -> None:
        name = self._seal.name(key)
        self._store.set(name, self._seal.seal(name, _as_bytes(value)))

    def get(self, key: str) -> bytes:
        name = self._seal.name(key)
        return self._seal.open(name, self._store.get(name))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """torch's semantics over sealed values: ``desired`` is set where the value is ``expected``
        (or where there is none and ``expected`` is empty); returns the value now there (``expected``
        for a missing key). The swap compares the stored bytes: a concurrent writer's value stays."""
        name, expected = self._seal.name(key), _as_bytes(expected)
        current = self._store.get(name) if self._store.check([name]) else b""
        value = self._seal.open(name, current) if current else b""
        if value != expected:
            return value if current else expected
        return self._seal.open(name, self._store.compare_set(name, current, self._seal.seal(name, _as_bytes(desired))))

    def add(self, key: str, amount: int) -> int:
        return self._store.add(self._seal.name(key), amount)

    def check(self, keys: list[str]) -> bool:
        return self._store.check([self._seal.name(key) for key in keys])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        names = [self._seal.name(key) for key in keys]
        if timeout is None:
            self._store.wait(names)
        else:
            self._store.wait(names, timeout)

    def deleteKey(self, key: str) -> bool:  # noqa: N802 (the name torch's bridge calls)
        return self._store.delete_key(self._seal.name(key))

    def getNumKeys(self) -> int:  # noqa: N802 (the name torch's bridge calls)
        return self._store.num_keys()

    def clone(self) -> SealedStore:
        return SealedStore(self._store.clone(), self._secret)


_HELD: set[dist.Store] = set()  # the stores torch calls through a group that is alive


def held_while(owner, store: dist.Store):
    """``owner`` (a process group calling ``store``), once ``store`` lives as long as it does.
    torch keeps only the C++ half of a store written in Python: dropped by Python, the store's
    methods are gone and torch's next call fails ("Not implemented")."""
    _HELD.add(store)
    weakref.finalize(owner, _HELD.discard, store)
    return owner


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
