"""``elastic status``: what a running job looks like, read from its rendezvous backend.

Read-only: the handler is created with ``read_only=True``, so it never joins, writes or
hosts a store. The JSON schema (``--json``) is ``JobStatus`` as a dict, version 1:
``{"schema": 1, "run_id", "backend", "state", "round", "round_formed_at", "min_nodes",
"max_nodes", "waiting", "restarts_used", "max_restarts", "root_cause",
"members": [{"node_id", "host", "rank", "pid", "local_world_size", "heartbeat_age",
"versions"}]}``.

Ctrl-C ends it at once wherever it lands, with exit status 130 and no traceback: the
job is read on a thread of its own while the main thread waits, interruptibly, so a call
that signals cannot reach (a name lookup, a peer that stopped answering) never delays
the exit. The handler being used is shut down on the way out (its store connections
closed), and the exit waits at most ``CLOSE_GRACE`` for the read to end.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import click
from elastic.cli.options import flag
from elastic.core.interfaces.failures import BEFORE_JOINING
from elastic.core.interfaces.rendezvous import (
    JobStatus,
    RendezvousError,
    RendezvousHandler,
    RendezvousParameters,
)
from elastic.core.log import say
from elastic.core.plugin.extras import MissingExtraError

log = logging.getLogger(__name__)

# Seconds Ctrl-C waits for the read under way to end once its connections are closed,
# before the command exits anyway: closing wakes a blocked store call at once; only a
# call outside our sockets (a name lookup) can take longer, and it dies with the process.
CLOSE_GRACE = 2.0
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


def describe_job(
    backend: str,
    endpoint: str,
    run_id: str,
    opened: Callable[[RendezvousHandler], None] = lambda handler: None,
) -> JobStatus:
    """The job's status, read through a read-only handler that is shut down (its store
    connections closed) however this ends. ``opened(handler)``: told of the handler
    before it is used; raising from it stops here."""
    from elastic.core.rendezvous.registry import get_rendezvous_handler

    # torch's C++ logger prints a stack for a failed store connection; status reports
    # the failure in one line itself and starts no workers that would inherit this.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    params = RendezvousParameters(
        backend=backend,
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=1,
        max_nodes=1,
        read_only=True,
    )
    handler = get_rendezvous_handler(params)
    try:
        opened(handler)
        return handler.describe()
    finally:
        handler.shutdown()


class _Cancelled(Exception):
    """The main thread gave up on this read (Ctrl-C)."""


class _Reading:
    """One ``describe_job`` on a daemon thread; ``cancel`` (from the main thread) shuts
    its handler down, which wakes a store call blocked in it."""

    def __init__(self, backend: str, endpoint: str, run_id: str) -> None:
        self._lock = threading.Lock()
        self._handler: RendezvousHandler | None = None
        self._cancelled = False
        self._outcome: list[JobStatus | BaseException] = []
        # Waited on rather than joining the thread: Python 3.11's join, interrupted by
        # Ctrl-C, marks a thread still running as stopped (bpo-45274's fix), after which
        # a join no longer waits at all.
        self._done = threading.Event()
        threading.Thread(
            target=self._run, args=(backend, endpoint, run_id), name="status-read", daemon=True
        ).start()

    def _run(self, backend: str, endpoint: str, run_id: str) -> None:
        try:
            self._outcome.append(describe_job(backend, endpoint, run_id, self._opened))
        except BaseException as exc:  # handed to the main thread by ``result``
            self._outcome.append(exc)
        finally:
            self._done.set()

    def _opened(self, handler: RendezvousHandler) -> None:
        with self._lock:
            self._handler = handler
            if self._cancelled:
                raise _Cancelled

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            handler = self._handler
        if handler is not None:
            try:  # idempotent; the thread's own shutdown then does nothing
                handler.shutdown()
            except Exception as exc:  # leaving anyway: the process closes what is left
                log.debug("elastic status: shutting the handler down on Ctrl-C: %s", exc)
        self._done.wait(CLOSE_GRACE)

    def result(self) -> JobStatus:
        self._done.wait()  # a lock wait: Ctrl-C interrupts it at once
        (outcome,) = self._outcome
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def read_interruptibly(backend: str, endpoint: str, run_id: str) -> JobStatus:
    """``describe_job``, with Ctrl-C in the main thread seen at once wherever the read is
    (see the module docstring)."""
    reading = _Reading(backend, endpoint, run_id)
    try:
        return reading.result()
    except KeyboardInterrupt:
        reading.cancel()
        raise


def status_dict(status: JobStatus) -> dict[str, Any]:
    return {"schema": 1, **asdict(status)}


def age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s"


def render(status: JobStatus) -> str:
    formed = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(status.round_formed_at))
        if status.round_formed_at
        else "-"
    )
    budget = "?" if status.max_restarts is None else str(status.max_restarts)
    lines = [
        f"job {status.run_id} ({status.backend}): {status.state}",
        f"round {status.round}, formed {formed}; nodes {len(status.members)} "
        f"(min {status.min_nodes}, max {status.max_nodes}), {status.waiting} waiting",
        f"restarts used {status.restarts_used} of {budget}",
    ]
    headers = ("RANK", "HOST", "PID", "NPROC", "HEARTBEAT", "VERSIONS")
    rows = [
        (
            "-" if m.rank is None else str(m.rank),
            m.host,
            str(m.pid or "-"),
            str(m.local_world_size or "-"),
            age(m.heartbeat_age),
            " ".join(f"{k}={v}" for k, v in sorted(m.versions.items())),
        )
        for m in sorted(status.members, key=lambda m: (m.rank is None, m.rank or 0))
    ]
    widths = [max(len(c) for c in col) for col in zip(headers, *rows, strict=True)]
    for row in (headers, *rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    if status.root_cause:
        rc = status.root_cause
        extra = rc.get("extra") if isinstance(rc.get("extra"), dict) else {}
        # A node whose workers failed before it joined left alone; the job went on.
        left = " (before it joined: that node left, the job went on)"
        lines.append(
            f"root cause: rank {rc.get('rank')} on {rc.get('host')}"
            f"{left if extra.get(BEFORE_JOINING) else ''} "
            f"exit {rc.get('exit_code')} {rc.get('signal') or ''} {rc.get('message', '')}".rstrip()
        )
        lines += stack_lines(rc)
    return "\n".join(lines)


def stack_lines(root_cause: dict[str, Any]) -> list[str]:
    """The root cause's main-thread stack, when the agent dumped it (a hung worker)."""
    extra = root_cause.get("extra")
    stacks = extra.get("stacks") if isinstance(extra, dict) else None
    if not isinstance(stacks, str) or not stacks:
        return []
    block: list[str] = []
    for line in stacks.splitlines():
        if block and line.startswith("Thread "):
            break  # the main thread comes first; the rest is in --json
        block.append(f"  {line}")
    return block


