"""The agent's end of torch's FileTimer protocol (``TORCHELASTIC_ENABLE_FILE_TIMER=1``).

torch's ``FileTimerClient`` (in a worker) opens the named pipe named in
``TORCHELASTIC_TIMER_FILE`` without blocking, writes one JSON line of at most
``PIPE_BUF`` bytes and closes it::

    {"version": 1, "pid": 1234, "scope_id": "load_batch", "expiration_time": 1.7e9,
     "signal": 9}

A negative ``expiration_time`` releases the ``(pid, scope_id)`` timer. When a timer
expires, the process ``pid`` gets the ``signal`` it asked for (none when it is 0 or
less), as with torch's ``FileTimerServer``; unlike it, the server never kills itself or
its agent (torch 2.13's SIGKILLs the launcher), and only kills a process that belongs
to one of its workers (``owns(pid)``): anyone who can write the pipe could otherwise make
the agent kill any process of the user.

This is a reimplementation of the wire format, not an import of torch's server: the agent
never imports torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import stat
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from elastic.core.log import say

ENV_ENABLE = "TORCHELASTIC_ENABLE_FILE_TIMER"
ENV_FILE = "TORCHELASTIC_TIMER_FILE"
INTERVAL = 0.1  # seconds between expiry checks (torch's agent uses max_interval=0.1)


class TimerRequest(NamedTuple):  # a named tuple: see AttemptEnd in core/agent/outcome.py
    pid: int
    scope_id: str
    expiration_time: float
    signal: int
    version: int = 1

    @classmethod
    def from_json(cls, line: str) -> TimerRequest:
        data = json.loads(line)
        pid, scope, when, sig = (data[k] for k in ("pid", "scope_id", "expiration_time", "signal"))
        if not isinstance(pid, int) or not isinstance(scope, str):
            raise ValueError("pid must be an integer and scope_id a string")
        return cls(pid, scope, float(when), int(sig), int(data.get("version", 1)))


class FileTimerServer:
    """Reads timer requests from a named pipe on a daemon thread and fires expired ones.

    ``on_request(req)`` is called for every request (progress, for the stall watchdog);
    ``on_expired(req, scopes)`` for the first expired timer of a process that asked for
    a signal (``scopes``: every expired scope of that process), before the signal is sent;
    ``owns(pid)`` says whether ``pid`` belongs to one of the agent's workers.
    """

    def __init__(
        self,
        path: str,
        *,
        owns: Callable[[int], bool],
        on_request: Callable[[TimerRequest], None] | None = None,
        on_expired: Callable[[TimerRequest, list[str]], None] | None = None,
        interval: float = INTERVAL,
    ) -> None:
        self.path = path
        self._owns = owns
        self._on_request = on_request or (lambda req: None)
        self._on_expired = on_expired or (lambda req, scopes: None)
        self._interval = interval
        self._timers: dict[tuple[int, str], TimerRequest] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fds: list[int] = []
        self.requests = 0
        self.expired = 0
        self.bad_requests = 0

    # --- lifecycle ------------------------------------------------------------------------
    def start(self) -> FileTimerServer:
        """Create the pipe (replacing whatever is at ``path``, as torch does) and serve."""
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISDIR(os.lstat(self.path).st_mode):
                raise IsADirectoryError(f"{self.path} is a directory, not a timer file")
            os.unlink(self.path)
        os.mkfifo(self.path, 0o600)
        # Our own writer end keeps the pipe open between clients: reads then block in
        # select() instead of returning end-of-file in a busy loop.
        reader = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        self._fds = [reader, os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)]
        self._thread = threading.Thread(target=self._run, name="file-timer", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def clear(self) -> None:
        """Forget every timer (a new attempt's workers start with none)."""
        with self._lock:
            self._timers.clear()

    def armed(self, now: float | None = None) -> dict[int, float]:
        """pid -> the earliest unexpired deadline of its timers (unix time)."""
        now = time.time() if now is None else now
        with self._lock:
            result: dict[int, float] = {}
            for (pid, _), req in self._timers.items():
                if req.expiration_time > now:
                    result[pid] = min(result.get(pid, req.expiration_time), req.expiration_time)
            return result

    # --- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        buffer = b""
        next_sweep = time.monotonic() + 1.0
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._fds[0]], [], [], self._interval)
                if ready:
                    chunk = os.read(self._fds[0], 65536)
                    *lines, buffer = (buffer + chunk).split(b"\n")
                    for line in lines:
                        self._handle(line)
                self._fire(time.time())
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + 1.0
                    self._sweep()
            except (OSError, ValueError, IndexError):
                if self._stop.is_set():
                    return
                time.sleep(self._interval)
            except Exception as exc:  # a callback's bug must not end the server
                say(f"elastic: file timer server: {exc!r}", logging.WARNING)

    def _handle(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            req = TimerRequest.from_json(line.decode("utf-8", errors="replace"))
        except (ValueError, KeyError, TypeError):
            self.bad_requests += 1
            if self.bad_requests == 1:
                say(f"elastic: ignored a bad timer request: {line[:200]!r}", logging.WARNING)
            return
        self.requests += 1
        with self._lock:
            if req.expiration_time < 0:
                self._timers.pop((req.pid, req.scope_id), None)
            else:
                self._timers[(req.pid, req.scope_id)] = req
        self._on_request(req)

    def _fire(self, now: float) -> None:
        with self._lock:
            due: dict[int, list[TimerRequest]] = {}
            for req in self._timers.values():
                if req.expiration_time <= now:
                    due.setdefault(req.pid, []).append(req)
            for pid, reqs in due.items():  # expired timers are handled once, like torch's
                for req in reqs:
                    del self._timers[(pid, req.scope_id)]
        for pid, reqs in due.items():
            reqs.sort(key=lambda r: r.expiration_time)
            chosen = next((r for r in reqs if r.signal > 0), None)
            scopes = [r.scope_id for r in reqs]
            if chosen is None:
                say(
                    f"elastic: timer {', '.join(scopes)} of pid {pid} expired; it asked for"
                    " no signal, so it is left running",
                    logging.WARNING,
                )
                continue
            if not self._owns(pid):
                say(
                    f"elastic: timer {chosen.scope_id!r} of pid {pid} expired, but pid {pid}"
                    " is not one of this agent's workers: not killed",
                    logging.WARNING,
                )
                continue
            self.expired += 1
            self._on_expired(chosen, scopes)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, chosen.signal)

    def _sweep(self) -> None:
        """Drop the timers of processes that are gone."""
        with self._lock:
            for key in list(self._timers):
                try:
                    os.kill(key[0], 0)
                except ProcessLookupError:
                    del self._timers[key]
                except PermissionError:
                    pass
