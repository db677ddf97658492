"""Python stacks of live workers, without ptrace: ask, read, explain.

The agent puts ``core/workers/boot`` first on each worker's ``PYTHONPATH``; its
``sitecustomize.py`` registers ``faulthandler`` on ``DUMP_SIGNAL`` (``SIGURG``) with a
per-worker file named in ``ELASTIC_STACK_FILE``. To dump, the agent notes each file's
size, sends the signal and reads what was appended (faulthandler writes it from the
signal handler, so a worker blocked in C code, a sleep or a collective answers at once).

``SIGURG`` was chosen because its default action is to ignore it: a worker that did not
register (not Python, ``python -I``/``-E``, a user handler replaced ours) is not hurt,
and programs rarely use it (out-of-band socket data). Only the worker process itself is
signalled, not its children.

The agent adds the source lines (the files are local) and decides whether the main
thread is **waiting in a collective** (its innermost frames are in ``torch/distributed``
or DDP): such a rank waits for a peer and is not blamed for a hang.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import re
import signal
import time
from dataclasses import dataclass, field

from elastic.core.workers import boot

DUMP_SIGNAL = signal.SIGURG
ENV_FILE = "ELASTIC_STACK_FILE"
ENV_SIGNAL = "ELASTIC_STACK_SIGNAL"
BOOT_DIR = os.path.dirname(os.path.abspath(boot.__file__))  # put first on PYTHONPATH
DUMP_WAIT = 1.0  # seconds to wait for every worker's dump
_SETTLE = 0.05  # a dump file that stopped growing for this long is complete

_HEADER = re.compile(r"^# elastic: pid (\d+) main thread (0x[0-9a-f]+)$", re.M)
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
# Frames that mean "inside a collective or a wait for peers" (innermost frames only):
# elastic.train's own collectives wait in ``training/bounded.py`` (in slices).
_WAITING = ("/torch/distributed/", "/torch/nn/parallel/distributed.py", "/training/bounded.py")
_WAITING_DEPTH = 2


def worker_env(stack_file: str, pythonpath: str | None) -> dict[str, str]:
    """The variables that make a worker register the dump handler at start-up."""
    path = BOOT_DIR if not pythonpath else os.pathsep.join([BOOT_DIR, pythonpath])
    return {ENV_FILE: stack_file, ENV_SIGNAL: str(int(DUMP_SIGNAL)), "PYTHONPATH": path}


@dataclass
class ThreadStack:
    ident: str
    main: bool = False
    frames: list[tuple[str, int, str]] = field(default_factory=list)  # innermost first


@dataclass
class StackDump:
    """One worker's dump: its threads (main thread first) and what they show."""

    threads: list[ThreadStack]
    taken_at: float

    @property
    def main(self) -> ThreadStack | None:
        return next((t for t in self.threads if t.main), self.threads[0] if self.threads else None)

    def waiting_in(self) -> str | None:
        """``file:line in fn`` of the collective the main thread waits in, else None."""
        main = self.main
        for path, line, fn in main.frames[:_WAITING_DEPTH] if main else []:
            if any(part in path.replace(os.sep, "/") for part in _WAITING):
                return f"{_short(path)}:{line} in {fn}"
        return None

    def where(self) -> str:
        """The main thread's innermost frame, with its source line when readable."""
        main = self.main
        if main is None or not main.frames:
            return "<no Python frame>"
        path, line, fn = main.frames[0]
        source = linecache.getline(path, line).strip()
        return f"{_short(path)}:{line} in {fn}" + (f": {source}" if source else "")

    def render(self, main_only: bool = False) -> str:
        """Tracebacks in faulthandler's order (most recent call first), with source."""
        blocks = []
        for t in self.threads:
            if main_only and not t.main:
                continue
            title = "Main thread" if t.main else "Thread"
            lines = [f"{title} {t.ident} (most recent call first):"]
            for path, line, fn in t.frames:
                lines.append(f'  File "{path}", line {line} in {fn}')
                source = linecache.getline(path, line).strip()
                if source:
                    lines.append(f"    {source}")
            blocks.append("\n".join(lines))
        return "\n".join(blocks)


def _short(path: str) -> str:
    marker = f"{os.sep}site-packages{os.sep}"
    return path.split(marker, 1)[1] if marker in path else path


def parse_dump(text: str, main_ident: str | None) -> list[ThreadStack]:
    """faulthandler's output -> threads, the main one (by ident) first."""
    threads: list[ThreadStack] = []
    for line in text.splitlines():
        head = _THREAD.match(line)
        if head:
            if any(t.ident == head.group(2) for t in threads):
                break  # a second dump appended meanwhile: keep the first
            threads.append(ThreadStack(head.group(2), main=head.group(2) == main_ident))
            continue
        frame = _FRAME.match(line)
        if frame and threads:
            threads[-1].frames.append((frame.group(1), int(frame.group(2)), frame.group(3)))
    if threads and not any(t.main for t in threads) and main_ident is None:
        threads[-1].main = True  # CPython lists the oldest thread (main) last
    threads.sort(key=lambda t: not t.main)
    return threads


def _main_ident(header: str, pid: int) -> str | None:
    for found_pid, ident in _HEADER.findall(header):
        if int(found_pid) == pid:
            return ident
    return None


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def dump_stacks(
    targets: dict[int, tuple[int, str]], wait: float = DUMP_WAIT
) -> dict[int, StackDump]:
    """Ask every worker in ``targets`` (local rank -> (pid, stack file)) for its stacks
    and return those that answered within ``wait`` seconds."""
    offsets = {rank: _size(path) for rank, (_, path) in targets.items()}
    asked = {}
    for rank, (pid, _) in targets.items():
        if offsets[rank] <= 0:
            continue  # the worker never registered (its header is not there)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, DUMP_SIGNAL)
            asked[rank] = offsets[rank]
    deadline = time.monotonic() + wait
    sizes = dict(asked)
    stable: dict[int, float] = {}
    while asked and time.monotonic() < deadline:
        time.sleep(0.01)
        now = time.monotonic()
        for rank in list(asked):
            size = _size(targets[rank][1])
            if size != sizes[rank]:
                sizes[rank], stable[rank] = size, now
            elif size > asked[rank] and now - stable.get(rank, now) >= _SETTLE:
                del asked[rank]
    dumps = {}
    for rank, (pid, path) in targets.items():
        start = offsets[rank]
        if start <= 0:
            continue
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                header = f.read(start)
                text = f.read()
        except OSError:
            continue
        threads = parse_dump(text, _main_ident(header, pid))
        if threads:
            dumps[rank] = StackDump(threads, time.time())
    return dumps