@click.command("status")
@flag("--rdzv-backend", default="c10d", show_default=True, help="Rendezvous backend name.")
@flag("--rdzv-endpoint", required=True, help="Rendezvous endpoint, HOST[:PORT].")
@flag("--rdzv-id", required=True, help="The job id.")
@click.option("--json", "as_json", is_flag=True, help="Print the documented JSON schema.")
@click.option("--watch", type=float, default=None, help="Redraw every SECONDS until interrupted.")
def status_command(
    rdzv_backend: str, rdzv_endpoint: str, rdzv_id: str, as_json: bool, watch: float | None
) -> None:
    """Show a running job: its state, round, members, restarts and root cause."""
    if watch is not None and watch <= 0:
        raise click.BadParameter("expected a positive number of seconds", param_hint="'--watch'")
    try:
        while True:
            try:
                status = read_interruptibly(rdzv_backend, rdzv_endpoint, rdzv_id)
            except (RendezvousError, LookupError) as exc:
                say(f"elastic status: error: {exc}", logging.ERROR)
                # A backend installed without its extra is the user's setup to fix: 2.
                sys.exit(2 if isinstance(exc.__cause__, MissingExtraError) else 1)
            text = json.dumps(status_dict(status), indent=2) if as_json else render(status)
            if watch is None:
                click.echo(text)
                return
            click.echo("\x1b[2J\x1b[H" + text)  # clear the screen, cursor home
            time.sleep(watch)
    except KeyboardInterrupt:  # Ctrl-C ends --watch (or a slow read), wherever it lands
        sys.exit(INTERRUPTED)
