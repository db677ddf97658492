"""Where worker output goes, and reading back what a failed worker left behind.

The layout is torchrun's, so tools that know it keep working::

    LOG_DIR/<run_id>_<suffix>/attempt_<restart_count>/<local_rank>/stdout.log
                                                                  /stderr.log
                                                                  /error.json

``redirects`` sends a stream to its file instead of the console; ``tee`` sends it to the
file and also to the agent's console with a ``[<role><local_rank>]:`` prefix (the agent
tails the file, as torchrun does). A stream neither redirected nor teed goes straight to
the console, unprefixed, exactly as torchrun 2.13 does. ``local_ranks_filter`` limits
which local ranks reach the console at all; the others still write their files.
"""

from __future__ import annotations

import enum
import os
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import TextIO

from elastic.core.interfaces.failures import FailureRecord
from elastic.core.interfaces.spec import Worker, WorkerGroup, WorkerSpec
from elastic.core.workers.errorfile import failure_time, read_error_file
from elastic.core.workers.process import CONSOLE, signal_name


class Std(enum.IntFlag):
    """Which standard streams a redirect or tee applies to (torch's values)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


@dataclass
class WorkerLogs:
    """One worker's destinations for one attempt (``CONSOLE``, a path or os.devnull)."""

    stdout: str = CONSOLE
    stderr: str = CONSOLE
    error_file: str = ""
    tee_stdout: bool = False
    tee_stderr: bool = False

    def stdout_file(self) -> str | None:
        return self.stdout if self.stdout not in (CONSOLE, os.devnull) else None

    def stderr_file(self) -> str | None:
        return self.stderr if self.stderr not in (CONSOLE, os.devnull) else None


@dataclass
class LogLayout:
    """Decides every worker's destinations, attempt by attempt, under one run directory."""

    run_id: str
    log_dir: str | None = None
    redirects: dict[int, int] = field(default_factory=dict)
    tee: dict[int, int] = field(default_factory=dict)
    local_ranks_filter: frozenset[int] | None = None
    suffix: str | None = None
    run_dir: str | None = None
    attempt_dir: str | None = None  # the current attempt's directory, once made
    made_temp: bool = field(default=False, init=False)  # log_dir is a temp dir we made

    def __post_init__(self) -> None:
        if self.log_dir == os.devnull:
            return
        if not self.log_dir:
            self.log_dir = tempfile.mkdtemp(prefix="torchelastic_")
            self.made_temp = True
        elif os.path.isfile(self.log_dir):
            raise NotADirectoryError(f"log_dir: {self.log_dir} is a file")
        os.makedirs(self.log_dir, exist_ok=True)

    @classmethod
    def for_spec(cls, run_id: str, spec: WorkerSpec, suffix: str | None = None) -> LogLayout:
        """The layout ``spec`` asks for (``--log-dir``, ``--redirects``, ``--tee``, ...)."""
        return cls(
            run_id, spec.log_dir, spec.redirects, spec.tee, spec.local_ranks_filter, suffix=suffix
        )

    def _ensure_run_dir(self) -> str:
        if self.run_dir is None:
            assert self.log_dir is not None
            if self.suffix is not None:
                self.run_dir = os.path.join(self.log_dir, f"{self.run_id}_{self.suffix}")
                os.makedirs(self.run_dir, exist_ok=True)
            else:
                self.run_dir = tempfile.mkdtemp(prefix=f"{self.run_id}_", dir=self.log_dir)
        return self.run_dir

    def attempt(self, restart_count: int, nprocs: int) -> dict[int, WorkerLogs]:
        """Fresh destinations for one attempt (a re-used attempt directory is emptied)."""
        if self.log_dir == os.devnull:
            return {r: self._console_only(r) for r in range(nprocs)}
        attempt_dir = os.path.join(self._ensure_run_dir(), f"attempt_{restart_count}")
        shutil.rmtree(attempt_dir, ignore_errors=True)
        os.makedirs(attempt_dir)
        self.attempt_dir = attempt_dir
        result = {}
        for rank in range(nprocs):
            rank_dir = os.path.join(attempt_dir, str(rank))
            os.mkdir(rank_dir)
            tee = Std(self.tee.get(rank, 0))
            redirect = Std(self.redirects.get(rank, 0)) | tee
            shown = self.local_ranks_filter is None or rank in self.local_ranks_filter
            logs = WorkerLogs(error_file=os.path.join(rank_dir, "error.json"))
            for flag, name in ((Std.OUT, "stdout"), (Std.ERR, "stderr")):
                if redirect & flag:
                    dest = os.path.join(rank_dir, f"{name}.log")
                    setattr(logs, f"tee_{name}", bool(tee & flag) and shown)
                else:
                    dest = CONSOLE if shown else os.devnull
                setattr(logs, name, dest)
            result[rank] = logs
        return result

    def tidy(self) -> None:
        """Remove the temporary directory this layout made when nothing was written under
        it: torchrun leaves one per run in the temp dir, thousands after a while. A
        directory the user named, or one that holds a log or an error file, stays."""
        if not self.made_temp or self.log_dir is None:
            return
        if any(files for _, _, files in os.walk(self.log_dir)):
            return
        shutil.rmtree(self.log_dir, ignore_errors=True)

    def _console_only(self, rank: int) -> WorkerLogs:
        shown = self.local_ranks_filter is None or rank in self.local_ranks_filter
        dest = CONSOLE if shown else os.devnull
        return WorkerLogs(stdout=dest, stderr=dest, error_file="")


