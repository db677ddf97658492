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
key binds it to its round too. A key replays no other key's value, but a client without
the token could still write back an *older* value of the same key (read earlier). For the
records that decide the job's fate (``DECIDING``) the signature also covers a version,
above the newest the writer knows of and no lower than its clock in ms; a reader never
goes back to a version older than the newest it has seen (nor to absent or foreign after
it), reads the newest instead and writes it back. What it cannot know is a newer value it
never read: a node that joins after the replay sees the replayed value until a node that
knew better reads it again; and a node that never read a record a stranger deleted
writes it again from absent (a newer version: the others follow it).
With no token the view passes everything through.

May import core's ``interfaces`` only (the bottom of the round).
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

# Keys (relative to the job's prefix) of the records whose value decides the job's fate
# (the restart budget, the failed flag, the closed flag, a round's lost list): each write
# carries a version above the newest its writer knows of, and a reader never goes back to
# an older version than one it has seen (a replay of an older signed value).
DECIDING = re.compile(r"agent/restart_budget|agent/failed|rdzv/closed|rdzv/r/\d+/lost")
# Keys (relative to the job's prefix) that are counters: ``add`` writes them, so they
# hold plain decimal text and are passed through unchecked. Anything else is a record.
COUNTER = re.compile(
    r"rdzv/events|rdzv/r/\d+/count|rdzv/refused/count|agent/failures/count"
    r"|agent/exit_barrier/\d+|agent/preempt/\d+/saved|agent/regroup/\d+/(?:ready|replaced)"
    r"|agent/stall/\d+/(?:acks|progress|reporters|published|records/[^/]+)"
)

# A signed value: _MAGIC + 64 hex digits + b":" + the value. A deciding record's (below):
# _VERSIONED + 64 hex digits + b":" + its version (decimal) + b":" + the value.
_MAGIC = b"#s1:"
_VERSIONED = b"#s2:"
_SIG_END = len(_MAGIC) + 64
_VERSION_DIGITS = 19  # a version fits an int64, as a store's counters do
FOREIGN_POLL = 0.05  # s between reads while a foreign value stands where a record is due
FOREIGN_WAIT = 10.0  # s ``get`` waits for a foreign value to be replaced


def mac(token: bytes, run_id: str, key: str, data: bytes, version: int | None = None) -> str:
    """The signature of ``data`` stored at ``key`` in job ``run_id`` (hex), and of its
    ``version`` for a deciding record."""
    if version is None:
        head = b"elastic/1\n" + run_id.encode() + b"\n" + key.encode() + b"\n"
    else:
        head = b"elastic/2\n" + run_id.encode() + b"\n" + key.encode() + f"\n{version}\n".encode()
    return hmac.new(token, head + data, hashlib.sha256).hexdigest()


def seal(
    token: bytes | None, run_id: str, key: str, value: bytes, version: int | None = None
) -> bytes:
    if token is None:
        return value
    sig = mac(token, run_id, key, value, version).encode()
    if version is None:
        return _MAGIC + sig + b":" + value
    return _VERSIONED + sig + b":" + str(version).encode() + b":" + value


def _signature_holds(sig: bytes, expected: str) -> bool:
    # As bytes: ``hmac.compare_digest`` refuses str with non-ASCII characters (a TypeError,
    # which a forged value must never raise), and bytes compare in constant time whatever
    # they hold.
    return hmac.compare_digest(sig, expected.encode())


def unseal(token: bytes | None, run_id: str, key: str, raw: bytes) -> bytes | None:
    """The value ``raw`` carries if it is signed for ``key`` of this job; None if it is
    foreign. ``b""`` (absent) stays ``b""``. Total: any bytes give one of the three."""
    if token is None or not raw:
        return raw
    if not raw.startswith(_MAGIC) or raw[_SIG_END : _SIG_END + 1] != b":":
        return None
    value = raw[_SIG_END + 1 :]
    holds = _signature_holds(raw[len(_MAGIC) : _SIG_END], mac(token, run_id, key, value))
    return value if holds else None


