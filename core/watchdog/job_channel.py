"""The job-wide side of ``--stall-timeout``: what agents tell each other through the
rendezvous store while a round runs (multi-node jobs only; keys are namespaced by run id):

- ``agent/stall/<round>``: set by an agent that found a stall (who, which ranks, when);
  every agent then dumps its workers' stacks and reports its idle ones.
- ``agent/stall/<round>/acks``: every agent adds 1 once it has dumped; a finder kills only
  when all have (or ``PEER_WAIT`` passed).
- ``agent/stall/<round>/progress``: an agent whose workers progressed since its last poll
  adds 1; a worker waiting in a collective is stalled only when no one anywhere progressed.
  A finder also adds ``STALL_MARK``, so one ``add`` per poll reads both.
- ``agent/stall/<round>/records/<kind>``: records reported so far, capped by ``QUOTA``.
- ``agent/stall/<round>/reporters``, ``.../published``: agents with records to publish, and
  those that have; each waits (``PEER_WAIT``) for the others before it claims the restart,
  so whichever agent spends the last restart and prints the summary has every record.

One daemon thread per agent polls the progress counter every ``timeout / 8`` seconds
(0.25 s to 1 s): one store operation per poll and agent (two with a job token when it
adds: the signed store reads a counter before adding to it), and the monitor loop never
blocks on the store.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic.core.interfaces.store import Store

MARKER_KEY = "agent/stall/{}"
ACKS_KEY = "agent/stall/{}/acks"
PROGRESS_KEY = "agent/stall/{}/progress"
QUOTA_KEY = "agent/stall/{}/records/{}"
REPORTERS_KEY = "agent/stall/{}/reporters"
PUBLISHED_KEY = "agent/stall/{}/published"
QUOTA = {"culprit": 32, "waiter": 8}  # stall records per round and kind, job-wide
PEER_WAIT = 2.5  # seconds a finder waits for every agent's dump before it kills
STALL_MARK = 1 << 40  # added to the progress counter by a finder: "stall, dump now"


class JobStallChannel:
    """One round's stall traffic for one agent. ``local_progress()`` is the monotonic time
    of this node's latest worker progress."""

    def __init__(
        self,
        store: Store,
        round_: int,
        nodes: int,
        timeout: float,
        local_progress: Callable[[], float],
    ) -> None:
        self._store = store
        self._round = round_
        self.nodes = nodes
        self.interval = min(max(timeout / 8, 0.25), 1.0)
        self._local_progress = local_progress
        self.peer_stall = threading.Event()  # another agent set the marker
        self.job_progress = time.monotonic()  # when another node last progressed (or start)
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="stall-peers", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        counter = PROGRESS_KEY.format(self._round)
        published = 0.0
        last: int | None = None
        while not self._stop.wait(self.interval):
            try:
                local = self._local_progress()
                mine = 1 if local > published else 0
                value = int(self._store.add(counter, mine))
                # The counter is only a hint (anyone may add to it): the finder's
                # marker, a signed record with a job token, is what says "dump now".
                if value >= STALL_MARK and self._store.check([MARKER_KEY.format(self._round)]):
                    self.peer_stall.set()
                    return
                published = max(published, local)
                if last is not None and value - mine > last:
                    self.job_progress = time.monotonic()
                last = value
            except Exception:  # the agent's own loop reports a store that is gone
                continue

    # --- when a stall is found ----------------------------------------------------------
    def announce(self, ranks: list[int], detected_at: float) -> None:
        self._stop.set()
        payload = json.dumps({"ranks": ranks, "detected_at": detected_at})
        self._call("set", MARKER_KEY.format(self._round), payload)
        self._call("add", PROGRESS_KEY.format(self._round), STALL_MARK)

    def dumped(self, wait: bool) -> None:
        """Say this agent has dumped; a finder (``wait``) then waits for every agent."""
        self._stop.set()
        key = ACKS_KEY.format(self._round)
        acks = self._call("add", key, 1)
        deadline = time.monotonic() + PEER_WAIT
        while wait and isinstance(acks, int) and acks < self.nodes:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)
            acks = self._call("add", key, 0)

    def will_report(self) -> None:
        """This agent has records to publish (said before it acknowledges its dump)."""
        self._call("add", REPORTERS_KEY.format(self._round), 1)

    def published(self) -> None:
        """This agent's records are in the store: wait for every reporting agent's."""
        done = self._call("add", PUBLISHED_KEY.format(self._round), 1)
        deadline = time.monotonic() + PEER_WAIT
        while isinstance(done, int) and time.monotonic() < deadline:
            reporters = self._call("add", REPORTERS_KEY.format(self._round), 0)
            if not isinstance(reporters, int) or done >= reporters:
                return
            time.sleep(0.05)
            done = self._call("add", PUBLISHED_KEY.format(self._round), 0)

    def quota(self, kind: str, wanted: int) -> int:
        """How many of ``wanted`` records of ``kind`` this agent may still publish."""
        total = self._call("add", QUOTA_KEY.format(self._round, kind), wanted)
        used = (total if isinstance(total, int) else wanted) - wanted
        return max(min(QUOTA[kind] - used, wanted), 0)

    def _call(self, method: str, *args: Any) -> Any:
        """Best effort: a store that fails here is reported by the agent's own calls."""
        with contextlib.suppress(Exception):
            return getattr(self._store, method)(*args)
        return None
