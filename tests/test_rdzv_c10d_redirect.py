"""A store opened anew at the first endpoint after the run's store moved is redirected to
the moved one (``plugins/rdzv_c10d/redirect.py``): its agent joins the run, never a round
of its own. Real handlers and servers on loopback, handlers as threads."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from elastic.core.tcpstore import TCPStoreClient, TCPStoreServer
from elastic.harness.c10d_handlers import Make, c10d_handlers, rendezvous_all, write_token_file
from elastic.plugins.rdzv_c10d import redirect
from elastic.plugins.rdzv_c10d.handler import C10dRendezvousHandler
from elastic.plugins.rdzv_c10d.redirect import (
    REDIRECT_KEY,
    parse_redirect,
    record,
    redirect_new_store,
)
from elastic.plugins.rdzv_c10d.succession import IDLE, STANDBY_KEY, identity_key, wire_key
from elastic.testing.waits import wait_until

TOKEN = b"a-job-token-of-enough-bytes"


@pytest.fixture
def make(port: int) -> Iterator[Make]:
    with c10d_handlers(port) as factory:
        yield factory


def generation(handler: C10dRendezvousHandler) -> int:
    known = handler._succession.known
    assert known is not None
    return known[0]


def joined(*handlers: C10dRendezvousHandler) -> list[Any]:
    """The last of ``handlers`` joins the round the others are in, as agents do: the
    others regroup once they see it waiting. Every handler's answer, in order."""
    *members, newcomer = handlers
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(newcomer.next_rendezvous)
        assert wait_until(lambda: all(h.num_nodes_waiting() > 0 for h in members), 10)
        return [*rendezvous_all(members), pending.result(timeout=20)]


@pytest.mark.parametrize("token", [False, True], ids=["open", "token"])
def test_a_replacement_on_the_first_endpoint_joins_the_moved_store(
    make: Make, port: int, tmp_path: Path, token: bool
) -> None:
    """1:3, one endpoint: the host leaves, the store moves to the survivor; an agent made
    again on the endpoint opens a new store there, is redirected, and forms the next
    round with the survivor on the moved store; its own store is stopped."""
    conf = {"last_call_timeout": "0.5"}
    if token:
        conf["token_file"] = write_token_file(tmp_path / "token", TOKEN)
    first, survivor = make(1, 3, **conf), make(1, 3, **conf)
    rendezvous_all([first, survivor])
    first.leave()
    assert wait_until(lambda: survivor.is_hosting, 5)
    first.shutdown()
    (alone,) = rendezvous_all([survivor])
    assert alone.world_size == 1 and generation(survivor) == 1
    replacement = make(1, 3, **conf)
    assert replacement.is_hosting and generation(replacement) == 0  # a new store, so far
    infos = joined(survivor, replacement)
    assert [i.world_size for i in infos] == [2, 2]
    assert infos[0].round == infos[1].round > alone.round
    assert survivor.is_hosting and not replacement.is_hosting
    assert generation(replacement) == 1
    assert {c.where for c in replacement._conns} == {survivor.protocol.node["standby"]}
    with pytest.raises(OSError):  # the new store at the first endpoint is gone
        socket.create_connection(("127.0.0.1", port), 1).close()


def test_a_first_start_waits_only_when_the_job_is_not_full(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With an hour's redirect window, a job whose every node (``--nnodes``' maximum)
    came forms at once, and so does a late joiner of a running job: neither can have a
    moved store elsewhere."""
    full = [make(1, 2, run_id="full") for _ in range(2)]
    running = [make(1, 3, run_id="late", last_call_timeout="0.5") for _ in range(2)]
    rendezvous_all(running)  # under the maximum: it waited the (default) window
    monkeypatch.setattr(redirect, "REDIRECT_WAIT", 3600.0)
    assert [i.world_size for i in rendezvous_all(full)] == [2, 2]
    late = make(1, 3, run_id="late", last_call_timeout="0.5")
    assert [i.world_size for i in joined(*running, late)] == [3, 3, 3]


def test_a_redirect_names_only_a_moved_store() -> None:
    assert parse_redirect(record("10.0.0.2:4000", (2, "ab"))) == ("10.0.0.2", 4000, (2, "ab"))
    for raw in (None, b"", b"10.0.0.2:4000 0 ab", b"10.0.0.2:4000 x ab", b"nohost 1", b"\xff"):
        assert parse_redirect(raw) is None, raw


@pytest.mark.parametrize("token", [None, TOKEN], ids=["open", "token"])
def test_the_holder_redirects_only_a_store_that_is_not_the_run_s(token: bytes | None) -> None:
    """Nothing is written into the run's own store (its generation or newer) nor into a
    standby; a new store (generation 0) gets the redirect once, signed with the token."""
    key = "elastic/job/" + REDIRECT_KEY
    live = ("127.0.0.1:1", (1, "live"))
    for data, written in (
        ({wire_key(identity_key("job")): b"1 live"}, False),
        ({wire_key(STANDBY_KEY): IDLE}, False),
        ({wire_key(identity_key("job")): b"0 new"}, True),
        ({}, True),
    ):
        with TCPStoreServer("127.0.0.1", 0, data=data, token=token) as server:
            first = ("127.0.0.1", server.port)
            assert redirect_new_store(first, "job", token, *live) is written
            assert redirect_new_store(first, "job", token, *live) is False  # told already
            with TCPStoreClient(*first, 2.0, token=token) as client:
                raw = client.multi_get([key], False)[0]
            assert bool(raw) is written
            if written and token is not None:
                assert raw != record(*live)  # sealed, not plain