def unseal_versioned(token: bytes, run_id: str, key: str, raw: bytes) -> tuple[int, bytes] | None:
    """(version, value) of a deciding record signed for ``key`` of this job; None for
    anything else (absent included). Total, as ``unseal``."""
    if not raw.startswith(_VERSIONED) or raw[_SIG_END : _SIG_END + 1] != b":":
        return None
    digits, colon, value = raw[_SIG_END + 1 :].partition(b":")
    if not colon or not digits.isdigit() or len(digits) > _VERSION_DIGITS:
        return None
    version = int(digits)
    expected = mac(token, run_id, key, value, version)
    return (version, value) if _signature_holds(raw[len(_MAGIC) : _SIG_END], expected) else None


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


class _JobMemory:
    """What every view of one node's job shares (thread-safe): the keys already warned
    about, and the newest version of each deciding record this node has read or written."""

    def __init__(self, write_back: bool = True) -> None:
        self.write_back = write_back  # False: a read-only reader (``elastic status``)
        self._warned: set[tuple[str, str]] = set()
        self._newest: dict[str, tuple[int, bytes]] = {}
        self._lock = threading.Lock()

    def once(self, key: str, why: str = "foreign") -> None:
        with self._lock:
            if (key, why) in self._warned:
                return
            self._warned.add((key, why))
        if why == "foreign":
            log.warning(
                "ignoring %s: it is not signed with this job's token (written by a client "
                "without the token, or copied from another key or job)",
                key,
            )
        else:
            log.warning(
                "ignoring %s: it holds an older value than one this node has read (a "
                "replay, or the key was deleted); the newest is kept and written back",
                key,
            )

    def newest(self, key: str) -> tuple[int, bytes] | None:
        with self._lock:
            return self._newest.get(key)

    def saw(self, key: str, version: int, value: bytes) -> None:
        """Remember what this node read or wrote; of two values of one version (written by
        nodes that did not know of each other's), the later read."""
        with self._lock:
            held = self._newest.get(key)
            if held is None or version >= held[0]:
                self._newest[key] = (version, value)


