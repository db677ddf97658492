"""The one signing rule: every record that decides something is HMAC-signed with the job
token and bound to its job (run id) and its key, so a client without the token can
neither forge one nor replay one under another key, round or job.

``SignedStore`` is a ``CoordinationStore`` view that applies the rule to everything
written through it (``set``, ``compare_set``, ``heartbeat``) and checks everything read
(``get``, ``multi_get``, ``check``, ``wait``, ``compare_set``'s answer). A value that is
unsigned or signed for another key or job is *foreign*: it reads as absent, a
``compare_set`` expecting absence overwrites it, and a warning names its key (once per
key). Counters (``add``) cannot be signed, since the store adds to them; they are only
read where a forged count costs time, never a decision (``COUNTER``), and pass through.

A round's keys carry the round number (``r/<n>/assignment``), so binding a record to its
key binds it to its round too. With no token the view passes everything through.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

from elastic.core.interfaces.coordination import WAIT_TICK, CoordinationStore, Tick
from elastic.core.interfaces.rendezvous import RendezvousAuthError
from elastic.core.interfaces.store import StoreTimeoutError

log = logging.getLogger(__name__)

# Keys (relative to the job's prefix) that are counters: ``add`` writes them, so they
# hold plain decimal text and are passed through unchecked. Anything else is a record.
COUNTER = re.compile(
    r"rdzv/events|rdzv/r/\d+/count|rdzv/refused/count|agent/failures/count"
    r"|agent/exit_barrier/\d+|agent/preempt/\d+/saved|agent/regroup/\d+/(?:ready|replaced)"
    r"|agent/stall/\d+/(?:acks|progress|reporters|published|records/[^/]+)"
)

_MAGIC = b"#s1:"  # a signed value: _MAGIC + 64 hex digits + b":" + the value
_SIG_END = len(_MAGIC) + 64
FOREIGN_POLL = 0.05  # s between reads while a foreign value stands where a record is due
FOREIGN_WAIT = 10.0  # s ``get`` waits for a foreign value to be replaced


def mac(token: bytes, run_id: str, key: str, data: bytes) -> str:
    """The signature of ``data`` stored at ``key`` in job ``run_id`` (hex)."""
    message = b"elastic/1\n" + run_id.encode() + b"\n" + key.encode() + b"\n" + data
    return hmac.new(token, message, hashlib.sha256).hexdigest()


def seal(token: bytes | None, run_id: str, key: str, value: bytes) -> bytes:
    if token is None:
        return value
    return _MAGIC + mac(token, run_id, key, value).encode() + b":" + value


def unseal(token: bytes | None, run_id: str, key: str, raw: bytes) -> bytes | None:
    """The value ``raw`` carries if it is signed for ``key`` of this job; None if it is
    foreign. ``b""`` (absent) stays ``b""``."""
    if token is None or not raw:
        return raw
    if not raw.startswith(_MAGIC) or raw[_SIG_END : _SIG_END + 1] != b":":
        return None
    value = raw[_SIG_END + 1 :]
    sig = raw[len(_MAGIC) : _SIG_END].decode("ascii", "replace")
    return value if hmac.compare_digest(sig, mac(token, run_id, key, value)) else None


def parse_counter(raw: bytes) -> int | None:
    """A counter's value (``b""``: never added to, 0); None for anything that is not one."""
    raw = bytes(raw).strip()
    if not raw:
        return 0
    if not raw.lstrip(b"-").isdigit() or len(raw) > 20:
        return None
    return int(raw)


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


class _Warned:
    """Keys already warned about, shared by every view of one job (thread-safe)."""

    def __init__(self) -> None:
        self._keys: set[str] = set()
        self._lock = threading.Lock()

    def once(self, key: str) -> None:
        with self._lock:
            if key in self._keys:
                return
            self._keys.add(key)
        log.warning(
            "ignoring %s: it is not signed with this job's token (written by a client "
            "without the token, or copied from another key or job)",
            key,
        )


