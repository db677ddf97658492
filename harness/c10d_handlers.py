"""Real c10d rendezvous handlers on one loopback port, as threads of the test: made on
demand, shut down together (the store's host last), and rendezvoused all at once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from elastic.core.interfaces.rendezvous import RendezvousParameters
from elastic.plugins.rdzv_c10d import create_handler
from elastic.plugins.rdzv_c10d.handler import C10dRendezvousHandler

# Quick liveness, so a lost node or a closed job shows within seconds.
FAST = {"heartbeat_interval": "0.2", "heartbeat_timeout": "1.5", "close_timeout": "3"}

Make = Callable[..., C10dRendezvousHandler]


def write_token_file(path: Path, content: bytes) -> str:
    """A job token file only its owner may read (one others may read is refused); its path."""
    path.write_bytes(content)
    path.chmod(0o600)
    return str(path)


@contextmanager
def c10d_handlers(
    port: int,
    default_max: int | None = None,
    config: dict[str, str] = FAST,
    host: str = "127.0.0.1",
) -> Iterator[Make]:
    """``make(mn=1, mx=None, run_id="job", **conf)`` creates a handler on ``host:port`` with
    ``config`` under ``conf`` (``mx`` unset: ``default_max``, or ``mn`` without one); every
    handler made is shut down on leaving, the host last."""
    made: list[C10dRendezvousHandler] = []

    def make(
        mn: int = 1, mx: int | None = None, run_id: str = "job", **conf: str
    ) -> C10dRendezvousHandler:
        top = mx or default_max or mn
        params = RendezvousParameters(
            "c10d", f"{host}:{port}", run_id, mn, top, config={**config, **conf}
        )
        handler = create_handler(params)
        assert isinstance(handler, C10dRendezvousHandler)
        made.append(handler)
        return handler

    try:
        yield make
    finally:
        for h in sorted(made, key=lambda h: h.is_hosting):
            h.shutdown()


def rendezvous_all(handlers: list[C10dRendezvousHandler], timeout: float = 20) -> list[Any]:
    """Every handler's ``next_rendezvous``, called at once; their answers in order."""
    with ThreadPoolExecutor(len(handlers)) as pool:
        futures = [pool.submit(h.next_rendezvous) for h in handlers]
        return [f.result(timeout=timeout) for f in futures]
