"""Failure records: one per failed worker, published job-wide so every node agrees on
the root cause. Plain data and JSON; rendering belongs to the errors plugin."""

from __future__ import annotations

import json
import os
import re
import signal
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic.core.interfaces.store import Store


@dataclass
class FailureRecord:
    """One worker's failure as its agent saw it.

    ``timestamp`` is unix time with sub-second precision: the time the worker's error
    file says it failed, else the time its agent saw it exit.
    """

    role: str
    rank: int
    local_rank: int
    host: str
    pid: int | None
    exit_code: int
    timestamp: float
    node_id: str = ""
    group_rank: int | None = None
    attempt: int = 0
    signal: str | None = None  # e.g. "SIGKILL" when the worker died by a signal
    message: str = ""
    traceback: str = ""
    error_file: str | None = None
    stdout_path: str | None = None
    stderr_path: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> FailureRecord:
        data = json.loads(text)
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class FailureSummary:
    """A failed run: the job-wide root cause first, then every other failure."""

    run_id: str
    root_cause: FailureRecord
    others: list[FailureRecord] = field(default_factory=list)
    exit_code: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "exit_code": self.exit_code,
            "root_cause": asdict(self.root_cause),
            "others": [asdict(r) for r in self.others],
        }


# --- publishing and collecting job-wide -------------------------------------------------
# Every agent appends its failures to the rendezvous store under an atomic counter, so
# each node can read every node's failures and all of them agree on one root cause.
COUNT_KEY = "agent/failures/count"
RECORD_KEY = "agent/failures/{}"
# How long ``collect`` waits for a record whose slot was counted but not yet written (a
# publisher is between ``add`` and ``set``).
COLLECT_GRACE = timedelta(seconds=2)
# Records read at most: a job's real ones are far fewer (one per failed worker, per round).
MAX_RECORDS = 65536
READ_CHUNK = 1024  # records per read: well under a store request's size limits
MAX_PENDING = 256  # missing slots waited for (publishers between add and set)


def publish(store: Store, record: FailureRecord) -> None:
    """Append ``record`` to the job-wide failure list in ``store``."""
    index = store.add(COUNT_KEY, 1)
    store.set(RECORD_KEY.format(index), record.to_json())


def collect(store: Store, grace: timedelta = COLLECT_GRACE) -> list[FailureRecord]:
    """Every record published so far, in publication order; unreadable ones skipped."""
    # Bounded: the counter is not signed, and a forged one must not cost us memory.
    count = min(store.add(COUNT_KEY, 0), MAX_RECORDS)
    keys = [RECORD_KEY.format(i) for i in range(1, count + 1)]
    values = _read(store, keys)
    missing = [key for key, raw in zip(keys, values, strict=True) if not raw]
    # Publishers between add and set are a few; many missing slots were never written.
    if missing and len(missing) <= MAX_PENDING:
        try:
            store.wait(missing, grace)
        except Exception:  # a publisher died between add and set: take what is there
            pass
        late = dict(zip(missing, _read(store, missing), strict=True))
        values = [raw or late.get(key, b"") for key, raw in zip(keys, values, strict=True)]
    records = []
    for raw in values:
        try:
            if raw:
                records.append(FailureRecord.from_json(raw))
        except Exception:  # one bad record must not hide the others
            continue
    return records


def _read(store: Store, keys: list[str]) -> list[bytes]:
    """``multi_get`` in chunks of ``READ_CHUNK``: one request each, not two per key."""
    values: list[bytes] = []
    for start in range(0, len(keys), READ_CHUNK):
        values += store.multi_get(keys[start : start + READ_CHUNK])
    return values


