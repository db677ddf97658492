"""The rendezvous interface every backend implements, and the values it exchanges.

A backend is a distribution's entry point in the ``elastic.rendezvous`` group whose
object is the factory itself: ``create_handler(params) -> RendezvousHandler``. The
registry that picks one lives in ``elastic.core.rendezvous.registry``. The errors are
``rendezvous_errors``'s, imported here so every backend finds them where it always did.

May import ``store`` and ``rendezvous_errors``.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from elastic.core.interfaces.rendezvous_errors import RendezvousAuthError as RendezvousAuthError
from elastic.core.interfaces.rendezvous_errors import (
    RendezvousClosedError,
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousFencedError,
    RendezvousGracefulExitError,
    RendezvousMismatchError,
    RendezvousStateError,
    RendezvousStoreGoneError,
    RendezvousTimeoutError,
    StatusNotSupportedError,
)
from elastic.core.interfaces.rendezvous_errors import (
    RendezvousReusedIdError as RendezvousReusedIdError,
)
from elastic.core.interfaces.rendezvous_errors import (
    RendezvousStoreMovedError as RendezvousStoreMovedError,
)
from elastic.core.interfaces.store import Store

__all__ = [
    "JobStatus",
    "MemberStatus",
    "RendezvousClosedError",
    "RendezvousConfigError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousFencedError",
    "RendezvousGracefulExitError",
    "RendezvousHandler",
    "RendezvousInfo",
    "RendezvousMismatchError",
    "RendezvousParameters",
    "RendezvousStateError",
    "RendezvousStoreGoneError",
    "RendezvousTimeoutError",
    "StatusNotSupportedError",
]

_P = TypeVar("_P")


# The job's secrets in the agent's environment (``core/rendezvous/secrets.py``), for a
# scheduler to inject: the job token (the path of a file holding it, or the token), and
# the etcd password likewise. The agent reads them; no worker inherits them.
TOKEN_FILE_ENV = "ELASTIC_RDZV_TOKEN_FILE"
TOKEN_ENV = "ELASTIC_RDZV_TOKEN"
PASSWORD_FILE_ENV = "ELASTIC_RDZV_PASSWORD_FILE"
PASSWORD_ENV = "ELASTIC_RDZV_PASSWORD"
AGENT_ONLY_ENV = (TOKEN_FILE_ENV, TOKEN_ENV, PASSWORD_FILE_ENV, PASSWORD_ENV)


def _config_keywords(cls: type[_P]) -> type[_P]:
    """torch's spelling: keyword arguments that are not fields become ``config`` values."""
    init = cls.__init__
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        extra = {key: kwargs.pop(key) for key in list(kwargs) if key not in names}
        if extra:
            kwargs["config"] = {**dict(kwargs.get("config") or {}), **extra}
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


@_config_keywords
@dataclass
class RendezvousParameters:
    """What the launcher knows about the rendezvous it asks a backend to run.

    ``config`` holds the backend-specific ``--rdzv-conf`` pairs as strings; a backend must
    reject keys it does not know (``RendezvousConfigError`` listing the accepted ones).
    ``fingerprint`` describes this node's software and command; backends that check it
    refuse a node whose fingerprint differs from the job's in a field not named in
    ``allow_mismatch`` (see ``elastic.core.rendezvous.fingerprint``). ``read_only``
    handlers (made by ``elastic status``) must never join, write, or host a store: they
    only ``describe``.

    As in torch, keyword arguments that are not fields are config values, strings or
    not: ``RendezvousParameters("c10d", "h:29400", "job", 1, 2, join_timeout="600")``.
    """

    backend: str
    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    local_addr: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    fingerprint: dict[str, str] = field(default_factory=dict)
    allow_mismatch: frozenset[str] = frozenset()
    read_only: bool = False
    node_rank: int | None = None  # --node-rank: a rank hint (dynamic) or the rank (static)

    def __post_init__(self) -> None:
        if not self.backend:
            raise RendezvousConfigError("the rendezvous backend name must not be empty")
        if self.min_nodes < 1:
            raise RendezvousConfigError(f"min_nodes must be >= 1, got {self.min_nodes}")
        if self.node_rank is not None and self.node_rank < 0:
            raise RendezvousConfigError(f"node_rank must be >= 0, got {self.node_rank}")
        if self.max_nodes < self.min_nodes:
            raise RendezvousConfigError(
                f"max_nodes ({self.max_nodes}) must be >= min_nodes ({self.min_nodes})"
            )

    def get(self, key: str, default: Any = None) -> Any:
        return self.config.get(key, default)

    def get_as_int(self, key: str, default: int | None = None) -> int | None:
        value = self.config.get(key)
        if value is None:
            return default
        try:
            return int(value)
        except (TypeError, ValueError):
            raise RendezvousConfigError(f"--rdzv-conf {key}={value!r} is not an integer") from None

    def get_as_float(self, key: str, default: float | None = None) -> float | None:
        value = self.config.get(key)
        if value is None:
            return default
        try:
            return float(value)
        except (TypeError, ValueError):
            raise RendezvousConfigError(f"--rdzv-conf {key}={value!r} is not a number") from None

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None:
        value = self.config.get(key)
        if value is None:
            return default
        if isinstance(value, bool):
            return value
        lowered = str(value).strip().lower()
        if lowered in {"1", "true", "t", "yes", "y"}:
            return True
        if lowered in {"0", "false", "f", "no", "n"}:
            return False
        raise RendezvousConfigError(f"--rdzv-conf {key}={value!r} is not a boolean (true/false)")

    def check_keys(self, accepted: Sequence[str]) -> None:
        """Raise ``RendezvousConfigError`` naming any config key not in ``accepted``."""
        unknown = sorted(set(self.config) - set(accepted))
        if unknown:
            raise RendezvousConfigError(
                f"unknown --rdzv-conf key(s) for the {self.backend} backend: "
                f"{', '.join(unknown)}; accepted: {', '.join(sorted(accepted))}"
            )


