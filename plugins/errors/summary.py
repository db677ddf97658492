"""Rendering a failed run's ``FailureSummary``: the table printed on stderr and the JSON
written by ``--error-summary``.

Modelled on torchrun's ``ChildFailedError`` message, but the root cause comes first (it
is what the reader needs), times have milliseconds, a signal is named (with a hint when
it is SIGKILL, the OOM killer's signal), and failures after the root cause say how much
later they happened, which is usually enough to see they were caused by it.
"""

from __future__ import annotations

import json
import signal
from datetime import datetime
from typing import Any

from elastic.core.interfaces.failures import (
    FailureRecord,
    FailureSummary,
    failed_before_joining,
    signal_number,
)
from elastic.core.workers.errorfile import write_text_atomic

SUMMARY_FORMAT = "elastic.failure-summary/1"
WIDTH = 72
# Failures other than the root cause are usually fallout (a peer's collective failing);
# show only the end of their tracebacks to keep the root cause on screen.
OTHER_TRACEBACK_LINES = 6
NO_TRACEBACK_HINT = (
    "<not captured: the worker wrote no error file (decorate its entry function with"
    " @elastic.record or torch's @record) and its stderr went to the console (capture it"
    " with --log-dir DIR -r 3)>"
)


def format_time(timestamp: float) -> str:
    """Local time with milliseconds and UTC offset, e.g. ``2024-05-01 12:00:00.123 +0000``."""
    try:
        dt = datetime.fromtimestamp(timestamp).astimezone()
    except (OverflowError, OSError, ValueError):
        return f"{timestamp!r} (unix time)"
    return dt.strftime("%Y-%m-%d %H:%M:%S.") + f"{dt.microsecond // 1000:03d} " + dt.strftime("%z")


def signal_name(record: FailureRecord) -> str | None:
    signum = signal_number(record)
    if signum is None:
        return None
    if record.signal:
        return record.signal
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(record: FailureRecord) -> str:
    """``exit code 1`` or ``SIGKILL (signal 9; possible OOM kill ...)``."""
    name = signal_name(record)
    if name is None:
        return f"exit code {record.exit_code}"
    signum = signal_number(record)
    text = f"{name} (signal {signum})"
    extra = record.extra if isinstance(record.extra, dict) else {}
    if "stall" in extra or "file_timer" in extra:  # the message says why
        text += " - killed by the agent" if "stall" in extra else " - sent by the agent"
    elif name == "SIGKILL":
        text += " - possible OOM kill: check the host's memory and `dmesg`"
    return text


def traceback_label(record: FailureRecord) -> str:
    """Where the traceback text came from: the error file, or the tail of stderr the
    agent substitutes for an undecorated worker."""
    source = record.extra.get("traceback_source") if isinstance(record.extra, dict) else None
    if source == "stderr" or (source is None and not record.error_file and record.traceback):
        return "stderr"
    return "traceback"


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line if line else line for line in text.rstrip("\n").split("\n"))


def _tail(text: str, lines: int) -> str:
    parts = text.rstrip("\n").split("\n")
    if len(parts) <= lines:
        return text
    return "\n".join([f"... ({len(parts) - lines} lines omitted)", *parts[-lines:]])


def render_failure(record: FailureRecord, root: FailureRecord | None = None) -> str:
    """One failure as aligned ``field : value`` lines. With ``root`` (the root cause) the
    record is shown as a later failure: delay to the root cause, shortened traceback."""
    rank = f"{record.rank} (local rank {record.local_rank}"
    if record.group_rank is not None:
        rank += f", node rank {record.group_rank}"
    rank += f", role {record.role})"
    time_text = format_time(record.timestamp)
    if root is not None:
        time_text += f" (+{max(record.timestamp - root.timestamp, 0.0):.3f}s after root cause)"
    rows = [
        ("time", time_text),
        ("host", record.host + (f" (node {record.node_id})" if record.node_id else "")),
        ("rank", rank),
        ("pid", str(record.pid) if record.pid is not None else "<unknown>"),
        ("exit", describe_exit(record)),
    ]
    if record.attempt:
        rows.append(("attempt", str(record.attempt)))
    if record.error_file:
        rows.append(("error file", record.error_file))
    if record.stderr_path:
        rows.append(("stderr log", record.stderr_path))
    name = signal_name(record)
    rows.append(("message", record.message or (f"killed by {name}" if name else "<none>")))
    lines = [f"  {key:<10} : {value}" for key, value in rows]
    if record.traceback:
        text = record.traceback if root is None else _tail(record.traceback, OTHER_TRACEBACK_LINES)
        label = traceback_label(record)
        note = " (last lines; the worker wrote no error file)" if label == "stderr" else ""
        lines.append(f"  {label:<10} :{note}")
        lines.append(_indent(text))
    stacks = record.extra.get("stacks") if isinstance(record.extra, dict) else None
    if not record.traceback and root is None and not stacks:
        lines.append(f"  {'traceback':<10} : {NO_TRACEBACK_HINT}")
    if stacks:  # dumped by the agent before it killed a hung worker (core/watchdog/stacks.py)
        shown = stacks if root is None else main_thread(stacks)
        note = "every thread" if root is None else "main thread; every thread in the JSON"
        lines.append(f"  {'stacks':<10} : ({note}, most recent call first)")
        lines.append(_indent(shown))
    return "\n".join(lines)


def main_thread(stacks: str) -> str:
    """The first block of a stack dump (the agent puts the main thread first)."""
    block = []
    for line in stacks.splitlines():
        if block and line.startswith("Thread "):
            break
        block.append(line)
    return "\n".join(block)


def render_summary(summary: FailureSummary) -> str:
    """The whole table: root cause first, then every other failure in time order."""
    root = summary.root_cause
    title = f"elastic run {summary.run_id!r} FAILED (exit code {summary.exit_code})"
    heading = "Root cause (first failure in the job, last round):"
    if failed_before_joining(root):  # only this node left (core/agent/joining.py)
        title = (
            f"elastic run {summary.run_id!r}: this node LEFT the job (exit code "
            f"{summary.exit_code}); the job goes on without it"
        )
        heading = "Cause (this node's workers failed at start-up, before it had joined):"
    parts = [
        "=" * WIDTH,
        title,
        "-" * WIDTH,
        heading,
        render_failure(root),
        "-" * WIDTH,
    ]
    if summary.others:
        parts.append(f"Other failures ({len(summary.others)}, after the root cause):")
        for idx, other in enumerate(summary.others, start=1):
            parts.append(f"[{idx}]")
            parts.append(render_failure(other, root=root))
    else:
        parts.append("Other failures: none")
    parts.append("=" * WIDTH)
    return "\n".join(parts)


def summary_dict(summary: FailureSummary) -> dict[str, Any]:
    """The JSON document: the summary's fields plus derived, human-facing ones."""
    data = summary.to_dict()
    data["format"] = SUMMARY_FORMAT
    records = [("root_cause", summary.root_cause, data["root_cause"])]
    records += [("other", rec, d) for rec, d in zip(summary.others, data["others"], strict=True)]
    for _, rec, d in records:
        d["signal_name"] = signal_name(rec)
        d["time"] = format_time(rec.timestamp)
    return data


def write_summary_json(path: str, summary: FailureSummary) -> None:
    """Write ``summary_dict(summary)`` to ``path`` atomically (temp file + rename)."""
    write_text_atomic(path, json.dumps(summary_dict(summary), indent=2, sort_keys=True) + "\n")
