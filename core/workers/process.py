"""Start, poll and stop worker processes.

Every worker is the leader of its own process group (a new session), so the agent can
signal a worker together with everything it spawned (data loader workers, shells'
children) with one ``killpg``, and a Ctrl-C on the terminal reaches only the agent, which
forwards it. Every worker also asks the kernel for ``SIGKILL`` when the agent dies
(``PR_SET_PDEATHSIG``): torchrun leaves orphans behind when it is SIGKILLed, we do not.

Commands are started with ``subprocess.Popen``; Python callables with ``multiprocessing``
(``spawn``, ``fork`` or ``forkserver``) through a bootstrap that does the same set-up
before calling the function and sends its return value back over a pipe.

May import ``numa``, ``child``, ``exits``, ``signals``, ``boot``, ``errorfile`` (in the
child) and ``spare`` (for its type); outside ``workers``, ``interfaces``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from elastic.core.interfaces.rendezvous import AGENT_ONLY_ENV
from elastic.core.workers import numa
from elastic.core.workers.child import killpg, start_child
from elastic.core.workers.exits import ExitWait

# The agent's signals live in ``signals``; the agent loop still imports them from here.
from elastic.core.workers.signals import DEFAULT_SIGNALS as DEFAULT_SIGNALS
from elastic.core.workers.signals import Interrupted as Interrupted
from elastic.core.workers.signals import SignalGuard as SignalGuard

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from elastic.core.interfaces.spec import WorkerSpec
    from elastic.core.workers.spare import SparePool

# "" means the agent's own stream (the console); a path means that file.
CONSOLE = ""


def signal_name(returncode: int | None) -> str | None:
    """``SIGKILL`` for a worker killed by signal 9 (negative return code), else None."""
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"SIG{-returncode}"


def _open_dest(dest: str) -> Any:
    """What Popen takes for a destination: None inherits the agent's stream."""
    if dest == CONSOLE:
        return None
    if dest == os.devnull:
        return subprocess.DEVNULL
    return open(dest, "ab", buffering=0)  # noqa: SIM115 -- closed after Popen


def peek_exit(pid: int) -> int | None:
    """A child's exit code without reaping it (None while it runs).

    The zombie keeps its pid, and so its process group id, reserved until ``reap``: a
    later ``killpg`` can then never hit an unrelated group that reused the number.
    """
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None or info.si_pid == 0:
        return None
    if info.si_code == os.CLD_EXITED:
        return info.si_status
    return -info.si_status  # CLD_KILLED / CLD_DUMPED: the signal number


class WorkerLogsLike(Protocol):
    """Where a worker's streams go (``elastic.core.workers.logs.WorkerLogs``)."""

    stdout: str
    stderr: str


class WorkerProcess(Protocol):
    """One started worker, whatever started it."""

    local_rank: int
    pid: int

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while it runs."""

    def reap(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` seconds for exit and collect it (no zombie)."""

    def return_value(self) -> Any:
        """What a callable returned (None for commands)."""


class CommandWorker:
    """A worker running a program (``python -u script.py ...`` or ``--no-python``);
    ``proc``: a spare already running it (``spare.py``)."""

    def __init__(
        self,
        local_rank: int,
        cmd: Sequence[str],
        env: dict[str, str],
        stdout: str = CONSOLE,
        stderr: str = CONSOLE,
        cpus: set[int] | None = None,
        proc: subprocess.Popen[bytes] | None = None,
    ) -> None:
        self.local_rank = local_rank
        if proc is not None:
            self.proc, self.pid = proc, proc.pid
            return
        agent_pid = os.getpid()
        out, err = _open_dest(stdout), _open_dest(stderr)
        try:
            self.proc = subprocess.Popen(
                list(cmd),
                env=env,
                stdout=out,
                stderr=err,
                start_new_session=True,
                preexec_fn=lambda: start_child(agent_pid, cpus),
            )
        finally:
            for f in (out, err):
                if f is not None and not isinstance(f, int):
                    f.close()
        self.pid = self.proc.pid

    def poll(self) -> int | None:
        if self.proc.returncode is not None:
            return self.proc.returncode
        try:
            return peek_exit(self.pid)
        except ChildProcessError:  # reaped elsewhere (e.g. by Popen itself)
            return self.proc.poll()

    def reap(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=max(timeout, 0))
        except subprocess.TimeoutExpired:
            return None

    def return_value(self) -> Any:
        return None


def _release_forkserver() -> None:
    """Let the forkserver exit when the agent dies, and us with it (death signal).

    A forkserver child inherits the server's "alive" pipe, and the server only exits once
    every holder has closed it; with our workers holding it, a SIGKILLed agent would leave
    the server and its workers running forever.
    """
    from multiprocessing import forkserver

    server = forkserver._forkserver  # type: ignore[attr-defined]
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None


