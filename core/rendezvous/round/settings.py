"""The round's ``--rdzv-conf`` keys, parsed and validated once for every backend.

A value outside its range is an error naming the key and the range; nothing is ever
silently replaced by a default: a ``join_timeout=0`` taken as "unset" would run with the
600 s default instead of telling the user the value is out of range.
torch's dynamic-rendezvous spellings ``keep_alive_interval``/``keep_alive_max_attempt``
are accepted as another way to say ``heartbeat_interval``/``heartbeat_timeout``, so a
torchrun command line works unchanged on any backend.

The heartbeat interval not given is 1 s up to ``KEEP_ALIVES_PER_SECOND`` nodes (the
``--nnodes`` maximum) and grows with the job beyond, its timeout five intervals: every
member's keep-alive, tick and presence words reach one store and one rank 0, so a fixed
interval makes their load grow with the job (at 1024 nodes and 1 s, about 4,000 messages
a second in the Python of one agent, beside that node's workers), while a bounded rate
costs a large job only a slower verdict on a machine gone silently (10 s at 1024 nodes);
a process death and a departure are seen at once whatever the interval (presence). Nomad
bounds its servers' heartbeats the same way (``max_heartbeats_per_second``). A value
given is taken as given.

A backend may add its own spellings of the round's plain-number keys (``aliases``: the
``etcd`` backend takes torch's ``timeout`` for ``join_timeout``) and name keys it no
longer takes (``refused``), so every dynamic backend reads the same settings by the same
rules, here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from elastic.core.interfaces.rendezvous import RendezvousConfigError, RendezvousParameters
from elastic.core.rendezvous.secrets import read_token

# Every key the round itself reads; a backend adds its own (connection, hosting) and the
# union is checked, so a typo such as ``timeout=`` is an error, not silently ignored.
ROUND_KEYS = (
    "last_call_timeout",  # s to wait for more nodes once min_nodes have joined (30; 0 = none)
    "join_timeout",  # s next_rendezvous may take before RendezvousTimeoutError (600)
    "close_timeout",  # s a hosting agent waits at shutdown for the others (30)
    "heartbeat_interval",  # s between heartbeats (1; more past 512 nodes: default_interval)
    "heartbeat_timeout",  # s without a heartbeat before a member counts as lost (5 intervals)
    "keep_alive_interval",  # torch's name for heartbeat_interval
    "keep_alive_max_attempt",  # torch's: heartbeat_timeout = interval * this
    "read_timeout",  # s a single store operation may take (10)
    "token_file",  # file holding the job token (secrets.py): signs records, admits to our store
)


class RoundSettings(NamedTuple):  # a named tuple: see AttemptEnd in core/agent/outcome.py
    min_nodes: int
    max_nodes: int
    last_call_timeout: float = 30.0
    join_timeout: float = 600.0
    close_timeout: float = 30.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    read_timeout: float = 10.0
    token: bytes | None = None
    node_rank: int | None = None


def _number(params: RendezvousParameters, key: str, default: float, *, zero_ok: bool) -> float:
    value = params.get_as_float(key, default)
    assert value is not None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        expected = ">= 0" if zero_ok else "> 0"
        raise RendezvousConfigError(
            f"--rdzv-conf {key}={params.get(key)}: expected a number of seconds {expected}"
        )
    return value


# The keep-alives a job's members send a second, at most, with the default interval.
KEEP_ALIVES_PER_SECOND = 512
HEARTBEATS_PER_TIMEOUT = 5  # the default timeout, in intervals


def default_interval(max_nodes: int) -> float:
    """The heartbeat interval of a job of up to ``max_nodes`` nodes, when none is given:
    1 s, or as long as keeps the job's keep-alives within ``KEEP_ALIVES_PER_SECOND``."""
    return max(1.0, max_nodes / KEEP_ALIVES_PER_SECOND)


