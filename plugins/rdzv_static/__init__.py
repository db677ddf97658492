"""The ``static`` rendezvous backend (``--rdzv-backend=static``, torchrun's default).

A fixed number of nodes (``--nnodes=N``, not a range), each given its rank
(``--node-rank``); node rank 0 hosts a TCPStore on ``--master-addr:--master-port``,
which the workers use too, as under torchrun (``handler.py`` says how attempts stay apart).

``--rdzv-conf`` keys:

* ``rank`` / ``node_rank`` -- this node's rank, if not given by ``--node-rank``.
* ``timeout`` -- seconds to reach node 0's store and to wait for every node in a round;
  default 600, as torchrun's static backend.
* ``shutdown_timeout`` -- seconds node 0 keeps its store up at exit for the other nodes
  to finish; default 30.
* ``token_file`` -- the job token (also ``ELASTIC_RDZV_TOKEN_FILE`` or ``ELASTIC_RDZV_TOKEN``
  in the environment): the agents prove it to node 0's store, whose rendezvous keys then
  only they may touch (the workers' keys cannot be guarded: see ``handler.py``).

Importing this module must not import torch: it is imported when the backend is
chosen, and torch is only needed once a rendezvous actually runs.

Owns ``handler`` (the fixed-membership rendezvous), ``store`` (node 0's TCPStore,
hosted or reached, and its keys) and ``status`` (``elastic status`` for a static job).
Imports core's ``rendezvous``, ``tcpstore``, ``interfaces`` and ``log``; may import
core's public rooms only (contract ``plugins-public-core``).
"""

from __future__ import annotations

from elastic.core.interfaces.rendezvous import (
    RendezvousConfigError,
    RendezvousHandler,
    RendezvousParameters,
)
from elastic.core.rendezvous import net
from elastic.core.rendezvous.secrets import read_token

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
DEFAULT_TIMEOUT = 600.0
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
ACCEPTED_KEYS = ("rank", "node_rank", "timeout", "shutdown_timeout", "token_file")

__all__ = ["create_handler", "parse_endpoint"]


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``host[:port]`` (``[v6]:port`` too) -> (host, port), with torchrun's defaults."""
    endpoint = (endpoint or "").strip()
    if not endpoint:
        return DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT
    try:
        host, port = net.parse_endpoint(endpoint, DEFAULT_MASTER_PORT)
    except ValueError as exc:
        raise RendezvousConfigError(f"static rendezvous: {exc} (--master-port)") from None
    if not port:
        raise RendezvousConfigError(
            f"static rendezvous: port 0 in endpoint {endpoint!r}; give the port node 0 "
            "listens on (--master-port)"
        )
    return host, port


def _node_rank(params: RendezvousParameters) -> int:
    """--node-rank arrives as the typed ``params.node_rank``; torchrun command lines may
    also say ``--rdzv-conf rank=N`` (or ``node_rank=N``): all given must agree."""
    given = {
        name: value
        for name, value in (
            ("--node-rank", params.node_rank),
            ("--rdzv-conf rank", params.get_as_int("rank")),
            ("--rdzv-conf node_rank", params.get_as_int("node_rank")),
        )
        if value is not None
    }
    if len(set(given.values())) > 1:
        listed = ", ".join(f"{k}={v}" for k, v in given.items())
        raise RendezvousConfigError(f"static rendezvous: the node ranks given disagree: {listed}")
    rank = next(iter(given.values()), None)
    if rank is None:
        if params.max_nodes == 1:
            return 0
        raise RendezvousConfigError(
            "static rendezvous needs this node's rank: pass --node-rank "
            f"(0..{params.max_nodes - 1})"
        )
    if not 0 <= rank < params.max_nodes:
        raise RendezvousConfigError(
            f"static rendezvous: --node-rank={rank} is out of range for --nnodes="
            f"{params.max_nodes} (valid: 0..{params.max_nodes - 1})"
        )
    return rank


def _positive(params: RendezvousParameters, key: str, default: float) -> float:
    value = params.get_as_float(key, default)
    assert value is not None
    if value <= 0:
        raise RendezvousConfigError(f"--rdzv-conf {key}={value:g} must be > 0 seconds")
    return value


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Entry point of the ``static`` backend: validate ``params`` and build the handler."""
    params.check_keys(ACCEPTED_KEYS)
    if params.read_only:  # `elastic status`: no node rank, never hosts; describe() only
        from elastic.plugins.rdzv_static.handler import StaticRendezvousHandler

        master_addr, master_port = parse_endpoint(params.endpoint)
        return StaticRendezvousHandler(
            run_id=params.run_id,
            rank=-1,
            world_size=params.max_nodes,
            master_addr=master_addr,
            master_port=master_port,
            timeout=_positive(params, "timeout", DEFAULT_TIMEOUT),
            shutdown_timeout=DEFAULT_SHUTDOWN_TIMEOUT,
            local_addr=params.local_addr,
            read_only=True,
            token=read_token(params.get("token_file")),
        )
    if params.min_nodes != params.max_nodes:
        raise RendezvousConfigError(
            "the static rendezvous backend needs a fixed number of nodes: --nnodes=N, "
            f"not a range (got {params.min_nodes}:{params.max_nodes}); use "
            "--rdzv-backend=c10d for an elastic job"
        )
    rank = _node_rank(params)
    master_addr, master_port = parse_endpoint(params.endpoint)
    timeout = _positive(params, "timeout", DEFAULT_TIMEOUT)
    shutdown_timeout = _positive(params, "shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT)

    # Imported here: handler imports this package's store module (a cycle at top level).
    from elastic.plugins.rdzv_static.handler import StaticRendezvousHandler

    return StaticRendezvousHandler(
        run_id=params.run_id,
        rank=rank,
        world_size=params.max_nodes,
        master_addr=master_addr,
        master_port=master_port,
        timeout=timeout,
        shutdown_timeout=shutdown_timeout,
        local_addr=params.local_addr,
        token=read_token(params.get("token_file")),
    )
