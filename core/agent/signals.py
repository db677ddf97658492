"""The agent's signals room: a signal sent to the agent ends the run (``AgentBase``,
``base.py``).

Owns ``_on_signal``: a preemption notice first has the job checkpoint
(``checkpoint_on_notice``); then the node leaves the job (the survivors regroup without
spending a restart), its workers get the signal, and the agent ends with ``128 +
signum``. Imports ``checkpoint_on_notice`` and ``exit_code``.
"""

from __future__ import annotations

import contextlib
import logging
import signal

from elastic.core.agent.base import AgentBase
from elastic.core.agent.checkpoint_on_notice import checkpoint_before_leaving
from elastic.core.agent.exit_code import JobEnd, exit_code
from elastic.core.interfaces.spec import RunResult, WorkerState
from elastic.core.log import say


class SignalExit(AgentBase):
    """A signal to the agent: leave the job, stop the workers, exit 128 + signum."""

    def _on_signal(self, signum: int) -> RunResult:
        name = signal.Signals(signum).name
        if signum == self._preempt_signum and self._coordinator is not None:
            checkpoint_before_leaving(
                self._coordinator,
                name,
                self._node_id,
                self._group.group_world_size or 1,
                self._spec.preemption_grace,
                self._workers,
            )
        # Tell the job first: the survivors regroup while our workers wind down, and a
        # departure never spends the restart budget or looks like a finished node.
        with contextlib.suppress(Exception):  # cut off: fenced, the others see us lost
            self._calls(self._handler.leave)
        self._stop(signum, self._spec.shutdown_timeout)
        message = f"the agent received {name}; its workers were stopped"
        say(f"elastic: {message}", logging.WARNING)
        code = exit_code(JobEnd.SIGNALLED, signum=signum)
        return RunResult(WorkerState.FAILED, exit_code=code, message=message)
