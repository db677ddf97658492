"""Worker error files: the JSON a decorated worker leaves behind when it dies of an
uncaught exception, at the path the agent put in ``TORCHELASTIC_ERROR_FILE``.

We write torch's format so torch's own reader (``ProcessFailure``) accepts our files, and
we read torch's files, so a worker decorated with either ``elastic.record`` or torch's
``@record`` is reported the same way::

    {"message": {"message": "ValueError: boom",
                 "extraInfo": {"py_callstack": "Traceback ...",
                               "timestamp": "1700000000",
                               "timestamp_precise": "1700000000.123456"}}}

torch parses ``timestamp`` with ``int()``, so it must stay a whole number of seconds; the
sub-second time the job-wide root cause needs goes into our own ``timestamp_precise``
key, which torch ignores. This module never imports torch.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback as tb
from types import TracebackType
from typing import Any, NamedTuple

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
PRECISE_KEY = "timestamp_precise"


class ErrorFileContent(NamedTuple):  # a named tuple: see AttemptEnd in core/agent/outcome.py
    """What an error file says. ``timestamp`` is unix time, or None when the file has
    none; ``precise`` is False when it only has torch's whole-second timestamp."""

    message: str
    traceback: str
    timestamp: float | None
    precise: bool = False


def error_file_data(
    exc: BaseException, now: float | None = None, traceback: TracebackType | None = None
) -> dict[str, Any]:
    """The JSON document torch's ``ErrorHandler.record_exception`` writes, plus our
    sub-second timestamp. ``traceback`` overrides ``exc.__traceback__`` (the decorator
    passes it without its own wrapper frame)."""
    now = time.time() if now is None else now
    trace = traceback if traceback is not None else exc.__traceback__
    callstack = "".join(tb.format_exception(type(exc), exc, trace))
    return {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": callstack,
                "timestamp": str(int(now)),
                PRECISE_KEY: repr(now),
            },
        }
    }


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so a reader sees the old file or the whole new one,
    never a torn write: temp file in the same directory, fsync, rename."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_error_file(path: str, exc: BaseException, traceback: TracebackType | None = None) -> None:
    """Record ``exc`` (with its traceback) at ``path`` in torch's format, atomically."""
    write_text_atomic(path, json.dumps(error_file_data(exc, traceback=traceback)))


def _parse_time(value: Any) -> tuple[float | None, bool]:
    """(unix time, has a fractional part) from a number or numeric string."""
    if value is None or isinstance(value, bool):
        return None, False
    try:
        t = float(value)
    except (TypeError, ValueError):
        return None, False
    if t != t or t in (float("inf"), float("-inf")):  # NaN / inf: unusable
        return None, False
    return t, not t.is_integer()


def parse_error_data(data: Any, raw: str) -> ErrorFileContent:
    """Interpret a decoded error file; anything unexpected becomes a raw-text message."""
    if not isinstance(data, dict) or "message" not in data:
        return ErrorFileContent(message=raw.strip(), traceback="", timestamp=None)
    message = data["message"]
    if isinstance(message, str):
        # torch's "new message format": {"message": str, "timestamp": ...}
        ts, precise = _parse_time(data.get(PRECISE_KEY, data.get("timestamp")))
        return ErrorFileContent(message, str(data.get("traceback", "")), ts, precise)
    if not isinstance(message, dict):
        return ErrorFileContent(message=raw.strip(), traceback="", timestamp=None)
    extra = message.get("extraInfo")
    extra = extra if isinstance(extra, dict) else {}
    ts, precise = _parse_time(extra.get(PRECISE_KEY))
    if ts is None:
        ts, precise = _parse_time(extra.get("timestamp"))
    text = message.get("message")
    return ErrorFileContent(
        message=str(text) if text is not None else "",
        traceback=str(extra.get("py_callstack") or ""),
        timestamp=ts,
        precise=precise,
    )


def read_error_file(path: str) -> ErrorFileContent | None:
    """Read an error file written by ``elastic.record`` or torch's ``@record``.

    None when the file is absent or empty. Never raises on garbage: an unreadable or
    unexpected file gives a content whose message is the raw text.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read().decode("utf-8", errors="replace")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    except OSError as exc:
        return ErrorFileContent(
            message=f"unreadable error file: {exc}", traceback="", timestamp=None
        )
    if not raw.strip():
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return ErrorFileContent(message=raw.strip(), traceback="", timestamp=None)
    return parse_error_data(data, raw)


def failure_time(content: ErrorFileContent | None, observed: float) -> float:
    """The best estimate of when a worker failed.

    A precise file timestamp wins. torch's files only have whole seconds ``T``, so the
    failure happened in ``[T, T+1)``; the time the agent saw the exit is then the better
    (sub-second) estimate, clamped into that window because the agent may notice late.
    Without a file timestamp, the observed time is all we have.
    """
    if content is None or content.timestamp is None:
        return observed
    if content.precise:
        return content.timestamp
    return min(max(observed, content.timestamp), content.timestamp + 0.999)
