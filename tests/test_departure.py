"""When a worker failure of unknown cause stops waiting for a departure: every other
member's agent beat since (``core/agent/departure.py``)."""

from __future__ import annotations

from elastic.core.agent.departure import all_beat_since
from elastic.core.interfaces.failures import (
    FailureRecord,
    may_be_peer_loss,
    names_peer_loss,
    says_nothing,
)


def test_every_member_must_beat_anew() -> None:
    before: dict[str, bytes | None] = {"a": b"1 10.0", "b": b"7 10.2", "c": None}
    assert all_beat_since(before, {"a": b"2 11.0", "b": b"8 11.1", "c": b"1 11.2"})
    assert not all_beat_since(before, {"a": b"2 11.0", "b": b"7 10.2", "c": b"1 11.2"})
    assert not all_beat_since(before, {"a": b"2 11.0", "b": b"8 11.1", "c": None})
    assert not all_beat_since(before, {"a": b"2 11.0", "b": b"8 11.1"})  # c unread
    assert not all_beat_since(before, None)  # the backend cannot tell
    assert all_beat_since({}, {})  # no other member: nobody could have left


def record(message: str = "", traceback: str = "", signal: str | None = None) -> FailureRecord:
    return FailureRecord(
        role="default",
        rank=0,
        local_rank=0,
        host="h",
        pid=1,
        exit_code=3,
        timestamp=0.0,
        message=message,
        traceback=traceback,
        signal=signal,
    )


def test_only_a_failure_with_no_message_says_nothing() -> None:
    assert says_nothing(record()) and may_be_peer_loss(record())
    closed = record("RuntimeError: Connection closed by peer")
    assert not says_nothing(closed) and may_be_peer_loss(closed)
    own = record("ValueError: bad batch", "Traceback ...\nValueError: bad batch")
    assert not says_nothing(own) and not may_be_peer_loss(own)
    assert not may_be_peer_loss(record(signal="SIGSEGV"))


def test_what_torch_says_of_a_lost_peer_names_a_peer_loss() -> None:
    """Messages seen when a rank went away while a regrouping worker connected."""
    for text in (
        "DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed. "
        "Did the remote server shutdown or crash?",
        "DistStoreError: Timed out after 5 seconds waiting for clients. 1/2 clients joined.",
        "RuntimeError: Gloo connectFullMesh failed with [pair.cc:152] timed out connecting: "
        "SO_ERROR: Connection refused",
    ):
        assert names_peer_loss(text), text
    assert not names_peer_loss("ValueError: bad batch")