def _callable_bootstrap(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    stdout: str,
    stderr: str,
    parent_pid: int | None,
    conn: Connection,
    cpus: set[int] | None = None,
) -> None:
    """Runs in the child: own session, death signal, CPUs, environment, redirects, then
    ``fn``."""
    os.setsid()
    if parent_pid is None:
        _release_forkserver()
    start_child(parent_pid, cpus)
    for name in AGENT_ONLY_ENV:  # the job's secrets are the agent's, never a worker's
        os.environ.pop(name, None)
    os.environ.update(env)
    if "ELASTIC_STACK_FILE" in env:  # a command worker gets this from sitecustomize
        from elastic.core.workers.boot.sitecustomize import install

        install()
    for dest, fd, name in ((stdout, 1, "stdout"), (stderr, 2, "stderr")):
        if dest == CONSOLE:
            continue
        with contextlib.suppress(Exception):
            getattr(sys, name).flush()
        target = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
        # A fresh line-buffered stream on the fd: the inherited object may not be one
        # (a forked test runner's capture), and teed lines should arrive promptly.
        setattr(sys, name, open(fd, "w", buffering=1, closefd=False, errors="replace"))  # noqa: SIM115
    try:
        value = fn(*args)
    except BaseException as exc:
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file and not os.path.exists(error_file):
            try:
                from elastic.core.workers.errorfile import write_error_file

                write_error_file(error_file, exc)
            except Exception:  # reporting must not mask the worker's own error
                pass
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    conn.send(value)
    conn.close()


class CallableWorker:
    """A worker running a Python function in a ``multiprocessing`` child."""

    def __init__(
        self,
        local_rank: int,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        env: dict[str, str],
        start_method: str = "spawn",
        stdout: str = CONSOLE,
        stderr: str = CONSOLE,
        cpus: set[int] | None = None,
    ) -> None:
        import multiprocessing  # only Python-callable workers pay for it

        self.local_rank = local_rank
        ctx = multiprocessing.get_context(start_method)
        # A forkserver, not the agent, forks the child: its parent is the server.
        parent = None if start_method == "forkserver" else os.getpid()
        self._conn, child_conn = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=_callable_bootstrap,
            args=(fn, args, env, stdout, stderr, parent, child_conn, cpus),
            name=f"worker{local_rank}",
        )
        self.proc.start()
        child_conn.close()
        assert self.proc.pid is not None
        self.pid = self.proc.pid
        self._value: Any = None
        self._code: int | None = None

    def _drain(self) -> None:
        """Read the return value as soon as it is sent: a big one blocks the child."""
        try:
            while self._conn.poll():
                self._value = self._conn.recv()
        except (EOFError, OSError):
            pass

    def poll(self) -> int | None:
        self._drain()
        if self._code is None:
            try:
                self._code = peek_exit(self.pid)
            except ChildProcessError:  # reaped elsewhere
                self._code = self.proc.exitcode
        return self._code

    def reap(self, timeout: float) -> int | None:
        self._drain()
        self.proc.join(timeout=max(timeout, 0))
        self._drain()
        if self.proc.exitcode is not None:
            self._code = self.proc.exitcode
        return self.proc.exitcode

    def return_value(self) -> Any:
        self._drain()
        return self._value


def start_worker(
    spec: WorkerSpec,
    local_rank: int,
    args: tuple[str, ...],
    worker_env: dict[str, str],
    extra_env: dict[str, str],
    logs: WorkerLogsLike,
    spares: SparePool | None = None,
) -> WorkerProcess:
    """Start one worker: a callable through ``spec.start_method``, else a command (in a
    spare when ``spares`` has one fit for it); with ``--numa-binding``, bound to its CPUs
    in the child before it runs anything."""
    cpus = (
        numa.plan(spec.numa_binding, spec.local_world_size)[local_rank]
        if spec.numa_binding
        else None
    )
    if callable(spec.entrypoint):
        return CallableWorker(
            local_rank,
            spec.entrypoint,
            args,
            {**extra_env, **worker_env},
            spec.start_method,
            logs.stdout,
            logs.stderr,
            cpus,
        )
    inherited = {k: v for k, v in os.environ.items() if k not in AGENT_ONLY_ENV}
    env = {**inherited, **extra_env, **worker_env}
    cmd = [spec.entrypoint, *args]
    if spares is None:
        return CommandWorker(local_rank, cmd, env, logs.stdout, logs.stderr, cpus)
    proc = spares.take(local_rank, cmd, env, logs.stdout, logs.stderr, cpus)
    worker = CommandWorker(local_rank, cmd, env, logs.stdout, logs.stderr, cpus, proc)
    spares.plan(local_rank, cmd, env, cpus, worker.pid)
    return worker


def stop_workers(
    workers: Sequence[WorkerProcess], sig: int = signal.SIGTERM, timeout: float = 30.0
) -> dict[int, int | None]:
    """Stop every worker's process group: ``sig``, up to ``timeout`` s of grace, SIGKILL.

    The SIGKILL goes to every group, even one whose leader exited in time, so that
    anything a worker left running in its group dies too. Every leader is reaped.
    Returns the exit codes by local rank.
    """
    running = [w for w in workers if w.poll() is None]
    with ExitWait(w.pid for w in running) as exits:
        for w in running:
            killpg(w.pid, sig)
        deadline = time.monotonic() + timeout
        while any(w.poll() is None for w in running) and time.monotonic() < deadline:
            exits.wait(min(0.02, max(deadline - time.monotonic(), 0)))
    for w in workers:
        killpg(w.pid, signal.SIGKILL)
    codes = {}
    for w in workers:
        code = w.reap(5.0)
        if code is None:  # SIGKILL cannot be ignored; only an unkillable D-state
            code = w.reap(30.0)
        codes[w.local_rank] = code
    return codes