class SignedStore:
    """A ``CoordinationStore`` view that signs and checks records (see the module)."""

    def __init__(
        self,
        inner: CoordinationStore,
        token: bytes | None,
        run_id: str,
        rel: str = "",
        warned: _Warned | None = None,
    ) -> None:
        self.inner = inner
        self.token = token
        self.run_id = run_id
        self.prefix = inner.prefix
        self._rel = rel  # this view's prefix below the job's: keys are signed with it
        self._warned = warned or _Warned()

    @property
    def where(self) -> str:  # the inner view's: a c10d store may move
        return self.inner.where

    def sub(self, prefix: str) -> SignedStore:
        return SignedStore(
            self.inner.sub(prefix), self.token, self.run_id, self._rel + prefix, self._warned
        )

    def _seal(self, key: str, value: bytes | str) -> bytes:
        if COUNTER.fullmatch(self._rel + key):
            return _bytes(value)
        return seal(self.token, self.run_id, self._rel + key, _bytes(value))

    def _open(self, key: str, raw: bytes) -> bytes | None:
        if self.token is None and raw[: len(_MAGIC)] == _MAGIC:
            raise RendezvousAuthError(
                f"{self.prefix + key} is signed with a job token this node does not have; "
                "give every node the job's token (--rdzv-conf token_file=PATH, or "
                "ELASTIC_RDZV_TOKEN_FILE=PATH or ELASTIC_RDZV_TOKEN in the environment)"
            )
        if self.token is None or COUNTER.fullmatch(self._rel + key):
            return raw
        value = unseal(self.token, self.run_id, self._rel + key, bytes(raw))
        if value is None:
            self._warned.once(self.prefix + key)
        return value

    # -- reads ---------------------------------------------------------------------
    def read(self, keys: Sequence[str]) -> list[bytes | None]:
        """As ``multi_get``, but a foreign value is None rather than absent (``b""``):
        for readers to whom a vanished key means something (a heartbeat's lease)."""
        if not keys:
            return []
        raws = self.inner.multi_get(keys)
        return [self._open(k, raw) for k, raw in zip(keys, raws, strict=True)]

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [value or b"" for value in self.read(keys)]

    def check(self, keys: Sequence[str]) -> bool:
        if self.token is None:
            return self.inner.check(keys)
        return all(self.read(keys))

    def get(self, key: str) -> bytes:
        if self.token is None:
            raw = self.inner.get(key)
            self._open(key, raw)  # says so if the job's records are signed
            return raw
        deadline = time.monotonic() + FOREIGN_WAIT
        while True:
            value = self._open(key, self.inner.get(key))
            if value:
                return value
            if time.monotonic() >= deadline:
                raise StoreTimeoutError(f"{self.prefix + key}: no signed value in {FOREIGN_WAIT}s")
            time.sleep(FOREIGN_POLL)

    def wait(
        self, keys: Sequence[str], timeout: timedelta | None = None, tick: Tick | None = None
    ) -> None:
        started = time.monotonic()
        self.inner.wait(keys, timeout, tick)
        if self.token is None:
            return
        limit = FOREIGN_WAIT if timeout is None else timeout.total_seconds()
        # A foreign value made the wait return early: wait for the real one (whoever
        # writes it overwrites the foreign value, see ``compare_set``).
        ticked = time.monotonic()
        while not all(self.read(keys)):
            now = time.monotonic()
            if now - started >= limit:
                raise StoreTimeoutError(f"timed out waiting for signed values at {list(keys)}")
            if tick is not None and now - ticked >= WAIT_TICK:
                ticked = now
                tick()
            time.sleep(FOREIGN_POLL)

    # -- writes --------------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self.inner.set(key, self._seal(key, value))

    def heartbeat(self, key: str, value: bytes | str) -> None:
        self.inner.heartbeat(key, self._seal(key, value))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """As the store's, where a foreign value counts as absent: expecting absence
        replaces it; expecting a value finds it missing (``b""`` is returned)."""
        want, new = _bytes(expected), _bytes(desired)
        sealed_new = self._seal(key, new)
        sealed_want = self._seal(key, want) if want else b""
        for _ in range(16):
            held = bytes(self.inner.compare_set(key, sealed_want, sealed_new))
            if held == sealed_new:
                return new
            value = self._open(key, held)
            if value is not None:
                return value
            if want:
                return b""
            sealed_want = held  # replace the foreign value, unless it changed meanwhile
        raise StoreTimeoutError(f"{self.prefix + key}: kept being overwritten by foreign values")

    def add(self, key: str, amount: int) -> int:
        """The store's ``add``; with a token, a value that is no counter (anyone may write
        one, and the store would fail to add to it) counts as absent and is replaced, and
        ``add(key, 0)`` is a plain read."""
        if self.token is None:
            return self.inner.add(key, amount)
        (raw,) = self.inner.multi_get([key])
        count = parse_counter(raw)
        if count is None:
            # Reset it to 0, then add: two nodes doing this at once still count twice.
            self._warned.once(self.prefix + key)
            self.inner.compare_set(key, raw, "0")
        elif amount == 0:
            return count
        return self.inner.add(key, amount)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def peer_silence(self) -> float | None:
        return self.inner.peer_silence()

    def close(self) -> None:
        self.inner.close()


def read_values(store: CoordinationStore, keys: Sequence[str]) -> list[bytes | None]:
    """``SignedStore.read`` on any store: a plain one has no foreign values."""
    if isinstance(store, SignedStore):
        return store.read(keys)
    return list(store.multi_get(keys))


def wait_present(store: CoordinationStore, keys: Sequence[str], timeout: timedelta) -> None:
    """Until every key exists, signed or not: for a reader that skips foreign values
    itself rather than waiting for them to be replaced."""
    inner = store.inner if isinstance(store, SignedStore) else store
    inner.wait(keys, timeout)