class SignedStore:
    """A ``CoordinationStore`` view that signs and checks records (see the module)."""

    def __init__(
        self,
        inner: CoordinationStore,
        token: bytes | None,
        run_id: str,
        rel: str = "",
        memory: _JobMemory | None = None,
        *,
        write_back: bool = True,
    ) -> None:
        self.inner = inner
        self.token = token
        self.run_id = run_id
        self.prefix = inner.prefix
        self._rel = rel  # this view's prefix below the job's: keys are signed with it
        # Shared by every view of this node's job; ``write_back=False`` for a reader that
        # must never write (it still reads the newest it has seen).
        self.memory = memory or _JobMemory(write_back)

    @property
    def where(self) -> str:  # the inner view's: a c10d store may move
        return self.inner.where

    def sub(self, prefix: str) -> SignedStore:
        return SignedStore(
            self.inner.sub(prefix), self.token, self.run_id, self._rel + prefix, self.memory
        )

    def _seal(self, key: str, value: bytes | str) -> bytes:
        if COUNTER.fullmatch(self._rel + key):
            return _bytes(value)
        return seal(self.token, self.run_id, self._rel + key, _bytes(value))

    def _open(self, key: str, raw: bytes) -> bytes | None:
        if self.token is None and bytes(raw[: len(_MAGIC)]) in (_MAGIC, _VERSIONED):
            raise RendezvousAuthError(
                f"{self.prefix + key} is signed with a job token this node does not have; "
                "give every node the job's token (--rdzv-conf token_file=PATH, or "
                "ELASTIC_RDZV_TOKEN_FILE=PATH or ELASTIC_RDZV_TOKEN in the environment)"
            )
        if self.token is None or COUNTER.fullmatch(self._rel + key):
            return raw
        if DECIDING.fullmatch(self._rel + key):
            return self._open_deciding(key, bytes(raw))
        value = unseal(self.token, self.run_id, self._rel + key, bytes(raw))
        if value is None:
            self.memory.once(self.prefix + key)
        return value

    def _open_deciding(self, key: str, raw: bytes) -> bytes | None:
        """A deciding record's value: the newest this node knows of. One older than that
        (a replay; absent or foreign after a signed one was seen) reads as the newest,
        which this read writes back over it (so that nodes which never read the newer
        value see it too)."""
        assert self.token is not None
        rel = self._rel + key
        opened = unseal_versioned(self.token, self.run_id, rel, raw) if raw else None
        if raw and opened is None:
            self.memory.once(self.prefix + key)
        newest = self.memory.newest(rel)
        if opened is not None and (newest is None or opened[0] >= newest[0]):
            self.memory.saw(rel, *opened)
            return opened[1]
        if newest is None:
            return None if raw else b""
        self.memory.once(self.prefix + key, "older")
        # Put the newest back (the same bytes as before: the signature is deterministic),
        # so nodes that never read it see it too; a write meanwhile wins.
        if self.memory.write_back:
            sealed = seal(self.token, self.run_id, rel, newest[1], newest[0])
            self.inner.compare_set(key, raw, sealed)
        return newest[1]

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
        if self.token is not None:
            self._await_signed(keys, started, timeout, tick, self.read(keys))

    def wait_get(
        self, keys: Sequence[str], timeout: timedelta | None = None, tick: Tick | None = None
    ) -> list[bytes]:
        started = time.monotonic()
        raws = self.inner.wait_get(keys, timeout, tick)
        values = [self._open(key, raw) for key, raw in zip(keys, raws, strict=True)]
        if self.token is not None:
            values = self._await_signed(keys, started, timeout, tick, values)
        return [value or b"" for value in values]

    def _await_signed(
        self,
        keys: Sequence[str],
        started: float,
        timeout: timedelta | None,
        tick: Tick | None,
        values: list[bytes | None],
    ) -> list[bytes | None]:
        """After a wait that ``started`` then, which read ``values``: a foreign value made
        it return early, so wait for the real one (whoever writes it overwrites the
        foreign value, see ``compare_set``); the values, all signed."""
        limit = FOREIGN_WAIT if timeout is None else timeout.total_seconds()
        ticked = time.monotonic()
        while not all(values):
            now = time.monotonic()
            if now - started >= limit:
                raise StoreTimeoutError(f"timed out waiting for signed values at {list(keys)}")
            if tick is not None and now - ticked >= WAIT_TICK:
                ticked = now
                tick()
            time.sleep(FOREIGN_POLL)
            values = self.read(keys)
        return values

    # -- writes --------------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        rel = self._rel + key
        if self.token is None or not DECIDING.fullmatch(rel):
            self.inner.set(key, self._seal(key, value))
            return
        (raw,) = self.inner.multi_get([key])
        self._open_deciding(key, bytes(raw))  # learns the version it replaces
        version = self._next_version(rel)
        self.inner.set(key, seal(self.token, self.run_id, rel, _bytes(value), version))
        self.memory.saw(rel, version, _bytes(value))

    def _next_version(self, rel: str) -> int:
        """Above the newest this node knows of, and no lower than the clock (ms): a node
        that knows of none (the key was deleted before it read it) still writes a version
        above the ones written before, rather than 1 again."""
        newest = self.memory.newest(rel)
        return max(0 if newest is None else newest[0] + 1, time.time_ns() // 1_000_000)

    def heartbeat(self, key: str, value: bytes | str) -> None:
        self.inner.heartbeat(key, self._seal(key, value))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """As the store's, where a foreign value counts as absent: expecting absence
        replaces it; expecting a value finds it missing (``b""`` is returned)."""
        want, new = _bytes(expected), _bytes(desired)
        if self.token is not None and DECIDING.fullmatch(self._rel + key):
            return self._compare_set_deciding(key, want, new)
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

    def _compare_set_deciding(self, key: str, want: bytes, new: bytes) -> bytes:
        """``compare_set`` of a deciding record: against the value this node reads there
        (the newest it knows of), writing the next version; whatever stands in the store
        (a replay, a foreign value) is what is replaced."""
        assert self.token is not None
        rel = self._rel + key
        for _ in range(16):
            (raw,) = self.inner.multi_get([key])
            held = self._open_deciding(key, bytes(raw)) or b""
            if held != want:
                return held
            version = self._next_version(rel)
            sealed = seal(self.token, self.run_id, rel, new, version)
            if bytes(self.inner.compare_set(key, bytes(raw), sealed)) == sealed:
                self.memory.saw(rel, version, new)
                return new
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
            self.memory.once(self.prefix + key)
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
