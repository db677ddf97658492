"""What the conformance suite (``conformance``) runs against: ``RendezvousTarget`` (a
backend, an endpoint that is up, quick settings), ``Nodes`` (the handlers made from it,
in order, and a node in a subprocess to kill), and the helpers that drive and check a
round (``rendezvous_all``, ``assert_one_round``, ``by_rank``, ``round_members``).

May import the public rooms of ``core`` (``interfaces``, ``rendezvous``) and pytest.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
from elastic.core.interfaces.rendezvous import (
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
)
from elastic.core.rendezvous.registry import get_rendezvous_handler


@dataclass
class RendezvousTarget:
    backend: str
    endpoint: str
    config: dict[str, str] = field(default_factory=dict)
    last_call_timeout: float = 1.0  # what ``config`` sets it to
    detect_timeout: float = 15.0  # how long lost nodes / waiting nodes may take to show
    local_addr: str | None = "127.0.0.1"
    # Each handler is told its node rank (0, 1, ... in creation order), as static needs.
    node_ranks: bool = False
    # Cases that do not apply (e.g. a fixed-membership backend has no scale-up), by name.
    not_applicable: frozenset[str] = frozenset()
    # --rdzv-conf values outside their range: each must be rejected, never replaced.
    bad_config: tuple[dict[str, str], ...] = (
        {"join_timeout": "0"},
        {"last_call_timeout": "-1"},
        {"heartbeat_interval": "0"},
        {"heartbeat_timeout": "nan"},
    )

    def params(
        self,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        node_rank: int | None = None,
        **config: str,
    ) -> Any:
        return RendezvousParameters(
            backend=self.backend,
            endpoint=self.endpoint,
            run_id=run_id,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            local_addr=self.local_addr,
            config={**self.config, **config},
            node_rank=node_rank,
        )

    def applies(self, case: str) -> None:
        if case in self.not_applicable:
            pytest.skip(f"{case} does not apply to the {self.backend} backend")


class Nodes:
    """Handlers created in order (node 0 first) and shut down in reverse at teardown."""

    def __init__(self, target: RendezvousTarget) -> None:
        self.target = target
        self.handlers: list[RendezvousHandler] = []
        self.procs: list[subprocess.Popen[str]] = []
        self._made: dict[str, int] = {}  # handlers made per run id: the next node rank

    def make(self, run_id: str, min_nodes: int, max_nodes: int, n: int = 1) -> list[Any]:
        new = []
        for _ in range(n):
            rank = self._made.get(run_id, 0)
            self._made[run_id] = rank + 1
            params = self.target.params(
                run_id, min_nodes, max_nodes, node_rank=rank if self.target.node_ranks else None
            )
            new.append(get_rendezvous_handler(params))
        self.handlers += new
        return new

    def spawn(self, run_id: str, min_nodes: int, max_nodes: int) -> subprocess.Popen[str]:
        spec = {
            "backend": self.target.backend,
            "endpoint": self.target.endpoint,
            "run_id": run_id,
            "min_nodes": min_nodes,
            "max_nodes": max_nodes,
            "local_addr": self.target.local_addr,
            "config": self.target.config,
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "elastic.testing.conformance_node", json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
        with ThreadPoolExecutor(max_workers=max(1, len(self.handlers))) as pool:
            list(pool.map(_quiet_shutdown, reversed(self.handlers)))


def _quiet_shutdown(handler: RendezvousHandler) -> None:
    try:
        handler.shutdown()
    except Exception:  # noqa: BLE001 - teardown must reach every handler
        pass


def rendezvous_all(handlers: list[Any], timeout: float = 30.0) -> list[RendezvousInfo]:
    """``next_rendezvous`` on every handler at once; results in handler order."""
    with ThreadPoolExecutor(max_workers=len(handlers)) as pool:
        futures = [pool.submit(h.next_rendezvous) for h in handlers]
        return [f.result(timeout=timeout) for f in futures]


def assert_one_round(infos: list[RendezvousInfo], size: int) -> None:
    assert sorted(i.rank for i in infos) == list(range(size))
    assert {i.world_size for i in infos} == {size}
    assert len({i.round for i in infos}) == 1, [i.round for i in infos]
    assert len({(i.master_addr, i.master_port) for i in infos}) == 1
    assert all(0 < i.master_port < 65536 for i in infos)
    if infos[0].node_id:
        assert len({i.node_id for i in infos}) == size
    if infos[0].members:
        assert all(i.members == infos[0].members for i in infos)
        assert all(i.members[i.rank] == i.node_id for i in infos)


def by_rank(infos: list[RendezvousInfo]) -> list[str]:
    """The node ids of a whole round's ``infos`` (one per member), by rank."""
    return [i.node_id for i in sorted(infos, key=lambda i: i.rank)]


def round_members(handler: Any, info: RendezvousInfo) -> list[str]:
    """The node ids of ``info``'s round by rank, as the job's store has them: the
    backend's list where it hands one out, else the round's roster (read through any
    of the job's round handlers)."""
    if info.members:
        return list(info.members)
    return list(handler.protocol.roster(info.round).members)


def lost_nodes(handler: RendezvousHandler) -> list[str]:
    """``handler.lost_nodes()``, or none where the backend cannot tell now."""
    try:
        return handler.lost_nodes()
    except RendezvousError:
        return []
