"""The node agent's shared state, and what its rooms ask of one another.

``LocalElasticAgent`` (``loop.py``: rendezvous, start, watch, decide) is put together from
rooms, each a class over ``AgentBase`` that owns a few of the agent's methods:

- ``crew.py``: this node's workers, started for a round and stopped (``_start``, ``_stop``);
- ``endings.py``: how a run ends here: success at the exit barrier, a failure recorded
  and decided (restart or give up), a closed rendezvous (``_succeeded``, ``_on_failure``,
  ``_closed``, ``_final_failure``, ``_one_line_failure``);
- ``in_place.py``: the job re-forming around the same workers (``_regroup_in_place``);
- ``signals.py``: a signal to the agent (``_on_signal``).

The state below is the agent's, set once in ``LocalElasticAgent.__init__``; every room
reads it, and a room calls another only through the methods declared here. Rooms import
core's lower rooms (interfaces, workers, rendezvous' progress lines, the plugin host) and
this package's helper modules, never ``loop`` nor one another.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from elastic.core.agent.checkpoint_on_notice import Coordinator
from elastic.core.agent.exit_code import JobEnd
from elastic.core.agent.fence import FenceGuard
from elastic.core.agent.joining import Joining
from elastic.core.agent.store_call import BoundedCalls
from elastic.core.interfaces import failures as fail
from elastic.core.interfaces.rendezvous import RendezvousHandler, RendezvousInfo
from elastic.core.interfaces.spec import RunResult, WorkerGroup, WorkerSpec
from elastic.core.interfaces.store import Store
from elastic.core.plugin.host import PluginHost
from elastic.core.rendezvous.round.progress_lines import Say
from elastic.core.workers.logs import LogLayout, LogTailer, WorkerLogs
from elastic.core.workers.process import SignalGuard, WorkerProcess

if TYPE_CHECKING:  # imported only with --warm-restarts (loop)
    from elastic.core.workers.spare import SparePool


class AgentBase:
    """The agent's state (``LocalElasticAgent.__init__`` sets it) and its rooms' calls."""

    _spec: WorkerSpec
    _handler: RendezvousHandler
    _host: PluginHost  # the hook plugins
    _exit_barrier_timeout: float
    _signals: tuple[str, ...]
    _guard: SignalGuard
    _suffix: str | None  # the log directory's
    _group: WorkerGroup
    _workers: list[WorkerProcess]  # running now (crew)
    _logs: dict[int, WorkerLogs]
    _layout: LogLayout | None
    _tailer: LogTailer | None
    _store: Store | None  # the job's store, from the last round
    _node_id: str
    _host_name: str | None
    _attempts: int  # worker starts (crew)
    _failures: dict[int, fail.FailureRecord]  # the last failure's records (endings)
    _preempt_signum: int
    _coordinator: Coordinator | None  # the round's checkpoint on notice; its control file
    _say: Say | None  # progress lines; None: --quiet
    _last_info: RendezvousInfo | None
    _calls: BoundedCalls  # store calls bounded by the handler's fencing
    _joining: Joining
    _fence: FenceGuard
    _spares: SparePool | None  # --warm-restarts (crew)

    # --- the rooms' methods, as the others call them ------------------------------------
    def _rendezvous(  # loop
        self, kept: bool = False, waiting: bool = False, workers_round: int | None = None
    ) -> RendezvousInfo | RunResult:
        raise NotImplementedError

    def _start(self, info: RendezvousInfo, restarts: int) -> str | None:  # crew
        raise NotImplementedError

    def _stop(self, sig: int, timeout: float) -> None:  # crew
        raise NotImplementedError

    def _succeeded(self, info: RendezvousInfo) -> RunResult | None:  # endings
        raise NotImplementedError

    def _final_failure(self, message: str) -> RunResult:  # endings
        raise NotImplementedError

    def _one_line_failure(self, message: str, end: JobEnd = JobEnd.NODE_ERROR) -> RunResult:
        raise NotImplementedError  # endings

    # --- helpers every room uses --------------------------------------------------------
    def _sleep(self, seconds: float, wait: Callable[[float], object] = time.sleep) -> None:
        with self._guard.waiting():  # a signal meanwhile is handled, not deferred
            wait(seconds)

    def _notify(self, hook: str, **kwargs: object) -> None:
        self._host.notify(hook, **kwargs)
