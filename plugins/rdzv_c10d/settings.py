"""The c10d backend's ``--rdzv-conf`` keys, parsed and validated once."""

from __future__ import annotations

import os
from dataclasses import dataclass

from elastic.core.rendezvous import RendezvousConfigError, RendezvousParameters

TOKEN_ENV = "ELASTIC_RDZV_TOKEN"

# Every key this backend accepts; anything else is an error naming these (torchrun ignores
# unknown keys silently, so a typo such as ``timeout=`` never takes effect there).
ACCEPTED_KEYS = (
    "is_host",  # true: host the store here (fail if we cannot); false: external store
    "last_call_timeout",  # s to wait for more nodes once min_nodes have joined (30)
    "join_timeout",  # s next_rendezvous may take before RendezvousTimeoutError (600)
    "close_timeout",  # s the hosting agent waits at shutdown for the others (30)
    "heartbeat_interval",  # s between heartbeats (1)
    "heartbeat_timeout",  # s without a heartbeat before a member counts as lost (5)
    "read_timeout",  # s a single store operation may take (10)
    "token_file",  # file holding the job token that signs join records (HMAC-SHA256)
    "node_rank",  # rank hint (the CLI passes --node-rank here when given)
    "store_type",  # only "tcp" (accepted for torchrun command lines)
)


@dataclass(frozen=True)
class Settings:
    min_nodes: int
    max_nodes: int
    is_host: bool | None = None
    last_call_timeout: float = 30.0
    join_timeout: float = 600.0
    close_timeout: float = 30.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    read_timeout: float = 10.0
    token: bytes | None = None
    node_rank: int | None = None


def _positive(params: RendezvousParameters, key: str, default: float) -> float:
    value = params.get_as_float(key, default)
    assert value is not None
    if value < 0 or (value == 0 and key != "last_call_timeout"):
        raise RendezvousConfigError(f"--rdzv-conf {key}={value} must be positive")
    return value


def read_token(path: str | None) -> bytes | None:
    if path:
        try:
            with open(path, "rb") as f:
                token = f.read().strip()
        except OSError as exc:
            raise RendezvousConfigError(f"--rdzv-conf token_file={path}: {exc}") from None
        if not token:
            raise RendezvousConfigError(f"--rdzv-conf token_file={path} is empty")
        return token
    env = os.environ.get(TOKEN_ENV, "").strip()
    return env.encode() if env else None


def parse_settings(params: RendezvousParameters) -> Settings:
    params.check_keys(ACCEPTED_KEYS)
    store_type = params.get("store_type", "tcp")
    if store_type != "tcp":
        raise RendezvousConfigError(
            f"--rdzv-conf store_type={store_type!r}: the c10d backend supports only 'tcp'"
        )
    interval = _positive(params, "heartbeat_interval", 1.0)
    hb_timeout = _positive(params, "heartbeat_timeout", 5.0)
    if hb_timeout < 2 * interval:
        # One late beat on a loaded machine must not look like a dead node.
        raise RendezvousConfigError(
            f"heartbeat_timeout ({hb_timeout}) must be at least twice "
            f"heartbeat_interval ({interval})"
        )
    node_rank = params.get_as_int("node_rank")
    if node_rank is not None and node_rank < 0:
        raise RendezvousConfigError(f"--rdzv-conf node_rank={node_rank} must be >= 0")
    return Settings(
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        is_host=params.get_as_bool("is_host"),
        last_call_timeout=_positive(params, "last_call_timeout", 30.0),
        join_timeout=_positive(params, "join_timeout", 600.0),
        close_timeout=_positive(params, "close_timeout", 30.0),
        heartbeat_interval=interval,
        heartbeat_timeout=hb_timeout,
        read_timeout=_positive(params, "read_timeout", 10.0),
        token=read_token(params.get("token_file")),
        node_rank=node_rank,
    )
