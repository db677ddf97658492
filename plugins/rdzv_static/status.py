"""``elastic status`` for a static job: read node 0's store as a client, change nothing.

Only ``check`` and ``get`` are used (never ``add``, which would create missing keys), so
describing a job neither joins it nor writes to it, and never hosts a store.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

from elastic.core.interfaces.job_keys import read_job_state
from elastic.core.interfaces.rendezvous import JobStatus, MemberStatus
from elastic.core.interfaces.store import Store
from elastic.plugins.rdzv_static import store as tcp
from elastic.plugins.rdzv_static.store import ARRIVALS, CLOSED, JOB, LATEST

FAILED = "agent/failed"
DESCRIBE_TIMEOUT = 10.0  # seconds: status is interactive, don't wait the full rdzv timeout


def _read(store: Store, key: str) -> Any:
    if not store.check([key]):
        return None
    raw = store.get(key)
    try:
        return json.loads(raw)
    except ValueError:
        return None  # a status view shows what it can; the rendezvous itself names bad keys


def describe(
    *,
    run_id: str,
    master_addr: str,
    master_port: int,
    prefix: str,
    timeout: float,
    token: bytes | None = None,
) -> JobStatus:
    limit = timedelta(seconds=min(timeout, DESCRIBE_TIMEOUT))
    store = tcp.connect_store(master_addr, master_port, limit, prefix, token)
    try:  # one connection per call: `elastic status --watch` makes one per redraw
        return _describe(store, run_id)
    finally:
        store.close()


def _describe(store: Store, run_id: str) -> JobStatus:
    latest = _read(store, LATEST) or {}
    job = _read(store, JOB) or {}
    world_size = int(latest.get("world_size") or job.get("world_size") or 0)
    round_ = int(latest.get("round") or 0)
    arrivals = _read(store, ARRIVALS) or 0
    nodes = latest.get("nodes") or []
    members = [
        MemberStatus(
            node_id=str(node.get("node_id")),
            host=str(node.get("host")),
            rank=rank,
            pid=node.get("pid"),
            local_world_size=None,
            heartbeat_age=None,  # static rendezvous has no heartbeats
        )
        for rank, node in enumerate(nodes)
        if isinstance(node, dict)
    ]
    if _read(store, CLOSED) or store.check([FAILED]):
        state = "closed"
    elif latest and arrivals <= (round_ + 1) * world_size:
        state = "running"
    else:
        state = "waiting"
    waiting = max(0, int(arrivals) - (round_ + 1) * world_size) if latest else int(arrivals)
    formed_at = latest.get("formed_at")
    restarts_used, root_cause = read_job_state(store, run_id)
    return JobStatus(
        run_id=run_id,
        backend="static",
        state=state,
        round=round_,
        round_formed_at=float(formed_at) if formed_at else None,
        min_nodes=world_size,
        max_nodes=world_size,
        members=members,
        waiting=waiting,
        restarts_used=restarts_used,
        root_cause=root_cause,
    )


def latest_record(assignment: dict[str, Any], nodes: list[dict[str, Any]]) -> str:
    """What node 0 stores under ``rdzv/latest`` with each assignment."""
    return json.dumps({**assignment, "nodes": nodes, "formed_at": time.time()})
