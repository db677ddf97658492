"""A member's ``beat`` word: after each keep-alive the store acknowledged, it names the
value it wrote on its presence connection to rank 0, which dates that value from the
word's arrival instead of from its next read of the store (up to a heartbeat interval
later). A silent node's verdict, ``heartbeat_timeout`` after its last value was first
known, so comes that much sooner (``core/rendezvous/round/presence.py``,
``liveness.LivenessTracker``). Real presence ports and real c10d handlers on loopback."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from elastic.core.rendezvous.round.liveness import LivenessTracker
from elastic.core.rendezvous.round.presence import LINE_MAX, PresenceServer, hello_line
from elastic.core.rendezvous.round.presence_client import PresenceClient
from elastic.harness.c10d_handlers import c10d_handlers, rendezvous_all, write_token_file
from elastic.testing.ports import free_port
from elastic.testing.waits import wait_until

RUN = "job"


@pytest.mark.timeout(60)
def test_a_beat_word_is_dated_on_arrival_and_leaves_the_other_words_alone(
    presence_server: PresenceServer,
) -> None:
    left = threading.Event()
    presence_server.on_left = left.set
    client = PresenceClient(
        "127.0.0.1",
        presence_server.port,
        lambda nonce: hello_line(None, RUN, "m1", 1, nonce),
        on_gone=lambda: None,
    )
    assert wait_until(lambda: presence_server.silent()[0] == [], 10)  # its hello proved it
    before = time.monotonic()
    client.say_beat(b"7 1795827343.396")
    assert wait_until(lambda: "m1" in presence_server.beat_hints(), 5)
    value, at = presence_server.beat_hints()["m1"]
    assert value == b"7 1795827343.396" and before <= at <= time.monotonic()
    client.say_beat(b"x" * LINE_MAX)  # too long to be a word: never sent
    client.say_beat(b"8 1795827344.396")
    assert wait_until(lambda: presence_server.beat_hints()["m1"][0] == b"8 1795827344.396", 5)
    client.stop(leaving=True)  # "left" after the beats is still heard
    assert left.wait(5)
    assert presence_server.gone(grace=0.0) == []


def test_a_beat_dates_only_the_value_it_names() -> None:
    tracker = LivenessTracker(timeout=5.0, interval=1.0)
    hints = {"a": (b"7", 0.2), "b": (b"3", 0.2)}
    tracker.update({"a": b"7", "b": b"4"}, asked=0.9, answered=1.0, hints=hints)
    for t in (2.0, 3.0, 4.0, 5.0):
        tracker.update({"a": b"7", "b": b"4"}, asked=t, answered=t + 0.01)
    assert tracker.due() == 5.2  # a's, dated by its word; b's word named another value
    assert tracker.update({"a": b"7", "b": b"4"}, asked=5.2, answered=5.21)[0] == ["a"]
    assert tracker.due() == 6.0  # b's: from the read that brought it
    # A word that arrived after the read brought the value cannot make it older.
    late = LivenessTracker(timeout=5.0, interval=1.0)
    late.update({"a": b"7"}, asked=0.9, answered=1.0, hints={"a": (b"7", 1.5)})
    for t in (2.0, 3.0, 4.0, 5.0):
        late.update({"a": b"7"}, asked=t, answered=t + 0.01)
    assert late.due() == 6.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("silent, watcher", [(2, 0), (0, 1)], ids=["member", "rank-0"])
def test_a_silent_node_is_lost_timeout_after_its_last_acknowledged_keep_alive(
    tmp_path: Path, silent: int, watcher: int
) -> None:
    """Three handlers with a job token (signed heartbeat values); one node (a member,
    or rank 0) sends a keep-alive half an interval off its usual phase (its watcher reads
    the value just after the keep-alives, all timed from the round's start), then no
    more. Its watcher (rank 0, or a member) dates that value from the node's word about
    it, not from its next read half an interval later, and its verdict comes
    ``heartbeat_timeout`` after the acknowledgement."""
    interval, timeout = 1.0, 3.0
    token = write_token_file(tmp_path / "token", b"t" * 32)
    config = {
        "heartbeat_interval": str(interval),
        "heartbeat_timeout": str(timeout),
        "close_timeout": "3",
        "token_file": token,
    }
    with c10d_handlers(free_port(), config=config) as make:
        handlers = [make(3, 3) for _ in range(3)]
        infos = rendezvous_all(handlers, timeout=30)
        by_rank = {i.rank: h for h, i in zip(handlers, infos, strict=True)}
        judge, quiet = by_rank[watcher]._monitor, by_rank[silent]._monitor
        assert judge is not None and quiet is not None
        member = quiet if silent else judge
        assert wait_until(lambda: member.liveness.links.client is not None, 10)
        acked: list[tuple[bytes, float]] = []
        said = quiet.lease.on_acked
        assert said is not None

        calls: list[bytes] = []

        def off_phase(value: bytes) -> None:  # on the keep-alive's thread
            said(value)
            calls.append(value)
            if len(calls) == 1:
                time.sleep(1.5 * interval)  # the next goes out at once after this: late
            else:
                acked.append((value, time.monotonic()))
                quiet.lease.suspend()  # and it is the last

        time.sleep(1.5)  # a few keep-alives and ticks into the round
        quiet.lease.on_acked = off_phase
        assert wait_until(lambda: bool(acked), 10)
        value, at = acked[0]
        assert wait_until(lambda: quiet.node_id in judge.lost, 3 * timeout)
        took = time.monotonic() - at
        seen = judge.liveness._tracker._seen.get(quiet.node_id)
        assert seen is not None and seen.value == value  # the signed value read, as said
        assert seen.changed_at - at < 0.05, "dated by the next read, not by the word"
        assert timeout <= took < timeout + 0.4, took
