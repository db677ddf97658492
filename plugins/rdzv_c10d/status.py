"""``describe()``: a read-only view of a c10d job for ``elastic status``.

Only reads (``check``/``get``/``multi_get``); never joins, writes or hosts a store.
Heartbeat ages compare the member's clock with ours, so they are as good as clock sync.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from elastic.core.rendezvous import JobStatus, MemberStatus
from elastic.plugins.rdzv_c10d import records as R

if TYPE_CHECKING:
    from elastic.plugins.rdzv_c10d.handler import C10dRendezvousHandler


def _age(raw: bytes) -> float | None:
    try:
        return max(0.0, time.time() - float(raw.split()[1]))
    except (IndexError, ValueError):
        return None


def _latest_round(handler: C10dRendezvousHandler) -> int:
    store = handler.rdzv_store
    if not store.check([R.ROUND]):
        return -1
    return int(store.get(R.ROUND))


def describe(handler: C10dRendezvousHandler) -> JobStatus:
    store, proto = handler.rdzv_store, handler.protocol
    params = handler.params
    status = JobStatus(
        run_id=handler.run_id,
        backend="c10d",
        state="waiting",
        round=0,
        round_formed_at=None,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
    )
    latest = _latest_round(handler)
    if latest < 0:
        return status
    # The newest *formed* round is what runs; a newer unformed one is nodes waiting.
    formed, rnd = None, latest
    while rnd >= 0 and rnd >= latest - 2 and formed is None:
        asg = proto.read_assignment(rnd)
        if asg is not None and asg.state == "formed":
            formed = asg
        else:
            rnd -= 1
    status.round = latest
    if formed is not None:
        status.round = formed.round
        status.round_formed_at = formed.formed_at
        status.state = "running"
        values = store.multi_get([R.hb_key(m) for m in formed.members])
        for rank, (node, raw) in enumerate(zip(formed.members, values, strict=True)):
            host, _, rest = node.partition(":")
            pid_text = rest.partition(":")[0]
            status.members.append(
                MemberStatus(
                    node_id=node,
                    host=host,
                    rank=rank,
                    pid=int(pid_text) if pid_text.isdigit() else None,
                    local_world_size=None,
                    heartbeat_age=None if raw == R.DONE else _age(raw),
                    versions=dict(formed.fingerprint) if rank == 0 else {},
                )
            )
        nxt = R.count_key(formed.round + 1)
        if store.check([nxt]):
            status.waiting = store.add(nxt, 0)  # add 0 on an existing key only reads it
    elif store.check([R.count_key(latest)]):
        status.waiting = store.add(R.count_key(latest), 0)
    if proto.is_closed():
        status.state = "closed"
    if handler.job_store.check(["agent/restarts"]):
        try:
            status.restarts_used = int(handler.job_store.get("agent/restarts"))
        except ValueError:
            pass
    return status
