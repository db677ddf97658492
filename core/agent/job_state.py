"""Job-wide agent state in the rendezvous store: the restart budget, the failed flag,
the exit barrier and the final failure report.

Every node reads and writes the same keys (the backend namespaces the store by run id),
so all agents agree on ``TORCHELASTIC_RESTART_COUNT``, on when the budget is spent and on
the root cause. Counters and compare-and-set only: O(1) per node and event.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from elastic.core.interfaces import failures as fail
from elastic.core.interfaces.job_keys import (
    BARRIER_KEY,
    CLAIM_KEY,
    FAILED_KEY,
    PREEMPT_KEY,
    RESTARTS_KEY,
)
from elastic.core.interfaces.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousStoreGoneError,
)
from elastic.core.interfaces.store import Store
from elastic.core.plugin.host import PluginHost
from elastic.core.workers.process import Interrupted

T = TypeVar("T")


def store_call(fn: Callable[..., T], *args: Any) -> T:
    """Call the store or handler; a broken connection becomes RendezvousConnectionError.

    torch's TCPStore raises RuntimeError (DistNetworkError) or OSError when its server
    is gone; whatever the backend, the agent must answer with one clear line.
    """
    try:
        return fn(*args)
    except (RendezvousError, Interrupted):
        raise
    except (OSError, RuntimeError) as exc:
        raise RendezvousConnectionError(f"{type(exc).__name__}: {exc}") from exc


def claim_restart(store: Store, round_: int, node_id: str) -> int:
    """Spend one restart of the job-wide budget for a failed round; the restarts so far.

    Every node whose workers failed in round R races for the one claim of R, so a failure
    seen by several nodes at once costs the job a single restart.
    """
    won = store_call(store.compare_set, CLAIM_KEY.format(round_), "", node_id)
    if won == node_id.encode():
        return int(store_call(store.add, RESTARTS_KEY, 1))
    return int(store_call(store.add, RESTARTS_KEY, 0))


def exit_barrier(
    store: Store, round_: int, world_size: int, timeout: float, lost: Callable[[], list[str]]
) -> str:
    """Wait (up to ``timeout`` s) for every node of the round that is still a member to
    finish, so a node that hosts the store does not take it away from nodes still
    finishing their workers.

    A node that left or died is never waited for: the barrier is done once every other
    member has arrived. Returns ``"done"``; ``"failed"`` when the job failed meanwhile
    (another node spent the last restart); ``"restart"`` when another node's workers
    failed in this round (it claimed a restart), so this node must rejoin.
    """
    key = BARRIER_KEY.format(round_)
    store_call(store.add, key, 1)
    # One read per poll: a whole job finishing at once polls together.
    keys = [f"{key}/done", FAILED_KEY, CLAIM_KEY.format(round_), key]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, failed, claim, arrived = store_call(store.multi_get, keys)
        if done:
            return "done"
        if failed:
            return "failed"
        if claim:
            return "restart"
        try:
            gone = len(lost())
        except RendezvousError:
            gone = 0  # cannot tell (fenced): wait for everyone, bounded by the timeout
        if int(arrived or b"0") >= world_size - gone:
            store_call(store.set, f"{key}/done", "1")
            return "done"
        time.sleep(0.1)
    return "done"  # as torch: a peer that never arrives does not fail this node


class JobWatch:
    """The job-wide flags of one round (another node spent the budget; another node's
    workers failed), read every ``interval`` s by a daemon thread, so the agent's monitor
    loop never blocks on a store that stopped answering (a partition): it reads cached
    values and learns of the partition through the handler's fencing instead."""

    def __init__(self, store: Store, round_: int, interval: float = 1.0) -> None:
        self._store = store
        self._claim = CLAIM_KEY.format(round_)
        self._preempt = PREEMPT_KEY.format(round_)
        self._interval = interval
        self._stop = threading.Event()
        self.failed = False  # agent/failed is set: the job is over
        self.peer_failed = False  # a node claimed this round's restart
        self.checkpoint_requested = False  # a node got a preemption notice this round
        self.error: Exception | None = None  # the store said it is gone
        self._thread = threading.Thread(target=self._run, name="job-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:  # one request per interval: every node of the job does this
                keys = [FAILED_KEY, self._claim, self._preempt]
                failed, claim, preempt = store_call(self._store.multi_get, keys)
                self.failed, self.peer_failed = bool(failed), bool(claim)
                self.checkpoint_requested = self.checkpoint_requested or bool(preempt)
            except RendezvousStoreGoneError as exc:
                self.error = exc
                return
            except RendezvousError:
                continue  # unreachable for now: the handler's fencing decides

    def stop(self) -> None:
        self._stop.set()


def report_failure(store: Store | None, run_id: str, host: PluginHost | None, message: str) -> int:
    """Hand the job-wide failure summary to ``elastic_run_failed``; the exit code.

    Without a summary (no record published, store gone) or without any implementation of
    the hook, print one line ourselves so a failed run never ends silently.
    """
    summary = None
    if store is not None:
        with contextlib.suppress(Exception):
            records = fail.collect(store)
            if records:
                summary = fail.summarize(run_id, records)
    reported = False
    if summary is not None and host is not None:
        try:
            impls = host.pm.hook.elastic_run_failed.get_hookimpls()
            host.call_strict("elastic_run_failed", summary=summary)
            reported = bool(impls)
        except Exception as exc:  # loud, but the exit code must still be right
            print(f"elastic: failure reporting raised {exc!r}", file=sys.stderr)
    if not reported:
        print(f"elastic: run failed: {message}", file=sys.stderr, flush=True)
    return summary.exit_code if summary is not None else 1
