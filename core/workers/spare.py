"""Warm spares (``--warm-restarts``): a restart's workers start at once.

A worker started afresh pays for an interpreter and its imports before its first line
runs: ``import torch`` alone is 1.5 s here, 5-9 s on a loaded machine, and every worker of
a restart (a failure, a node lost on the restart path) pays it again while the job waits.
With warm restarts the agent keeps one spare per local rank: started ``SPARE_DELAY`` s
after the workers (never competing with their start), as the worker it stands in for
(same interpreter, flags, environment, CPUs, session and death signal), waiting on a pipe
(``spare_main.py``), and told to import ``torch`` (and what a training script's first
lines import) once that worker shows it loaded it. A restart's worker on that local rank is
the spare, told its environment and streams, when it differs from the spare's only in
what changes from one attempt to the next (``PER_ATTEMPT``: ranks, world, master, restart
count, the attempt's files); any other difference (a plugin's variable, a new
``PYTHONPATH``) starts a fresh worker, as without spares. Spares of callables,
``--no-python`` programs and ``--run-path`` are never made.

A spare costs an idle interpreter per local rank (about 10 MB; 300 MB with torch and
``torch._dynamo`` imported) for the time the workers run; it dies with the agent
(``PR_SET_PDEATHSIG``), and ``close`` kills what is left.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from elastic.core.workers.boot import sitecustomize
from elastic.core.workers.child import killpg, start_child
from elastic.core.workers.control_file import ENV_CONTROL

log = logging.getLogger(__name__)

SPARE_DELAY = 2.0  # s after a start before its spares are made
# s a spare is told what to import as soon as its worker shows it (a loaded machine takes
# 5-9 s over torch); a worker that shows nothing in that time leaves its spare bare.
IMPORTS_WAIT = 20.0
SPARE_MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spare_main.py")
BOOT_SITECUSTOMIZE = os.path.abspath(sitecustomize.__file__)
# What may differ between the worker a spare was made as and the one it becomes: only
# what a worker reads once it runs (torch reads these in init_process_group, the
# training helpers when the script calls them), never at interpreter start.
PER_ATTEMPT = frozenset(
    {
        "RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_ERROR_FILE",
        ENV_CONTROL,
        "ELASTIC_PROGRESS_FILE",
        sitecustomize.ENV_FILE,  # registered when the spare is told it (spare_main)
    }
)
# What a spare imports when the worker it stands in for had loaded a shared library (in
# /proc/<pid>/maps): for torch, what a training script's first lines pull in too (the
# first optimizer imports torch._dynamo: 1.1 s of the 2.8 s before a gloo job's first
# step here).
WARM_MODULES = {
    re.compile(rb"/libtorch_python\.so"): (
        "torch",
        "torch.distributed",
        "torch.nn.parallel",
        "torch._dynamo",
    ),
}


def python_command(cmd: Sequence[str]) -> bool:
    """Whether ``cmd`` is how ``elastic run`` starts a Python worker: ``PY -u script ...``
    or ``PY -u -m module ...`` (what a spare can become)."""
    return len(cmd) >= 3 and cmd[1] == "-u" and (cmd[2] != "-m" or len(cmd) >= 4)


def loaded_modules(pid: int) -> list[str]:
    """What a spare of process ``pid`` imports (``WARM_MODULES``; none when it cannot
    tell)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as maps:
            text = maps.read()
    except OSError:
        return []
    found = [names for pattern, names in WARM_MODULES.items() if pattern.search(text)]
    return [name for names in found for name in names]


@dataclass
class _Plan:
    """The worker a spare stands in for: its command, environment and CPUs."""

    cmd: list[str]
    env: dict[str, str]
    cpus: set[int] | None
    pid: int  # the running worker, whose loaded modules the spare imports


@dataclass
class _Spare:
    plan: _Plan
    proc: subprocess.Popen[bytes]
    pipe: int  # the write end of its pipe: "warm MODULES" lines, then one "go {...}" line
    warmed: bool = False  # told what to import