@dataclass
class MembershipChange:
    """Who left the job and who came since its last round, named for a log line (at
    most a few names each; the counts are complete)."""

    left: list[str] = field(default_factory=list)
    came: list[str] = field(default_factory=list)
    left_count: int = 0
    came_count: int = 0


@dataclass
class RendezvousInfo:
    """The outcome of one rendezvous round, as seen by one node.

    ``store`` is the job's store (namespaced to this run id) that the agent uses for
    job-wide state: the restart budget and failure records. ``master_addr`` and
    ``master_port`` are what this round's workers use for ``init_process_group``: a fresh
    port every round, which worker rank 0 hosts a new store on, or, when the handler's
    ``use_agent_store`` is True, the agent's store itself. Either way nothing a dead
    attempt left behind may reach new workers.
    """

    store: Store
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    round: int = 0
    node_id: str = ""  # this node's id in the job ("": the backend names no nodes)
    # Who left and came since the job's last round (None: its first, or not known).
    change: MembershipChange | None = None
    # Every member's node id and hostname by rank, from a backend that hands them out (the
    # static one); a round-based backend does not: a round of N would send N ids to each
    # of N nodes (``elastic status`` lists them).
    members: list[str] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    # Nodes with workers still to start that the round left for the next one, so that
    # workers kept through a loss train first (``set_workers_kept``): the nodes waiting
    # for the next round right after this one formed.
    deferred: int = 0


@dataclass
class MemberStatus:
    node_id: str
    host: str
    rank: int | None
    pid: int | None
    local_world_size: int | None
    heartbeat_age: float | None  # seconds since the member's last heartbeat
    versions: dict[str, str] = field(default_factory=dict)


@dataclass
class JobStatus:
    """A read-only description of a job, as ``elastic status`` shows it."""

    run_id: str
    backend: str
    state: str  # "waiting", "running" or "closed"
    round: int
    round_formed_at: float | None  # unix time
    min_nodes: int
    max_nodes: int
    members: list[MemberStatus] = field(default_factory=list)
    waiting: int = 0
    restarts_used: int = 0
    max_restarts: int | None = None
    root_cause: dict[str, Any] | None = None


