"""How one attempt of this node's workers ended, as the agent's monitor saw it."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple


class Outcome(enum.Enum):
    SUCCEEDED = "succeeded"  # every local worker exited 0
    FAILED = "failed"  # local workers failed (crashed, or stopped as hung by a plugin)
    JOB_FAILED = "job_failed"  # another node spent the last restart: the job is over
    PEER_FAILED = "peer_failed"  # another node's workers failed this round (it pays)
    LOST_NODE = "lost_node"  # a member of the round left or died
    MEMBERSHIP = "membership"  # a node waits to join

    @property
    def restart_reason(self) -> str:
        """The ``reason`` ``elastic_restart`` hears when this outcome re-forms the group."""
        return "failure" if self is Outcome.PEER_FAILED else self.value


class AttemptEnd(NamedTuple):
    """``failed``: with ``FAILED``, local rank -> (exit code, unix time it was seen).

    A named tuple, as the other small records of an agent's start (``Gpu``, ``Forming``,
    ``Untaken``): Python 3.11 compiles a dataclass's methods at every import, about a
    millisecond a class, and every agent imports these."""

    outcome: Outcome
    failed: Mapping[int, tuple[int, float]] = MappingProxyType({})
