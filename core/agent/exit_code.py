"""What a node exits with: the one rule from what it knows of the job's end.

A job ends one way, and every node of it says so with its exit code, however much of the
end it saw: a node that ran to the end, one that never ran workers (a standby in a full
job, a late joiner still waiting for a round), one that was out of the job when it ended
(fenced, regrouping) and learns of it late. A scheduler that reads any one node's code
must never read success for a job that failed, so a node exits 0 only when it *knows* the
job succeeded, and "cannot tell" is a failure.

``JobEnd.SUCCEEDED`` (0) is known in two ways only:

- this node's workers finished and every member of the round that still is one met it at
  the exit barrier (``BarrierEnd.DONE``);
- the rendezvous is closed and the job's failed flag (``agent/failed``), read *after* the
  close was seen, is unset: a node that gives up sets the flag before it closes the job
  (``restarts.give_up``), so a close without the flag is a job that succeeded. This holds
  for a node that never ran workers too: it reads the flag in the job's store the handler
  names (``RendezvousHandler.read_job_store``).

Every other end is non-zero:

- ``FAILED``: the flag was seen (by the job watch while workers ran, before an attempt, at
  the exit barrier, or on a closed rendezvous): the job-wide root cause's exit code
  (``interfaces.failures.launcher_exit_code``; every node reads the same records, so every
  node exits with the same code), 1 when no record can be read;
- ``UNKNOWN``: this node's part of the job is over but it cannot tell how the job ended:
  the rendezvous is closed and the flag cannot be read (the store gone, or a backend that
  names no job store), or the exit barrier timed out (a member neither arrived nor was
  found gone within the timeout): 1, with one line saying which;
- ``LEFT_ALONE``: this node's workers failed before it had joined the running job
  (``joining``): its own root cause's code; the job goes on without it;
- ``SIGNALLED``: the agent was signalled (preemption, Ctrl-C): 128 + signum, as torchrun;
- ``NODE_ERROR``: this node cannot take part (a bad setting, the store lost, its workers
  cannot start): 1; ``REFUSED``: the job refused this node as different from it (another
  command or version: a user's mistake): 2.
"""

from __future__ import annotations

import enum

from elastic.core.agent.exit_barrier import BarrierEnd


class JobEnd(enum.Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"
    LEFT_ALONE = "left_alone"
    SIGNALLED = "signalled"
    NODE_ERROR = "node_error"
    REFUSED = "refused"


def exit_code(end: JobEnd, *, root_cause: int | None = None, signum: int = 0) -> int:
    """The exit code for ``end`` (the rule above). ``root_cause``: the root cause's exit
    code with ``FAILED``/``LEFT_ALONE`` (None: no record could be read); ``signum``: the
    signal with ``SIGNALLED``."""
    if end is JobEnd.SUCCEEDED:
        return 0
    if end in (JobEnd.FAILED, JobEnd.LEFT_ALONE):
        return root_cause if root_cause else 1
    if end is JobEnd.SIGNALLED:
        return 128 + signum
    if end is JobEnd.REFUSED:
        return 2
    return 1  # UNKNOWN, NODE_ERROR


def after_close(failed: bool | None) -> JobEnd:
    """The rendezvous is closed and the failed flag read ``failed`` (None: unreadable)."""
    if failed is None:
        return JobEnd.UNKNOWN
    return JobEnd.FAILED if failed else JobEnd.SUCCEEDED


def after_barrier(end: BarrierEnd) -> JobEnd | None:
    """This node's workers succeeded and the exit barrier ended with ``end``; None: the
    job goes on (another node's workers failed in the round: rejoin)."""
    return {
        BarrierEnd.DONE: JobEnd.SUCCEEDED,
        BarrierEnd.FAILED: JobEnd.FAILED,
        BarrierEnd.TIMED_OUT: JobEnd.UNKNOWN,
        BarrierEnd.RESTART: None,
    }[end]
