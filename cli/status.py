"""``elastic status``: what a running job looks like, read from its rendezvous backend.

Read-only: the handler is created with ``read_only=True``, so it never joins, writes or
hosts a store. The JSON schema (``--json``) is ``JobStatus`` as a dict, version 1:
``{"schema": 1, "run_id", "backend", "state", "round", "round_formed_at", "min_nodes",
"max_nodes", "waiting", "restarts_used", "max_restarts", "root_cause",
"members": [{"node_id", "host", "rank", "pid", "local_world_size", "heartbeat_age",
"versions"}]}``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import asdict
from typing import Any

import click
from elastic.cli.options import flag
from elastic.core.interfaces.rendezvous import JobStatus, RendezvousError, RendezvousParameters
from elastic.core.log import say


def describe_job(backend: str, endpoint: str, run_id: str) -> JobStatus:
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
        return handler.describe()
    finally:
        handler.shutdown()


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
        lines.append(
            f"root cause: rank {rc.get('rank')} on {rc.get('host')} "
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
                status = describe_job(rdzv_backend, rdzv_endpoint, rdzv_id)
            except (RendezvousError, LookupError) as exc:
                say(f"elastic status: error: {exc}", logging.ERROR)
                sys.exit(1)
            text = json.dumps(status_dict(status), indent=2) if as_json else render(status)
            if watch is None:
                click.echo(text)
                return
            click.echo("\x1b[2J\x1b[H" + text)  # clear the screen, cursor home
            time.sleep(watch)
    except KeyboardInterrupt:  # Ctrl-C ends --watch, wherever it lands
        return
