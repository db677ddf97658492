"""The holder's side of a c10d store move: marking, offering, copying (``succession``
argues why two stores never serve one run).

A holder that leaves first marks its own standby ``LEAVING`` (``mark_leaving``: from then
on no holder may choose it), then offers the store to the standbys in order (``offer``: a
compare_set ``IDLE`` -> ``RECEIVING <sender>``, the first that agrees wins), stops
serving, and copies every key with the run's identity one generation on
(``next_generation``, ``copy_into``), which unmarks the receiver: from then on it is the
job's store. ``handler.py`` runs these steps; ``succession`` finds the store after them.
"""

from __future__ import annotations

from elastic.core.interfaces.rendezvous import RendezvousAuthError, RendezvousConnectionError
from elastic.core.tcpstore import TCPStoreClient, wire
from elastic.plugins.rdzv_c10d.store import parse_endpoint
from elastic.plugins.rdzv_c10d.succession import (
    IDLE,
    LEAVING,
    PROBE_TIMEOUT,
    RECEIVING,
    STANDBY_KEY,
    identity_key,
    new_identity,
    parse_identity,
    wire_key,
)

CHUNK_BYTES = 4 << 20  # per MULTI_SET of a handover, well under a request's 64 MiB cap


def mark_leaving(standby: tuple[str, int], token: bytes | None) -> bytes:
    """Mark our own standby ``LEAVING`` unless a holder chose it first: its mark after
    the compare_set (``LEAVING``, ``RECEIVING ...``, or ``IDLE`` when the key is gone:
    the standby is the job's store now). ``b""`` when it does not answer."""
    try:
        client = TCPStoreClient(*standby, PROBE_TIMEOUT, token=token)
    except (RendezvousConnectionError, RendezvousAuthError):  # nothing, or not ours
        return b""
    try:
        return bytes(client.compare_set(STANDBY_KEY, IDLE, LEAVING))
    except RendezvousConnectionError:
        return b""
    finally:
        client.close()


def offer(standby: str, sender: str, timeout: float, token: bytes | None) -> TCPStoreClient | None:
    """A client on ``standby``'s store once it agreed to receive from ``sender`` (its
    mark went from ``IDLE`` to ``RECEIVING sender``); None when it is leaving, busy with
    another sender, not a standby, or does not answer."""
    host, port = parse_endpoint(standby)
    try:
        client = TCPStoreClient(host, port, timeout, connect_timeout=PROBE_TIMEOUT, token=token)
    except (RendezvousConnectionError, RendezvousAuthError):  # nothing there, or not ours
        return None
    mark = RECEIVING + b" " + sender.encode()
    try:
        if bytes(client.compare_set(STANDBY_KEY, IDLE, mark)) == mark:
            return client
    except RendezvousConnectionError:
        pass
    client.close()
    return None


def copy_into(client: TCPStoreClient, data: dict[bytes, bytes]) -> None:
    """Every key of ``data`` into the receiving standby, then its mark away: from then on
    it is the job's store."""
    for chunk in _chunks(data):
        client.multi_set([k for k, _ in chunk], [v for _, v in chunk])
    client.delete_key(STANDBY_KEY)  # answered: the copy is complete and applied


def next_generation(data: dict[bytes, bytes], run_id: str) -> dict[bytes, bytes]:
    """``data`` with the run's identity one generation on, and a new nonce."""
    key = wire_key(identity_key(run_id))
    current = parse_identity(data.get(key, b""))
    return {**data, key: new_identity(current[0] + 1 if current else 1)}


def _chunks(data: dict[bytes, bytes]) -> list[list[tuple[str, bytes]]]:
    """The store's keys as a client names them (without the wire's prefix, which the
    client adds again), in MULTI_SETs of at most about ``CHUNK_BYTES``."""
    chunks: list[list[tuple[str, bytes]]] = [[]]
    size = 0
    for raw, value in data.items():
        key = raw.decode("utf-8", "surrogateescape").removeprefix(wire.KEY_PREFIX)
        if chunks[-1] and size + len(raw) + len(value) > CHUNK_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append((key, value))
        size += len(raw) + len(value)
    return chunks