class RendezvousHandler(abc.ABC):
    """Main rendezvous interface (docstrings after torch.distributed.elastic's)."""

    @abc.abstractmethod
    def get_backend(self) -> str:
        """The name of the rendezvous backend."""

    @abc.abstractmethod
    def next_rendezvous(self) -> RendezvousInfo:
        """Main entry-point into the rendezvous barrier.

        Blocks until the rendezvous is complete and the current node is included in the
        formed worker group, or a timeout occurs, or the rendezvous was marked closed.

        Raises:
            RendezvousClosedError: The rendezvous is closed.
            RendezvousConnectionError: The rendezvous backend cannot be reached.
            RendezvousStateError: The rendezvous state is corrupt.
            RendezvousTimeoutError: The rendezvous did not complete on time.
            RendezvousMismatchError: This node differs from the job.
        """

    @abc.abstractmethod
    def is_closed(self) -> bool:
        """Whether the rendezvous has been closed (the job is finished)."""

    @abc.abstractmethod
    def set_closed(self) -> None:
        """Mark the rendezvous as closed."""

    @abc.abstractmethod
    def num_nodes_waiting(self) -> int:
        """Number of nodes that arrived late and wait for the next round.

        Callers call this periodically; a positive answer makes every agent stop its
        workers and re-form the group (scale-up).
        """

    @abc.abstractmethod
    def get_run_id(self) -> str:
        """The run id of the rendezvous (the job id)."""

    @abc.abstractmethod
    def shutdown(self) -> bool:
        """Close the resources opened for the rendezvous; True when it succeeded.

        Shutting down is this node leaving cleanly, not closing the job: the agent calls
        it on every exit (one agent may be SIGTERMed while the job goes on) and closes
        the job itself with ``set_closed``. A node that shut down must not be reported
        by the others' ``lost_nodes``.
        """

    def lost_nodes(self) -> list[str]:
        """Members of the current round that stopped heartbeating or left.

        Must answer from a cache, never block on the network. Raises
        ``RendezvousFencedError`` when this node itself can no longer confirm its
        membership. A non-empty answer makes the agent stop its workers (even ones blocked in a
        collective) and call ``next_rendezvous`` again. Backends without liveness
        tracking return an empty list, and so does every backend once the rendezvous is
        closed: a node that finished early is not a failure.
        """
        return []

    def on_fenced(self, action: Callable[[int, float], None] | None) -> None:
        """Call ``action(round, grace)`` the moment this node is fenced in ``round`` (the
        ``RendezvousFencedError`` that ``lost_nodes`` raises from then on): its workers
        must be signalled at once and SIGKILLed ``grace`` s later, so they are gone
        before any peer may count this node lost. Called from a thread of the handler's
        (keep it short), never waiting for the agent's loop to ask. Backends that never
        fence do nothing."""
        return None

    def read_job_store(self) -> Store | None:
        """The job's store (what ``RendezvousInfo.store`` is) for a node that holds no
        round: how a job it never ran in ended (its failed flag) decides its exit code.
        None: this backend names no store outside a round (such a node then cannot tell,
        and does not exit 0)."""
        return None

    def set_progress(self, say: Callable[[str], None] | None) -> None:
        """Where to print the lines that say what a rendezvous waits for (each call
        gets one whole line, no newline); None: print nothing. Backends whose
        ``next_rendezvous`` can wait long should call it every few seconds while they
        do (the shared round does, ``rendezvous/round/progress_lines.py``); others
        ignore it."""
        return None

    def leave(self) -> None:
        """This node leaves a job that goes on (SIGTERM: preemption, eviction, scale-in).

        Called before the agent stops its workers, so the others regroup at once instead
        of waiting for a liveness timeout, and without spending the restart budget. A node
        that left is never counted as done. Backends without membership do nothing.
        """
        return None

    def set_workers_kept(
        self, kept: bool, waiting: bool = False, workers_round: int | None = None
    ) -> None:
        """What this node's next ``next_rendezvous`` brings: workers that keep running
        through the change (``kept``: they regroup in place, in ``workers_round``, the
        round they took last) or workers still to start; ``waiting``: kept workers whose
        group lost a member, so they cannot train until the new round gives them one.

        Such workers train again as soon as they have a group, while a node with workers
        still to start (a replacement, a node that was fenced, one whose worker crashed)
        takes seconds: a backend may form the round with the kept nodes first and take
        the others in the next one, as it takes any joiner, while the kept workers train.
        A member of the kept workers' round that comes back with workers to start tells
        it their group is broken too, whether or not they noticed (a fenced peer's
        workers, cut off, close no connection). Backends that cannot do nothing."""
        return None

    def watch_keys(self, keys: Sequence[str]) -> Callable[[], list[bytes] | None] | None:
        """Have the handler's background reads include these keys of the job's store
        (``RendezvousInfo.store``): returns a function giving their latest values in
        ``keys`` order (None before the first read), or None when this backend reads
        nothing in the background (the caller reads the keys itself). ``[]`` stops it."""
        return None

    def membership_changed(self) -> bool:
        """A fresh (not cached) answer: did a member of the current round leave or die?

        Asked when workers fail: a failure caused by a departing node is a membership
        change, not a failure, and must not spend the restart budget.
        """
        return bool(self.lost_nodes())

    def round_peers(self) -> list[str] | None:
        """The node ids of the other members of the current round, as ``lost_nodes``
        names them; answered from what the node already holds (a round's roster is read
        once). Asked when a round being readied is superseded: a node lost that was a
        member of our workers' round means their waits with it cannot end, and they give
        them up at once. None: this backend cannot tell (the workers then give up once
        the next round is handed over, a few seconds later)."""
        return None

    def peer_heartbeats(self) -> dict[str, bytes | None] | None:
        """Fresh from the store (not cached): the latest heartbeat of each other member of
        the current round, a value that changes each time that member's agent beats
        (None for a member that left, finished or has not beaten). Asked while a worker
        failure of unknown cause waits to learn whether a node left: a member that beat
        since the failure did not leave. None: this backend cannot tell (the agent then
        waits for ``membership_changed``, up to its bound)."""
        return None

    @property
    def use_agent_store(self) -> bool:
        """Whether workers are clients of the agent's store (TORCHELASTIC_USE_AGENT_STORE).

        True only for a backend whose ``master_addr:master_port`` is a TCPStore it hosts
        and which deletes the workers' keys before each round forms (``static``: a round
        forms only once every node arrived, so no old worker is left to write).
        The default False is for the dynamic backends: a round forms without the nodes
        declared lost, whose workers may still run (a partition), and etcd is no
        TCPStore; so each round's worker rank 0 hosts a fresh store on a fresh port.
        """
        return False

    def describe(self) -> JobStatus:
        """A read-only description of the job; must not change it or host a store."""
        raise StatusNotSupportedError(
            f"the {self.get_backend()} rendezvous backend cannot describe a job"
        )