class SparePool:
    """One spare per local rank, made after each start, taken by the next.

    Spares are made on one thread that lives as long as the pool: a child's death signal
    (``PR_SET_PDEATHSIG``) comes when the *thread* that started it ends, so a spare made
    on a short-lived timer thread would be killed as that thread returned."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._plans: dict[int, _Plan] = {}
        self._spares: dict[int, _Spare] = {}
        self._due: float | None = None  # monotonic: when to make the missing spares
        self._thread: threading.Thread | None = None
        self._closed = False

    def take(
        self,
        local_rank: int,
        cmd: Sequence[str],
        env: dict[str, str],
        stdout: str,
        stderr: str,
        cpus: set[int] | None,
    ) -> subprocess.Popen[bytes] | None:
        """The spare of ``local_rank``, now running ``cmd`` with ``env`` and the streams
        (a path, or "" for the agent's); None when there is none fit to be that worker
        (the caller starts one afresh; an unfit spare is killed)."""
        with self._lock:
            spare = self._spares.pop(local_rank, None)
        if spare is None:
            return None
        why = _unfit(spare, list(cmd), env, cpus)
        if why is None:
            go = {
                "env": env,
                "argv": list(cmd[3:]) if cmd[2] == "-m" else list(cmd[2:]),
                "module": cmd[2] == "-m",
                "stdout": stdout,
                "stderr": stderr,
                "boot_sitecustomize": BOOT_SITECUSTOMIZE,
            }
            try:
                _write_all(spare.pipe, b"go " + json.dumps(go).encode() + b"\n")
                os.close(spare.pipe)
                return spare.proc
            except OSError as exc:
                why = f"its pipe failed: {exc}"
        log.debug("spare of local rank %d not used: %s", local_rank, why)
        _kill(spare)
        return None

    def plan(
        self,
        local_rank: int,
        cmd: Sequence[str],
        env: dict[str, str],
        cpus: set[int] | None,
        pid: int,
    ) -> None:
        """The worker just started on ``local_rank``: what its spare will be made as."""
        if python_command(cmd):
            with self._lock:
                self._plans[local_rank] = _Plan(list(cmd), dict(env), cpus, pid)

    def refill_later(self, delay: float = SPARE_DELAY) -> None:
        """Make the missing spares ``delay`` s from now."""
        with self._lock:
            if self._closed:
                return
            self._due = time.monotonic() + delay
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="spares", daemon=True)
                self._thread.start()
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._closed and (self._due is None or time.monotonic() < self._due):
                    self._wake.wait(None if self._due is None else self._due - time.monotonic())
                if self._closed:
                    return
                self._due = None
                todo = {r: p for r, p in self._plans.items() if r not in self._spares}
            for local_rank, plan in todo.items():
                spare = _make(plan)
                if spare is None:
                    continue
                with self._lock:
                    keep = not self._closed and local_rank not in self._spares
                    if keep:
                        self._spares[local_rank] = spare
                if not keep:
                    _kill(spare)
            self._warm_when_seen()

    def _warm_when_seen(self) -> None:
        """Tell each spare to import what its worker has loaded, as soon as the worker
        shows it, for up to ``IMPORTS_WAIT`` s (a new start or the pool closing ends the
        watch; a spare taken meanwhile is no longer told)."""
        deadline = time.monotonic() + IMPORTS_WAIT
        while time.monotonic() < deadline:
            with self._lock:
                if self._closed or self._due is not None:
                    return
                cold = [s for s in self._spares.values() if not s.warmed]
                for spare in cold:
                    modules = loaded_modules(spare.plan.pid)
                    if modules:
                        spare.warmed = True
                        try:
                            _write_all(spare.pipe, f"warm {','.join(modules)}\n".encode())
                        except OSError:
                            pass  # a spare gone is found unfit when taken
                if all(s.warmed for s in cold):
                    return
                self._wake.wait(0.5)

    def close(self) -> None:
        """Kill every spare (the agent is ending)."""
        with self._lock:
            self._closed = True
            self._wake.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5)  # a spare being made is made, then killed below
        with self._lock:
            spares, self._spares = list(self._spares.values()), {}
        for spare in spares:
            _kill(spare)


def _unfit(spare: _Spare, cmd: list[str], env: dict[str, str], cpus: set[int] | None) -> str | None:
    """Why ``spare`` cannot become the worker ``cmd``/``env``/``cpus``; None: it can."""
    if spare.proc.poll() is not None:
        return f"it exited ({spare.proc.returncode})"
    if cmd != spare.plan.cmd:
        return "the command differs"
    if cpus != spare.plan.cpus:
        return "its CPUs differ"
    before = {k: v for k, v in spare.plan.env.items() if k != sitecustomize.ENV_FILE}
    changed = {k for k in before.keys() | env.keys() if before.get(k) != env.get(k)}
    if changed - PER_ATTEMPT:
        return f"its environment differs in {sorted(changed - PER_ATTEMPT)}"
    return None


def _make(plan: _Plan) -> _Spare | None:
    """Start a spare as ``plan``'s worker; None when it cannot be started."""
    # Without the stack file: the dump is registered for the worker the spare becomes.
    env = {k: v for k, v in plan.env.items() if k != sitecustomize.ENV_FILE}
    read, write = os.pipe()
    agent_pid, cpus = os.getpid(), plan.cpus
    try:
        proc = subprocess.Popen(
            [plan.cmd[0], "-u", SPARE_MAIN, str(read)],
            env=env,
            pass_fds=(read,),
            start_new_session=True,
            preexec_fn=lambda: start_child(agent_pid, cpus),
        )
    except OSError as exc:
        log.debug("no spare: %s", exc)
        os.close(write)
        return None
    finally:
        os.close(read)
    log.debug("spare made for the local rank of pid %d", plan.pid)
    return _Spare(plan, proc, write)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _kill(spare: _Spare) -> None:
    try:
        os.close(spare.pipe)
    except OSError:
        pass
    killpg(spare.proc.pid, signal.SIGKILL)
    try:
        spare.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
