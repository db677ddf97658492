"""A departure reaches every survivor at once, not on its next heartbeat tick: the leaving
node says ``left`` on its presence connection once its departure is written, the serving
rank reads the round's facts at once and says ``news`` to every member, which reads them
at once too (``core/rendezvous/round/presence.py``). Real presence ports and real c10d
handlers on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from elastic.core.rendezvous.round.presence import PresenceServer, hello_line
from elastic.core.rendezvous.round.presence_client import PresenceClient
from elastic.harness.c10d_handlers import Make, c10d_handlers, rendezvous_all
from elastic.testing.ports import free_port
from elastic.testing.waits import wait_until

RUN = "job"
# A tick far longer than the waits below: only the word on the connection explains them.
SLOW_TICKS = {"heartbeat_interval": "10", "heartbeat_timeout": "30", "close_timeout": "3"}


def member(presence_server: PresenceServer, **calls: threading.Event) -> PresenceClient:
    """Member ``m1`` of round 1, connected to ``presence_server``; each event is set by
    the call of its name."""
    client = PresenceClient(
        "127.0.0.1",
        presence_server.port,
        lambda nonce: hello_line(None, RUN, "m1", 1, nonce),
        on_gone=calls.get("gone", threading.Event()).set,
        on_bye=calls.get("bye", threading.Event()).set,
        on_news=calls.get("news", threading.Event()).set,
    )
    assert wait_until(lambda: presence_server.silent()[0] == [], 10)  # its hello proved it
    return client


@pytest.mark.timeout(60)
def test_news_reaches_each_member_and_left_is_no_death(presence_server: PresenceServer) -> None:
    news, gone, bye, left = (
        threading.Event(),
        threading.Event(),
        threading.Event(),
        threading.Event(),
    )
    presence_server.on_left = left.set
    client = member(presence_server, news=news, gone=gone, bye=bye)
    presence_server.tell_news()
    assert news.wait(5), "the member was not told"
    client.stop(leaving=True)
    assert left.wait(5), "the serving rank did not hear the departure"
    time.sleep(0.7)  # past the blip grace: a close after "left" is never a death
    assert presence_server.gone(grace=0.0) == [] and not gone.is_set() and not bye.is_set()


@pytest.mark.timeout(60)
def test_a_plain_goodbye_wakes_nobody(presence_server: PresenceServer) -> None:
    """A member moving on to a new round says "bye": the serving rank is not woken for
    each of them (a round of a thousand would make a thousand ticks)."""
    left = threading.Event()
    presence_server.on_left = left.set
    client = member(presence_server)
    client.stop()
    time.sleep(0.5)
    assert not left.is_set()
    assert presence_server.gone(grace=0.0) == []


@pytest.fixture
def make() -> Iterator[Make]:
    with c10d_handlers(free_port(), config=SLOW_TICKS) as made:
        yield made


@pytest.mark.timeout(120)
def test_a_departure_reaches_every_survivor_within_a_fraction_of_a_tick(make: Make) -> None:
    handlers = [make(3, 3) for _ in range(3)]
    infos = rendezvous_all(handlers, timeout=30)
    leaver = next(h for h, i in zip(handlers, infos, strict=True) if i.rank == 2)
    others = [h for h in handlers if h is not leaver]
    for h, info in zip(handlers, infos, strict=True):  # every member's connection is up
        assert h._monitor is not None
        links = h._monitor.liveness.links
        assert info.rank == 0 or wait_until(lambda: links.client is not None, 10)  # noqa: B023
    time.sleep(0.3)
    started = time.monotonic()
    leaver.leave()  # what SIGTERM does
    assert wait_until(lambda: all(leaver.node_id in h.lost_nodes() for h in others), 15)
    took = time.monotonic() - started
    assert took < 1.5, f"the survivors learnt of the departure {took:.2f}s after it (tick 10s)"