class LogTailer:
    """Copies teed log files to the agent's console, line by line, with a prefix.

    One thread for all files of an attempt. Lines are only written whole; ``stop`` drains
    what the workers wrote before returning, so nothing a dead worker said is lost.
    """

    def __init__(
        self,
        sources: list[tuple[str, str, str]],
        interval: float = 0.1,
        duplicates: dict[str, tuple[TextIO, tuple[str, ...]]] | None = None,
    ) -> None:
        """``sources``: (path, prefix, "stdout" or "stderr"). ``duplicates``: per stream,
        a file that also gets each prefixed line containing any of the filter strings
        (torchrun's --duplicate-stdout-filters / --duplicate-stderr-filters)."""
        self._sources = sources
        self._interval = interval
        self._duplicates = duplicates or {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LogTailer:
        if self._sources:
            self._thread = threading.Thread(target=self._run, name="elastic-tee", daemon=True)
            self._thread.start()
        return self

    @staticmethod
    def _dst(stream: str) -> TextIO:
        return sys.stdout if stream == "stdout" else sys.stderr

    def _run(self) -> None:
        files: dict[int, object] = {}
        partial = ["" for _ in self._sources]
        try:
            while True:
                finishing = self._stop.is_set()
                for i, (path, prefix, stream) in enumerate(self._sources):
                    f = files.get(i)
                    if f is None:
                        try:
                            f = files[i] = open(path, errors="replace")  # noqa: SIM115
                        except FileNotFoundError:
                            continue
                    chunk = f.read()  # type: ignore[attr-defined]
                    if not chunk:
                        continue
                    text = partial[i] + chunk
                    *lines, partial[i] = text.split("\n")
                    if lines:
                        self._emit(stream, prefix, lines)
                if finishing:
                    break
                self._stop.wait(self._interval)
            for i, (_, prefix, stream) in enumerate(self._sources):
                if partial[i]:
                    self._emit(stream, prefix, [partial[i]])
        finally:
            for f in files.values():
                f.close()  # type: ignore[attr-defined]
            for copy, _ in self._duplicates.values():
                copy.close()

    def _emit(self, stream: str, prefix: str, lines: list[str]) -> None:
        dst = self._dst(stream)
        dst.write("".join(f"{prefix}{line}\n" for line in lines))
        dst.flush()
        duplicate = self._duplicates.get(stream)
        if duplicate is not None:
            copy, needles = duplicate
            matching = [line for line in lines if any(n in line for n in needles)]
            if matching:
                copy.write("".join(f"{prefix}{line}\n" for line in matching))
                copy.flush()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


def start_tailer(
    role: str,
    logs: dict[int, WorkerLogs],
    interval: float = 0.1,
    *,
    attempt_dir: str | None = None,
    stdout_filters: tuple[str, ...] = (),
    stderr_filters: tuple[str, ...] = (),
) -> LogTailer:
    """Tail every teed stream of an attempt, prefixed ``[<role><local_rank>]:``; with
    filters, teed lines that match also go to ``attempt_dir/filtered_std{out,err}.log``."""
    duplicates: dict[str, tuple[TextIO, tuple[str, ...]]] = {}
    if attempt_dir is not None:
        for stream, needles in (("stdout", stdout_filters), ("stderr", stderr_filters)):
            if needles:
                path = os.path.join(attempt_dir, f"filtered_{stream}.log")
                duplicates[stream] = (open(path, "w", errors="replace"), needles)  # noqa: SIM115
    sources = []
    for rank, wl in sorted(logs.items()):
        prefix = f"[{role}{rank}]:"
        if wl.tee_stdout:
            sources.append((wl.stdout, prefix, "stdout"))
        if wl.tee_stderr:
            sources.append((wl.stderr, prefix, "stderr"))
    return LogTailer(sources, interval, duplicates).start()


def tail_lines(path: str | None, n: int = 20, max_bytes: int = 64 * 1024) -> str:
    """The last ``n`` non-blank-ended lines of a log file ("" when there is none)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(size - max_bytes, 0))
            data = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = data.splitlines()
    while lines and not lines[-1].strip():  # trailing blank lines say nothing
        lines.pop()
    return "\n".join(lines[-n:])


def _python_script(entrypoint: str, args: tuple[str, ...]) -> str | None:
    """The script of a ``python [-u] script.py ...`` command, else None."""
    if not os.path.basename(entrypoint).startswith("python") and entrypoint != sys.executable:
        return None
    for arg in args:
        if arg == "-m" or arg == "-c":
            return None
        if not arg.startswith("-"):
            return arg if os.path.isfile(arg) else None
    return None


def script_syntax_error(entrypoint: object, args: tuple[str, ...]) -> str | None:
    """``SyntaxError: ...`` when the worker's script cannot even compile.

    A worker's stderr may go straight to the console where the agent cannot read it,
    and a script that does not compile never writes an error file; compiling it here
    (only after a failed first attempt) tells a deterministic failure from a flaky one.
    """
    if not isinstance(entrypoint, str):
        return None
    script = _python_script(entrypoint, args)
    if script is None:
        return None
    try:
        with open(script, "rb") as f:
            compile(f.read(), script, "exec", dont_inherit=True)
    except SyntaxError as exc:
        return f"{type(exc).__name__}: {exc.msg} ({exc.filename}, line {exc.lineno})"
    except (OSError, ValueError):
        return None
    return None


def failure_record(
    group: WorkerGroup,
    worker: Worker,
    pid: int | None,
    exit_code: int,
    seen: float,
    logs: WorkerLogs,
    *,
    node_id: str,
    round_: int,
    host: str,
) -> FailureRecord:
    """One failed worker, from its error file if it wrote one, else its stderr tail."""
    content = read_error_file(logs.error_file) if logs.error_file else None
    stderr_path = logs.stderr_file()
    if content is not None:
        message, trace = content.message, content.traceback
    else:
        trace = tail_lines(stderr_path)
        lines = [line for line in trace.splitlines() if line.strip()]
        message = lines[-1].strip() if lines else ""
    return FailureRecord(
        role=group.spec.role,
        rank=worker.global_rank,
        local_rank=worker.local_rank,
        host=host,
        pid=pid,
        exit_code=exit_code,
        timestamp=failure_time(content, seen),
        node_id=node_id,
        group_rank=group.group_rank,
        attempt=group.restart_count,
        signal=signal_name(exit_code),
        message=message,
        traceback=trace,
        error_file=logs.error_file if content is not None else None,  # only if written
        stdout_path=logs.stdout_file(),
        stderr_path=stderr_path,
        extra={"round": round_},
    )