def _liveness(params: RendezvousParameters) -> tuple[float, float]:
    """(heartbeat_interval, heartbeat_timeout), from our names or torch's, not both; what
    is not given follows the job's size (``default_interval``)."""
    ours = {"heartbeat_interval", "heartbeat_timeout"} & set(params.config)
    torch_names = {"keep_alive_interval", "keep_alive_max_attempt"} & set(params.config)
    if ours and torch_names:
        raise RendezvousConfigError(
            f"--rdzv-conf: give {' and '.join(sorted(ours))} or torch's "
            f"{' and '.join(sorted(torch_names))}, not both"
        )
    base = default_interval(params.max_nodes)
    if torch_names:
        interval = _number(params, "keep_alive_interval", base, zero_ok=False)
        attempts = params.get_as_int("keep_alive_max_attempt", HEARTBEATS_PER_TIMEOUT)
        assert attempts is not None
        if attempts < 2:
            raise RendezvousConfigError(
                f"--rdzv-conf keep_alive_max_attempt={attempts}: expected an integer >= 2"
            )
        return interval, interval * attempts
    timeout = _number(params, "heartbeat_timeout", HEARTBEATS_PER_TIMEOUT * base, zero_ok=False)
    # A timeout given alone keeps room for two heartbeats (the rule below) where the job's
    # size alone would leave less: it never makes an error that 1 s would not.
    default = min(base, max(1.0, timeout / 2)) if "heartbeat_timeout" in ours else base
    interval = _number(params, "heartbeat_interval", default, zero_ok=False)
    if timeout < 2 * interval:
        # One late beat on a loaded machine must not look like a dead node.
        raise RendezvousConfigError(
            f"--rdzv-conf heartbeat_timeout={timeout:g} must be at least twice "
            f"heartbeat_interval={interval:g}"
        )
    return interval, timeout


# The round keys a backend may give another name (``aliases``): plain numbers of seconds.
ALIASABLE = ("last_call_timeout", "join_timeout", "close_timeout", "read_timeout")


def _spelling(params: RendezvousParameters, aliases: Mapping[str, str]) -> dict[str, str]:
    """Round key -> the key to read it from: the alias when the user wrote it. Both
    spellings at once is an error (which one would win is a guess)."""
    spelled = {key: key for key in ALIASABLE}
    for alias, key in aliases.items():
        if key not in ALIASABLE:
            raise ValueError(f"{alias!r} cannot alias {key!r}: not one of {ALIASABLE}")
        if alias in params.config and key in params.config:
            raise RendezvousConfigError(
                f"--rdzv-conf: give {key} or {alias} (the same setting), not both"
            )
        if alias in params.config:
            spelled[key] = alias
    return spelled


def parse_round_settings(
    params: RendezvousParameters,
    backend_keys: Sequence[str] = (),
    *,
    aliases: Mapping[str, str] | None = None,
    refused: Mapping[str, str] | None = None,
) -> RoundSettings:
    """Check every key (the round's, ``backend_keys`` and ``aliases``) and read the
    round's. A ``refused`` key (key -> what to use instead) is one line naming both, ahead
    of the unknown-key check, so a retired key never reads as a typo."""
    for key, instead in (refused or {}).items():
        if key in params.config:
            raise RendezvousConfigError(
                f"--rdzv-conf {key}={params.get(key)} is not taken by the {params.backend} "
                f"backend: {instead}"
            )
    aliases = aliases or {}
    params.check_keys((*ROUND_KEYS, *backend_keys, *aliases))
    key = _spelling(params, aliases)
    interval, timeout = _liveness(params)
    return RoundSettings(
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        last_call_timeout=_number(params, key["last_call_timeout"], 30.0, zero_ok=True),
        join_timeout=_number(params, key["join_timeout"], 600.0, zero_ok=False),
        close_timeout=_number(params, key["close_timeout"], 30.0, zero_ok=True),
        heartbeat_interval=interval,
        heartbeat_timeout=timeout,
        read_timeout=_number(params, key["read_timeout"], 10.0, zero_ok=False),
        token=read_token(params.get("token_file")),
        node_rank=params.node_rank,
    )