# --- the summary ------------------------------------------------------------------------
def _round(record: FailureRecord) -> int | None:
    value = record.extra.get("round") if isinstance(record.extra, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def signal_number(record: FailureRecord) -> int | None:
    """The signal that killed the worker, from ``signal`` or a negative exit code."""
    if record.signal:
        try:
            return int(signal.Signals[record.signal])
        except KeyError:
            pass
    if record.exit_code < 0:
        return -record.exit_code
    return None


def launcher_exit_code(record: FailureRecord) -> int:
    """The exit code the launcher uses for a run that failed because of ``record``.

    torchrun always exits 1. We pass the worker's own code through (clamped to 1..255,
    since a failed run must never exit 0) and, like a shell, report death by signal N as
    128+N (137 for SIGKILL, 139 for SIGSEGV), so a job manager can tell a crash or an OOM
    kill from an exception. Scripts that only test for non-zero see no difference.
    """
    signum = signal_number(record)
    if signum is not None and record.exit_code <= 0:
        return min(128 + signum, 255)
    return min(max(record.exit_code, 1), 255)


def waiting_for_peer(record: FailureRecord) -> bool:
    """A hung worker whose stack showed it waiting in a collective (``core/watchdog/stall.py``):
    it waited for a peer that never came, so it is never the root cause of its round
    while another failure is known."""
    stall = record.extra.get("stall") if isinstance(record.extra, dict) else None
    return isinstance(stall, dict) and bool(stall.get("waiting"))


# ``extra`` key set on the records of a node whose workers failed at start-up before it had
# joined a running job (``core/agent/joining.py``): that node left alone, the job went on.
BEFORE_JOINING = "before_joining"


def failed_before_joining(record: FailureRecord) -> bool:
    """Whether only this record's node left the job for it: it is the root cause only
    when nothing else failed in its round."""
    return isinstance(record.extra, dict) and bool(record.extra.get(BEFORE_JOINING))


def _order(record: FailureRecord) -> tuple[bool, bool, float, int, int, str]:
    return (
        failed_before_joining(record),
        waiting_for_peer(record),
        record.timestamp,
        record.rank,
        record.local_rank,
        record.host,
    )


def summarize(run_id: str, records: list[FailureRecord]) -> FailureSummary:
    """The job-wide view of a failed run: the earliest failure is the root cause, the
    others follow in time order (hung workers that were waiting in a collective last, and
    after them a node's failure that only took that node out of the job).

    When records carry ``extra["round"]`` (the rendezvous round, the same on every node),
    only the latest round's failures are kept: earlier rounds were restarted past and
    would otherwise always win the "earliest" comparison. Comparing times across hosts
    assumes their clocks agree (NTP) to better than the gap between failures.
    """
    if not records:
        raise ValueError("summarize needs at least one failure record")
    rounds = [r for r in (_round(rec) for rec in records) if r is not None]
    if rounds:
        last = max(rounds)
        records = [rec for rec in records if _round(rec) in (None, last)]
    ordered = sorted(records, key=_order)
    root = ordered[0]
    return FailureSummary(
        run_id=run_id, root_cause=root, others=ordered[1:], exit_code=launcher_exit_code(root)
    )


# --- failures that restarting cannot fix --------------------------------------------------
# Patterns as text, compiled by ``re`` on first use and kept in its cache: most agents
# never see a failure, and compiling them at import was a cost every agent's start paid.
_STARTUP_PATTERNS = [
    (r"can't open file", 0),  # python script.py: no such script
    (r"^\S*python[\d.]*: No module named ", re.M),  # python -m missing
    (r"Error while finding module specification for", 0),  # python -m a.missing
    (r"^(SyntaxError|IndentationError|TabError): ", re.M),
]
_FRAME = r'^\s*File "[^"]*", line \d+, in (\S+)'


# What gloo, NCCL and torch's store say when a peer process or its host went away.
_PEER_LOSS = (
    r"Connection closed by peer|Connection reset by peer|ECONNRESET|Broken pipe|"
    r"Connection refused|Socket Timeout|DistNetworkError|remote process exited|"
    r"NCCL communicator was aborted|ncclRemoteError|Timed out waiting .* for client|"
    r"Timed out after .* waiting for clients|connectFullMesh failed|"
    r"Connection was likely closed"
)


def may_be_peer_loss(record: FailureRecord) -> bool:
    """Whether a worker failure may have been caused by another node leaving: its error
    names a lost connection, or nothing is known of it (output on the console, no error
    file). A Python error of the worker's own (a traceback that is not a connection
    error) or a signal it died of is its own failure."""
    if record.signal:
        return False
    return says_nothing(record) or names_peer_loss(_text(record))


def names_peer_loss(text: str) -> bool:
    """Whether an error's text is what gloo, NCCL or torch's store say when a peer
    process or its host went away (a connection closed, reset or refused, a timeout)."""
    return re.search(_PEER_LOSS, text, re.IGNORECASE) is not None


def says_nothing(record: FailureRecord) -> bool:
    """A failure that left no message or traceback (output on the console, no error
    file): an exit code, and nothing else known of its cause."""
    return not _text(record).strip()


def _text(record: FailureRecord) -> str:
    return "\n".join(t for t in (record.message, record.traceback) if t)


def is_deterministic_startup_failure(record: FailureRecord) -> bool:
    """True for failures that happen the same way on every attempt, so the agent should
    report them at once instead of spending restarts: a missing script or module, a
    syntax error, or a ``ModuleNotFoundError`` raised by the main script's own top-level
    imports. Looks at the message and at the traceback (or stderr tail) the agent filled.
    """
    if record.exit_code <= 0 or record.signal:
        return False
    text = "\n".join(t for t in (record.message, record.traceback) if t)
    if any(re.search(pattern, text, flags) for pattern, flags in _STARTUP_PATTERNS):
        return True
    if re.search(r"^ModuleNotFoundError: ", text, re.M) or record.message.startswith(
        "ModuleNotFoundError"
    ):
        # Only when the whole traceback is the main script's module level: an import
        # deeper in the program may depend on runtime state.
        frames = re.findall(_FRAME, text, re.M)
        return frames == ["<module>"]
    return False


def script_problem(path: str) -> str | None:
    """Why the Python script at ``path`` cannot start, in Python's own words, or None.

    For the agent to call before starting workers whose stderr it does not capture (and
    so could not show to ``is_deterministic_startup_failure``): a missing script or a
    syntax error fails every attempt identically, so it is reported without a launch.
    """
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as exc:
        return f"can't open file {os.path.abspath(path)!r}: [Errno {exc.errno}] {exc.strerror}"
    try:
        compile(source, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:  # ValueError: NUL bytes in the source
        return "".join(traceback.format_exception_only(type(exc), exc)).rstrip()
    return None


def published_root_cause(store: Store, run_id: str) -> dict[str, Any] | None:
    """The job-wide root cause published so far, for ``elastic status``; read-only (the
    count key is checked first, since ``add(key, 0)`` would create it)."""
    if not store.check([COUNT_KEY]):
        return None
    records = collect(store, grace=timedelta(0))
    if not records:
        return None
    return asdict(summarize(run_id, records).root_cause)
