"""A store opened anew where the run's first stood, after the run's store moved away.

With one ``--rdzv-endpoint``, an agent started again on the first endpoint's host (a
replacement, with the same command) after the store moved can listen there: nothing
tells it the run has a store elsewhere, and it opens a new, empty one. The run's side
knows, so it tells: the holder of a moved store (generation >= 1) probes the first
endpoint every ``WATCH_PERIOD`` (``Watch``), and when a store answers there that is not
its own (another identity, or none yet) it writes ``REDIRECT_KEY`` into it: the moved
store's address, generation and nonce, signed with the job token like every record
(``signing.seal``), on a connection that proved the token when one is set.

An agent that reached a new store (generation 0) does not let a first round form on it
before the run had a chance to redirect it (``await_redirect``): it waits, up to
``REDIRECT_WAIT`` from its first contact, for a redirect, unless ``--nnodes``' maximum of
agents already reached that store (then no run can have members elsewhere: a full job's
first start is not delayed). Once a round formed on a store it is the run's (a late
joiner of a job whose store never moved does not wait). A redirect found is followed: the
agent hosting the new store stops it after ``REDIRECT_GRACE`` (its other clients read the
redirect meanwhile), and every client's connections find the moved store as after a
handover (``Succession.find``, which accepts it only unmarked and with a higher
generation than the new store's 0). So a replacement joins the survivors' next round; it
never completes one on its own store while the run's holder can reach the first endpoint
within ``REDIRECT_WAIT``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from elastic.core.interfaces.rendezvous import (
    RendezvousAuthError,
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousStoreGoneError,
)
from elastic.core.rendezvous.round.signing import seal, unseal
from elastic.core.tcpstore import TCPStoreClient
from elastic.core.tcpstore.view import Connection
from elastic.plugins.rdzv_c10d.store import parse_endpoint
from elastic.plugins.rdzv_c10d.succession import (
    HANDOVER_WAIT,
    PROBE_TIMEOUT,
    STANDBY_KEY,
    Identity,
    identity_key,
    parse_identity,
)

log = logging.getLogger(__name__)

REDIRECT_KEY = "store-moved-to"  # under the job's prefix: a signed record
ARRIVALS_KEY = "store-arrivals"  # under the job's prefix: agents that reached this store
WATCH_PERIOD = 0.2  # s between the holder's probes of the first endpoint
# How long an agent on a new store waits for a redirect before its first round: several
# probe periods, so one slow probe (a loaded machine) is not fatal.
REDIRECT_WAIT = 2.0
REDIRECT_GRACE = 0.3  # s the new store still serves once redirected: its clients read it
POLL = 0.05  # s between an agent's reads of the redirect while it waits

Redirect = tuple[str, int, Identity]  # (host, port, identity) of the moved store


def record(addr: str, ident: Identity) -> bytes:
    return f"{addr} {ident[0]} {ident[1]}".encode()


def parse_redirect(raw: bytes | None) -> Redirect | None:
    """``"<host:port> <generation> <nonce>"`` of a moved store (generation >= 1); None
    when absent, foreign or malformed."""
    try:
        addr, generation, nonce = (raw or b"").decode("ascii").split(" ")
        host, port = parse_endpoint(addr)
        ident = parse_identity(f"{generation} {nonce}".encode())
    except (UnicodeDecodeError, ValueError, RendezvousConfigError):
        return None
    return (host, port, ident) if ident is not None and ident[0] >= 1 else None


def redirect_new_store(
    first: tuple[str, int], run_id: str, token: bytes | None, addr: str, ident: Identity
) -> bool:
    """Write the redirect to ``addr`` (the moved store, ``ident``) into the store at the
    first endpoint if one answers there that is not the run's; whether it was written."""
    try:
        client = TCPStoreClient(*first, PROBE_TIMEOUT, token=token)
    except (RendezvousConnectionError, RendezvousAuthError):  # nothing, or not ours
        return False
    key = f"elastic/{run_id}/{REDIRECT_KEY}"
    want = record(addr, ident)
    try:
        mark, raw_ident, raw = client.multi_get([STANDBY_KEY, identity_key(run_id), key], False)
        found = parse_identity(raw_ident)
        if mark or (found is not None and found[0] >= ident[0]):
            return False  # a standby, or the run's store itself
        if unseal(token, run_id, REDIRECT_KEY, raw) == want:
            return False  # told already
        client.set(key, seal(token, run_id, REDIRECT_KEY, want), confirmed=True)
    except RendezvousConnectionError:
        return False
    finally:
        client.close()
    log.info("c10d rendezvous: redirected a new store at %s:%s to %s", *first, addr)
    return True


class Watch:
    """The holder's side: while ``live()`` names the moved store this node holds
    (address, identity), redirect any other store that answers at the first endpoint.
    It sleeps until ``wake()`` (this node's standby was handed the store) or ``stop()``:
    the members that hold nothing, all but one, do not look five times a second."""

    def __init__(
        self,
        first: tuple[str, int],
        run_id: str,
        token: bytes | None,
        live: Callable[[], tuple[str, Identity] | None],
    ) -> None:
        self._args = (first, run_id, token)
        self._live = live
        self._stop = threading.Event()
        self._woken = threading.Event()
        self._thread = threading.Thread(target=self._run, name="c10d-redirect", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """This node may hold a moved store now: look every ``WATCH_PERIOD`` from now on."""
        self._woken.set()

    def _run(self) -> None:
        self._woken.wait()
        while not self._stop.wait(WATCH_PERIOD):
            live = self._live()
            if live is None:
                continue
            try:
                redirect_new_store(*self._args, *live)
            except Exception as exc:  # never the agent's end: the next probe tries again
                log.warning("c10d rendezvous: probing the first endpoint failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self._woken.set()


def await_redirect(
    read: Callable[[], bytes | None], arrived: Callable[[], int], max_nodes: int, since: float
) -> Redirect | None:
    """The redirect ``read`` finds within ``REDIRECT_WAIT`` of ``since`` (monotonic);
    None at once when ``max_nodes`` agents ``arrived`` at this store, else at the end."""
    deadline = since + REDIRECT_WAIT
    while True:
        found = parse_redirect(read())
        if found is not None:
            return found
        if arrived() >= max_nodes or time.monotonic() >= deadline:
            return None
        time.sleep(POLL)


def move_connections(conns: Sequence[Connection], target: Redirect, prefix: str) -> None:
    """Every one of ``conns`` on the moved store ``target``: each fails over to it once
    the new store stops answering (``Succession.find``, told of ``target``). A new store
    that keeps serving past ``HANDOVER_WAIT`` is an error (its host never followed)."""
    deadline = time.monotonic() + HANDOVER_WAIT
    for conn in conns:
        while (conn.host, conn.port) != target[:2]:
            conn.call("check", [prefix])
            if time.monotonic() >= deadline:
                raise RendezvousStoreGoneError(
                    f"the c10d store at {conn.where} was redirected to the run's store at "
                    f"{target[0]}:{target[1]}, but it kept serving"
                )
            time.sleep(POLL)
