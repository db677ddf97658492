"""``describe()``: a read-only view of a job for ``elastic status``, on any store.

Only reads (``check``/``get``/``multi_get``); never joins, writes or hosts a store.
Heartbeat ages compare the member's clock with ours, so they are as good as clock sync.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from elastic.core.interfaces.job_keys import read_job_state
from elastic.core.interfaces.rendezvous import (
    JobStatus,
    MemberStatus,
    RendezvousError,
    RendezvousStateError,
)
from elastic.core.rendezvous.fingerprint import VERSION_FIELDS
from elastic.core.rendezvous.round import records as R

if TYPE_CHECKING:
    from elastic.core.interfaces.coordination import CoordinationStore as PrefixStore
    from elastic.core.interfaces.rendezvous import RendezvousParameters
    from elastic.core.rendezvous.round.protocol import RoundProtocol


def _age(raw: bytes) -> float | None:
    try:
        return max(0.0, time.time() - float(raw.split()[1]))
    except (IndexError, ValueError):
        return None


def _beat_age(raw: bytes, formed_at: float | None) -> float | None:
    """Seconds since a member's last sign of life: its newest keep-alive, or its round's
    outcome when newer (it counts as the member's keep-alive, ``lease.py``: a member's
    first of the round comes a period after it)."""
    age = _age(raw)
    if isinstance(formed_at, (int, float)) and formed_at > 0:
        since = max(0.0, time.time() - formed_at)
        age = since if age is None else min(age, since)
    return age


def _int(store: PrefixStore, key: str) -> int | None:
    if not store.check([key]):
        return None
    raw = store.get(key)
    try:
        return int(raw)
    except ValueError:
        raise RendezvousStateError(
            f"rendezvous state key {store.prefix + key!r} is not a number: {bytes(raw[:60])!r}"
        ) from None


def _join_records(store: PrefixStore, rnd: int) -> dict[str, dict[str, Any]]:
    """node id -> its join record for round ``rnd`` (one multi_get)."""
    count = _int(store, R.count_key(rnd)) or 0
    keys = [R.join_key(rnd, i) for i in range(1, count + 1)]
    out: dict[str, dict[str, Any]] = {}
    for key, raw in zip(keys, store.multi_get(keys), strict=True):
        if not raw:
            continue  # a slot taken by a joiner that died before writing it
        record = R.loads(raw, store.prefix + key)
        if R.valid_join(record, rnd):
            out.setdefault(record["id"], record)
    return out


def _member(
    rank: int, node: str, raw: bytes, record: dict[str, Any], formed_at: float | None
) -> MemberStatus:
    fp = {str(k): str(v) for k, v in (record.get("fp") or {}).items()}
    nproc = fp.get("nproc_per_node", "")
    pid = record.get("pid")
    return MemberStatus(
        node_id=node,
        host=str(record.get("host") or node.partition(":")[0]),
        rank=rank,
        pid=pid if isinstance(pid, int) else None,
        local_world_size=int(nproc) if nproc.isdigit() else None,
        heartbeat_age=None if raw in (R.DONE, R.LEFT) else _beat_age(raw, formed_at),
        versions={k: fp[k] for k in VERSION_FIELDS if k in fp},
    )


def describe(
    job_store: PrefixStore,
    store: PrefixStore,
    proto: RoundProtocol,
    params: RendezvousParameters,
    backend: str,
) -> JobStatus:
    """The job as ``store`` (the round's keys under ``job_store``) shows it."""
    status = JobStatus(
        run_id=params.run_id,
        backend=backend,
        state="waiting",
        round=0,
        round_formed_at=None,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
    )
    latest = _int(store, R.ROUND)
    if latest is None:
        raise RendezvousError(
            f"no job with id {params.run_id!r} at {job_store.where} (no node has joined it)"
        )
    status.round = latest
    formed = proto.last_formed(latest)  # what runs; a newer unformed round is waiting nodes
    if formed is not None:
        status.state = "running"
        status.round = formed.round
        status.round_formed_at = formed.formed_at
        if formed.max_nodes:
            status.min_nodes, status.max_nodes = formed.min_nodes, formed.max_nodes
        members = proto.roster(formed.round).members
        beats = store.multi_get([R.hb_key(m) for m in members])
        joins = _join_records(store, formed.round)
        for rank, (node, raw) in enumerate(zip(members, beats, strict=True)):
            status.members.append(_member(rank, node, raw, joins.get(node, {}), formed.formed_at))
        budget = formed.fingerprint.get("max_restarts", "")
        status.max_restarts = int(budget) if budget.isdigit() else None
        status.waiting = _int(store, R.count_key(formed.round + 1)) or 0
    else:
        status.waiting = _int(store, R.count_key(latest)) or 0
    if proto.is_closed():
        status.state = "closed"
    status.restarts_used, status.root_cause = read_job_state(job_store, params.run_id)
    return status
