"""The agent with real worker processes: env, restarts, budget, signals, orphans, logs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import pid_alive, wait_until
from elastic.core.agent import LocalElasticAgent
from elastic.core.hookspecs import hookimpl
from elastic.core.job_state import FAILED_KEY, RESTARTS_KEY
from elastic.core.local_rendezvous import LocalRendezvousHandler
from elastic.core.plugins import PluginHost
from elastic.core.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousInfo,
)
from elastic.core.spec import RunResult, WorkerSpec, WorkerState

REPO = Path(__file__).resolve().parent.parent


def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def make_spec(handler: Any, args: tuple[str, ...], nproc: int = 2, **kwargs: Any) -> WorkerSpec:
    kwargs.setdefault("monitor_interval", 0.05)
    kwargs.setdefault("shutdown_timeout", 2.0)
    return WorkerSpec(
        role=kwargs.pop("role", "default"),
        local_world_size=nproc,
        entrypoint=kwargs.pop("entrypoint", sys.executable),
        args=args,
        rdzv_handler=handler,
        **kwargs,
    )


def run_agent(args: tuple[str, ...], nproc: int = 2, **kwargs: Any) -> tuple[RunResult, Any]:
    handler = kwargs.pop("handler", None) or LocalRendezvousHandler("job")
    host = kwargs.pop("plugin_host", None)
    suffix = kwargs.pop("log_dir_suffix", None)
    agent = LocalElasticAgent(
        make_spec(handler, args, nproc, **kwargs), plugin_host=host, log_dir_suffix=suffix
    )
    return agent.run(), agent


ENV_DUMP = """
import json, os, sys
out = sys.argv[1]
rank, count = os.environ["LOCAL_RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
with open(os.path.join(out, f"env_{rank}_{count}.json"), "w") as f:
    json.dump(dict(os.environ), f)
"""


def test_worker_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    dump = script(tmp_path, "dump.py", ENV_DUMP)
    result, agent = run_agent(
        ("-u", dump, str(tmp_path)),
        2,
        log_dir=str(tmp_path / "logs"),
        log_dir_suffix="s",
        extra_env={"OMP_NUM_THREADS": "1"},
        max_restarts=3,
    )
    assert result.state == WorkerState.SUCCEEDED and result.exit_code == 0
    envs = [json.loads((tmp_path / f"env_{r}_0.json").read_text()) for r in range(2)]
    for rank, env in enumerate(envs):
        assert env["LOCAL_RANK"] == env["RANK"] == env["ROLE_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1"
        assert env["ROLE_NAME"] == "default"
        assert env["MASTER_ADDR"] == "localhost" and int(env["MASTER_PORT"]) > 0
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "3"
        assert env["TORCHELASTIC_RUN_ID"] == "job"
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert env["OMP_NUM_THREADS"] == "1"
        assert env["PATH"] == os.environ["PATH"]  # the agent's environment is inherited
        expected = tmp_path / "logs" / "job_s" / "attempt_0" / str(rank) / "error.json"
        assert env["TORCHELASTIC_ERROR_FILE"] == str(expected)
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
    assert agent.get_worker_group().state == WorkerState.SUCCEEDED


FLAKY = """
import os, signal, sys, time
out, how, until = sys.argv[1], sys.argv[2], int(sys.argv[3])
rank, count = os.environ["LOCAL_RANK"], int(os.environ["TORCHELASTIC_RESTART_COUNT"])
with open(os.path.join(out, f"run_{rank}_{count}_{os.environ['MASTER_PORT']}"), "w"):
    pass
if rank == "1" and count < until:
    # fail only once rank 0 has recorded this attempt (a loaded machine starts it late)
    deadline = time.monotonic() + 30
    while not any(n.startswith(f"run_0_{count}_") for n in os.listdir(out)):
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    time.sleep(0.1)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)
time.sleep(0.2)
"""


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_restarts_until_success(tmp_path: Path, how: str) -> None:
    flaky = script(tmp_path, "flaky.py", FLAKY)
    handler = LocalRendezvousHandler("job")
    result, _ = run_agent(
        ("-u", flaky, str(tmp_path), how, "2"), 2, max_restarts=3, handler=handler
    )
    assert result.state == WorkerState.SUCCEEDED and result.exit_code == 0
    runs = sorted(p.name for p in tmp_path.glob("run_*"))
    assert [r.rsplit("_", 1)[0] for r in runs] == [
        "run_0_0",
        "run_0_1",
        "run_0_2",
        "run_1_0",
        "run_1_1",
        "run_1_2",
    ]
    ports = {r.rsplit("_", 1)[1] for r in runs}
    assert len(ports) >= 2  # a fresh MASTER_PORT every attempt (the kernel may repeat one)
    assert int(handler.store.get(RESTARTS_KEY)) == 2


def test_budget_exhausted(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    flaky = script(tmp_path, "flaky.py", FLAKY)
    handler = LocalRendezvousHandler("job")
    t0 = time.monotonic()
    result, _ = run_agent(
        ("-u", flaky, str(tmp_path), "exit", "99"),
        2,
        max_restarts=1,
        handler=handler,
        redirects={1: 3},
        log_dir=str(tmp_path / "logs"),
    )
    assert time.monotonic() - t0 < 15
    assert result.state == WorkerState.FAILED
    assert result.exit_code == 3  # the failed worker's own exit code
    assert list(result.failures) == [1]
    record = result.failures[1]
    assert (record.rank, record.local_rank, record.exit_code, record.attempt) == (1, 1, 3, 1)
    assert record.signal is None and record.pid and record.host and record.stderr_path
    assert "restart budget exhausted" in result.message
    assert len(list(tmp_path.glob("run_1_*"))) == 2  # the first try and one restart
    assert handler.store.check([FAILED_KEY]) and handler.is_closed()
    assert "run failed" in capfd.readouterr().err


def test_sigkilled_worker_is_a_failure_with_signal_name(tmp_path: Path) -> None:
    flaky = script(tmp_path, "flaky.py", FLAKY)
    result, _ = run_agent(("-u", flaky, str(tmp_path), "kill", "99"), 2)
    assert result.state == WorkerState.FAILED
    assert result.exit_code == 128 + signal.SIGKILL
    assert result.failures[1].signal == "SIGKILL"
    assert result.failures[1].exit_code == -signal.SIGKILL


BLOCKED = """
import os, sys, time
out = sys.argv[1]
with open(os.path.join(out, f"pid_{os.environ['LOCAL_RANK']}"), "w") as f:
    f.write(str(os.getpid()))
if os.environ["LOCAL_RANK"] == "1":
    deadline = time.monotonic() + 30  # fail once rank 0 is surely up
    while not os.path.exists(os.path.join(out, "pid_0")) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    sys.exit(1)
while True:
    time.sleep(1)
"""


def test_blocked_sibling_is_stopped_and_not_a_failure(tmp_path: Path) -> None:
    blocked = script(tmp_path, "blocked.py", BLOCKED)
    t0 = time.monotonic()
    result, _ = run_agent(("-u", blocked, str(tmp_path)), 2)
    assert time.monotonic() - t0 < 10
    assert result.state == WorkerState.FAILED and result.exit_code == 1
    assert list(result.failures) == [1]  # rank 0 was stopped by the agent
    pid0 = int((tmp_path / "pid_0").read_text())
    assert not pid_alive(pid0)


def test_syntax_error_does_not_burn_restarts(tmp_path: Path) -> None:
    bad = script(tmp_path, "bad.py", "def broken(:\n    pass\n")
    t0 = time.monotonic()
    result, agent = run_agent(
        ("-u", bad), 2, max_restarts=5, log_dir=str(tmp_path / "logs"), log_dir_suffix="s"
    )
    assert time.monotonic() - t0 < 10
    assert result.state == WorkerState.FAILED
    assert "not restarting" in result.message and "SyntaxError" in result.message
    assert [p.name for p in (tmp_path / "logs" / "job_s").iterdir()] == ["attempt_0"]


def test_job_failed_elsewhere_stops_workers(tmp_path: Path) -> None:
    blocked = script(tmp_path, "forever.py", "import time\nwhile True: time.sleep(1)\n")
    handler = LocalRendezvousHandler("job")
    timer = threading.Timer(0.5, lambda: handler.store.set(FAILED_KEY, "1"))
    timer.start()
    t0 = time.monotonic()
    result, _ = run_agent(("-u", blocked), 2, handler=handler)
    timer.cancel()
    assert time.monotonic() - t0 < 10
    assert result.state == WorkerState.FAILED and result.exit_code == 1
    assert "another node" in result.message


class ScalingHandler(LocalRendezvousHandler):
    """A real standalone handler that reports one waiting node after the first round."""

    def __init__(self, out: Path) -> None:
        super().__init__("job")
        self.out = out
        self.waiting_reported = False

    def num_nodes_waiting(self) -> int:
        started = any(self.out.glob("start_0_*"))  # the first round's worker is running
        if self._round == 0 and started and not self.waiting_reported:
            self.waiting_reported = True
            return 1
        return 0


def test_membership_change_restarts_without_using_the_budget(tmp_path: Path) -> None:
    worker = script(
        tmp_path,
        "w.py",
        """
        import os, sys, time
        open(os.path.join(sys.argv[1], f"start_{os.environ['LOCAL_RANK']}_"
             f"{os.environ['MASTER_PORT']}"), "w").close()
        time.sleep(1.5)
        """,
    )
    handler = ScalingHandler(tmp_path)
    result, agent = run_agent(("-u", worker, str(tmp_path)), 1, handler=handler)
    assert result.state == WorkerState.SUCCEEDED
    assert len(list(tmp_path.glob("start_0_*"))) == 2
    assert int(handler.store.add(RESTARTS_KEY, 0)) == 0
    assert agent.get_worker_group().round == 1


class BrokenStoreHandler(LocalRendezvousHandler):
    def lost_nodes(self) -> list[str]:
        raise RendezvousConnectionError("store at 10.0.0.1:29400 is gone")


def test_connection_error_fails_with_one_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    forever = script(tmp_path, "forever.py", "import time\nwhile True: time.sleep(1)\n")
    result, _ = run_agent(("-u", forever), 1, handler=BrokenStoreHandler("job"))
    assert result.state == WorkerState.FAILED and result.exit_code == 1
    assert "lost the rendezvous backend" in result.message
    err = capfd.readouterr().err.strip().splitlines()
    assert err == ["elastic: lost the rendezvous backend: store at 10.0.0.1:29400 is gone"]


class ClosedHandler(LocalRendezvousHandler):
    def next_rendezvous(self) -> RendezvousInfo:
        raise RendezvousClosedError("closed")


class NotNeededHandler(LocalRendezvousHandler):
    def next_rendezvous(self) -> RendezvousInfo:
        raise RendezvousGracefulExitError("max_nodes reached")


def test_late_joiner_exits_cleanly() -> None:
    result, _ = run_agent(("-c", "pass"), 1, handler=ClosedHandler("job"))
    assert result.state == WorkerState.SUCCEEDED and result.exit_code == 0
    assert result.message == "rendezvous is closed"
    result, _ = run_agent(("-c", "pass"), 1, handler=NotNeededHandler("job"))
    assert result.state == WorkerState.SUCCEEDED and result.exit_code == 0


class BlockingHandler(LocalRendezvousHandler):
    def next_rendezvous(self) -> RendezvousInfo:
        time.sleep(30)
        raise AssertionError("not interrupted")


def test_signal_during_rendezvous_interrupts_it() -> None:
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    t0 = time.monotonic()
    try:
        result, _ = run_agent(("-c", "pass"), 1, handler=BlockingHandler("job"))
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 10
    assert result.exit_code == 128 + signal.SIGTERM and result.state == WorkerState.FAILED
    assert "SIGTERM" in result.message


def test_program_that_cannot_start(tmp_path: Path) -> None:
    result, _ = run_agent((), 2, entrypoint=str(tmp_path / "no-such-program"))
    assert result.state == WorkerState.FAILED and result.exit_code == 1
    assert result.message.startswith("cannot start worker 0")


def test_log_dir_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    result, _ = run_agent(("-c", "pass"), 1, log_dir=str(tmp_path / "file"))
    assert result.state == WorkerState.FAILED and result.exit_code == 1
    assert result.message.startswith("cannot create the log directory")


def square_plus_rank(x: int) -> int:
    return x * x + int(os.environ["RANK"])


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_callable_entrypoint(method: str) -> None:
    result, _ = run_agent((5,), 2, entrypoint=square_plus_rank, start_method=method)  # type: ignore[arg-type]
    assert result.state == WorkerState.SUCCEEDED
    assert result.return_values == {0: 25, 1: 26}


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    @hookimpl
    def elastic_agent_start(self, spec: WorkerSpec, settings: dict[str, object]) -> None:
        self.calls.append(("start", settings))

    @hookimpl
    def elastic_rendezvous_complete(self, info: RendezvousInfo, duration: float) -> None:
        self.calls.append(("rendezvous", info.round))

    @hookimpl
    def elastic_workers_started(self, group: Any) -> None:
        self.calls.append(("started", group.restart_count))

    @hookimpl
    def elastic_worker_failed(self, record: Any) -> None:
        self.calls.append(("worker_failed", record.rank))

    @hookimpl
    def elastic_restart(self, group: Any, reason: str) -> None:
        self.calls.append(("restart", reason))

    @hookimpl
    def elastic_run_failed(self, summary: Any) -> None:
        self.calls.append(("run_failed", summary.root_cause.rank))

    @hookimpl
    def elastic_run_end(self, result: RunResult, duration: float) -> None:
        self.calls.append(("end", result.exit_code))


def test_hooks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ELASTIC_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("ELASTIC_PLUGINS", "")
    host = PluginHost()
    recorder = Recorder()
    host.register(recorder, "recorder")
    flaky = script(tmp_path, "flaky.py", FLAKY)
    handler = LocalRendezvousHandler("job")
    agent = LocalElasticAgent(
        make_spec(handler, ("-u", flaky, str(tmp_path), "exit", "99"), 2, max_restarts=1),
        plugin_host=host,
        settings={"k": "v"},
    )
    result = agent.run()
    assert result.exit_code == 3
    assert recorder.calls == [
        ("start", {"k": "v"}),
        ("rendezvous", 0),
        ("started", 0),
        ("worker_failed", 1),
        ("restart", "failure"),
        ("rendezvous", 1),
        ("started", 1),
        ("worker_failed", 1),
        ("run_failed", 1),
        ("end", 3),
    ]
    assert "run failed" not in capfd.readouterr().err  # the plugin reported it


# --- the agent as its own process ------------------------------------------------------
DRIVER = """
import json, sys
from elastic.core.agent import LocalElasticAgent
from elastic.core.local_rendezvous import LocalRendezvousHandler
from elastic.core.spec import WorkerSpec
cfg = json.loads(sys.argv[1])
ints = lambda d: {int(k): v for k, v in d.items()}
spec = WorkerSpec(
    role=cfg.get("role", "default"), local_world_size=cfg["nproc"],
    entrypoint=sys.executable, args=tuple(cfg["args"]),
    rdzv_handler=LocalRendezvousHandler("job"), monitor_interval=0.05,
    shutdown_timeout=cfg.get("shutdown_timeout", 3.0), log_dir=cfg.get("log_dir"),
    redirects=ints(cfg.get("redirects", {})), tee=ints(cfg.get("tee", {})),
    local_ranks_filter=frozenset(cfg["filter"]) if "filter" in cfg else None,
)
result = LocalElasticAgent(spec, log_dir_suffix=cfg.get("suffix")).run()
sys.exit(result.exit_code)
"""


def start_agent(procs: Any, **cfg: Any) -> Any:
    return procs.start([sys.executable, "-c", DRIVER, json.dumps(cfg)])


PID_THEN_WAIT = """
import os, signal, sys, time
out = sys.argv[1]
def on_term(signum, frame):
    open(os.path.join(out, f"got_{signal.Signals(signum).name}_{os.environ['LOCAL_RANK']}"),
         "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
with open(os.path.join(out, f"pid_{os.environ['LOCAL_RANK']}"), "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(0.1)
"""


def _worker_pids(tmp_path: Path, n: int) -> list[int]:
    files = [tmp_path / f"pid_{r}" for r in range(n)]
    assert wait_until(lambda: all(f.exists() and f.read_text() for f in files), 20)
    return [int(f.read_text()) for f in files]


def test_no_orphans_when_the_agent_is_sigkilled(tmp_path: Path, procs: Any) -> None:
    worker = script(tmp_path, "w.py", PID_THEN_WAIT)
    agent = start_agent(procs, nproc=2, args=["-u", worker, str(tmp_path)])
    pids = _worker_pids(tmp_path, 2)
    assert all(pid_alive(p) for p in pids)
    os.kill(agent.pid, signal.SIGKILL)
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), 5)


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_signal_is_forwarded_and_agent_exits_128_plus_signum(
    tmp_path: Path, procs: Any, signame: str
) -> None:
    worker = script(
        tmp_path,
        "w.py",
        PID_THEN_WAIT.replace("signal.SIGTERM, on_term", f"signal.{signame}, on_term"),
    )
    agent = start_agent(procs, nproc=2, args=["-u", worker, str(tmp_path)])
    pids = _worker_pids(tmp_path, 2)
    signum = getattr(signal, signame)
    os.kill(agent.pid, signum)
    _, err = agent.communicate(timeout=20)
    assert agent.returncode == 128 + signum, err
    assert f"received {signame}" in err
    for rank in range(2):
        assert (tmp_path / f"got_{signame}_{rank}").exists()
    assert not any(pid_alive(p) for p in pids)


def test_tee_prefixes_and_log_layout(tmp_path: Path, procs: Any) -> None:
    worker = script(
        tmp_path,
        "w.py",
        """
        import os, sys
        print(f"out {os.environ['RANK']}")
        print(f"err {os.environ['RANK']}", file=sys.stderr)
        """,
    )
    logs = tmp_path / "logs"
    agent = start_agent(
        procs,
        nproc=3,
        args=["-u", worker],
        log_dir=str(logs),
        suffix="abc",
        tee={"0": 3, "1": 1},
        redirects={"2": 3},
    )
    out, err = agent.communicate(timeout=30)
    assert agent.returncode == 0, err
    assert sorted(out.splitlines()) == ["[default0]:out 0", "[default1]:out 1"]
    assert "[default0]:err 0" in err.splitlines()
    assert "err 1" in err.splitlines()  # not teed: straight to the console, unprefixed
    assert "2" not in out and "err 2" not in err  # redirected only: files only
    attempt = logs / "job_abc" / "attempt_0"
    assert sorted(p.name for p in attempt.iterdir()) == ["0", "1", "2"]
    assert (attempt / "0" / "stdout.log").read_text() == "out 0\n"
    assert (attempt / "0" / "stderr.log").read_text() == "err 0\n"
    assert (attempt / "1" / "stdout.log").read_text() == "out 1\n"
    assert not (attempt / "1" / "stderr.log").exists()
    assert (attempt / "2" / "stderr.log").read_text() == "err 2\n"


def test_local_ranks_filter_limits_the_console(tmp_path: Path, procs: Any) -> None:
    worker = script(tmp_path, "w.py", "import os\nprint(f\"out {os.environ['RANK']}\")\n")
    agent = start_agent(
        procs,
        nproc=3,
        args=["-u", worker],
        log_dir=str(tmp_path / "l"),
        tee={"0": 3, "1": 3, "2": 3},
        filter=[1],
    )
    out, err = agent.communicate(timeout=30)
    assert agent.returncode == 0, err
    assert out.splitlines() == ["[default1]:out 1"]


# --- through the CLI -------------------------------------------------------------------
DUMP_ENV = """
import json, os, sys
with open(os.path.join(sys.argv[1], f"env_{os.environ['LOCAL_RANK']}.json"), "w") as f:
    json.dump(dict(os.environ), f)
"""
# Values that differ by design: fresh ports and ids per run, paths under the run's log dir,
# and the store: torchrun's workers reuse the agent's TCPStore, ours host their own.
EXPECTED_DIFFERENCES = {
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_USE_AGENT_STORE",
}


@pytest.mark.slow
def test_cli_worker_env_matches_torchrun(tmp_path: Path) -> None:
    from conftest import cli_env, run_elastic

    dump = script(tmp_path, "dump_env.py", DUMP_ENV)
    env = cli_env()
    env.pop("OMP_NUM_THREADS", None)
    envs = {}
    for name, cmd in {
        "torchrun": [sys.executable, "-m", "torch.distributed.run"],
        "elastic": [sys.executable, "-m", "elastic", "run"],
    }.items():
        out = tmp_path / name
        out.mkdir()
        flags = ["--standalone", "--nproc-per-node=2", "--max-restarts=2", "--role=trainer"]
        if name == "torchrun":
            proc = subprocess.run(
                [*cmd, *flags, dump, str(out)],
                capture_output=True,
                text=True,
                env=env,
                timeout=90,
            )
        else:
            proc = run_elastic("run", *flags, dump, str(out), env=env)
        assert proc.returncode == 0, proc.stderr
        envs[name] = [json.loads((out / f"env_{r}.json").read_text()) for r in range(2)]
    for ours, theirs in zip(envs["elastic"], envs["torchrun"], strict=True):
        assert sorted(ours) == sorted(theirs)
        differing = {k for k in theirs if ours[k] != theirs[k]}
        assert differing <= EXPECTED_DIFFERENCES, {k: (ours[k], theirs[k]) for k in differing}
        assert ours["MASTER_ADDR"] == theirs["MASTER_ADDR"] == "localhost"
        assert ours["OMP_NUM_THREADS"] == theirs["OMP_NUM_THREADS"] == "1"
        assert ours["TORCHELASTIC_USE_AGENT_STORE"] == "False"


GLOO = """
import os, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and dist.get_rank() == 1:
    sys.exit(5)
dist.barrier()
print(f"sum={t.item()} restart={os.environ['TORCHELASTIC_RESTART_COUNT']}")
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_cli_gloo_job_restarts_on_a_fresh_port(tmp_path: Path) -> None:
    from conftest import run_elastic

    gloo = script(tmp_path, "gloo.py", GLOO)
    proc = run_elastic(
        "run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--tee=3",
        "--monitor-interval=0.05",
        gloo,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [
        "[default0]:sum=3.0 restart=1",
        "[default1]:sum=3.0 restart=1",
    ]


def test_cli_failure_and_sigterm(tmp_path: Path, procs: Any) -> None:
    from conftest import run_elastic

    failing = script(tmp_path, "f.py", "import sys\nsys.exit(7)\n")
    proc = run_elastic("run", "--standalone", "--nproc-per-node=1", "--max-restarts=1", failing)
    assert proc.returncode == 7, proc.stderr
    worker = script(tmp_path, "w.py", PID_THEN_WAIT)
    agent = procs.elastic("run", "--standalone", "--nproc-per-node=2", worker, str(tmp_path))
    pids = _worker_pids(tmp_path, 2)
    agent.send_signal(signal.SIGTERM)
    agent.communicate(timeout=30)
    assert agent.returncode == 128 + signal.SIGTERM
    assert all((tmp_path / f"got_SIGTERM_{r}").exists() for r in range(2))
    assert not any(pid_alive(p) for p in pids)


# --- several nodes sharing one job store -------------------------------------------------
class SharedRendezvous:
    """A real in-memory rendezvous for ``n`` agents in one process (one per thread)."""

    def __init__(self, n: int) -> None:
        from elastic.core.store import LocalStore

        self.n = n
        self.store = LocalStore()
        self.cond = threading.Condition()
        self.open_round = 0
        self.waiting: list[str] = []
        self.formed: dict[int, list[str]] = {}
        self.closed = False


class NodeHandler(LocalRendezvousHandler):
    def __init__(self, shared: SharedRendezvous, name: str) -> None:
        super().__init__("multi")
        self.shared, self.name = shared, name

    def next_rendezvous(self) -> RendezvousInfo:
        from elastic.core.local_rendezvous import free_port

        s = self.shared
        with s.cond:
            if s.closed:
                raise RendezvousClosedError("closed")
            rnd = s.open_round
            s.waiting.append(self.name)
            if len(s.waiting) == s.n:
                s.formed[rnd], s.waiting = sorted(s.waiting), []
                s.open_round += 1
                s.cond.notify_all()
            elif not s.cond.wait_for(lambda: s.open_round > rnd or s.closed, timeout=30):
                raise RendezvousClosedError("timed out")
            if s.closed and rnd not in s.formed:
                raise RendezvousClosedError("closed")
            members = s.formed[rnd]
        return RendezvousInfo(
            store=s.store,
            rank=members.index(self.name),
            world_size=s.n,
            master_addr="localhost",
            master_port=free_port(),
            round=rnd,
            members=members,
        )

    def num_nodes_waiting(self) -> int:
        with self.shared.cond:
            return len(self.shared.waiting)

    def set_closed(self) -> None:
        with self.shared.cond:
            self.shared.closed = True
            self.shared.cond.notify_all()

    def is_closed(self) -> bool:
        return self.shared.closed


NODE_WORKER = """
import os, sys, time
out, failing, until, rest = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), sys.argv[4]
node, count = os.environ["GROUP_RANK"], int(os.environ["TORCHELASTIC_RESTART_COUNT"])
open(os.path.join(out, f"n{node}_r{os.environ['RANK']}_c{count}"), "w").close()
if node in failing and count < until:
    # fail once every rank of this attempt is up (a loaded machine starts them late)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if sum(n.endswith(f"_c{count}") for n in os.listdir(out)) >= int(os.environ["WORLD_SIZE"]):
            break
        time.sleep(0.02)
    time.sleep(0.2)
    sys.exit(3)
time.sleep(float(rest))
"""


def run_nodes(
    tmp_path: Path, failing: str, until: int, max_restarts: int, rest: float = 1.0
) -> list[RunResult]:
    worker = script(tmp_path, "node.py", NODE_WORKER)
    shared = SharedRendezvous(2)
    results: list[Any] = [None, None]

    def node(i: int) -> None:
        spec = make_spec(
            NodeHandler(shared, f"node{i}"),
            ("-u", worker, str(tmp_path), failing, str(until), str(rest)),
            2,
            max_restarts=max_restarts,
        )
        results[i] = LocalElasticAgent(spec).run()

    threads = [threading.Thread(target=node, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(r, RunResult) for r in results)
    return results


def test_one_restart_per_round_across_nodes(tmp_path: Path) -> None:
    """Both nodes' workers fail in the same round: the job pays for one restart."""
    results = run_nodes(tmp_path, "0,1", 1, max_restarts=1)
    assert [r.state for r in results] == [WorkerState.SUCCEEDED] * 2
    assert sorted(p.name for p in tmp_path.glob("n*_c1")) == [
        "n0_r0_c1",
        "n0_r1_c1",
        "n1_r2_c1",
        "n1_r3_c1",
    ]


def test_peer_failure_restarts_healthy_node_and_budget_is_job_wide(tmp_path: Path) -> None:
    """Node 1 keeps failing: node 0 restarts with it (same RESTART_COUNT), then both fail
    once the job-wide budget is spent, with the same root cause."""
    # node 0's workers outlive node 1's last failure: they are stopped via agent/failed
    results = run_nodes(tmp_path, "1", 99, max_restarts=2, rest=5.0)
    assert [r.state for r in results] == [WorkerState.FAILED] * 2
    assert [r.exit_code for r in results] == [3, 3]
    assert not results[0].failures
    assert results[1].failures and set(results[1].failures) <= {2, 3}
    assert "another node" in results[0].message
    runs = sorted(p.name for p in tmp_path.glob("n0_r0_*"))
    assert runs == ["n0_r0_c0", "n0_r0_c1", "n0_r0_c2"]


def test_finished_node_rejoins_when_a_peer_fails_the_round(tmp_path: Path) -> None:
    """Node 0's workers are done (it waits in the exit barrier) when node 1's fail: the
    round failed, so node 0 rejoins instead of waiting for a peer that never comes."""
    t0 = time.monotonic()
    results = run_nodes(tmp_path, "1", 1, max_restarts=1, rest=0.0)
    assert time.monotonic() - t0 < 20
    assert [r.state for r in results] == [WorkerState.SUCCEEDED] * 2
    assert sorted(p.name for p in tmp_path.glob("n0_r0_*")) == ["n0_r0_c0", "n0_r0_c1"]


def test_cli_sigkill_leaves_no_orphans(tmp_path: Path, procs: Any) -> None:
    worker = script(tmp_path, "w.py", PID_THEN_WAIT)
    agent = procs.elastic("run", "--standalone", "--nproc-per-node=2", worker, str(tmp_path))
    pids = _worker_pids(tmp_path, 2)
    os.kill(agent.pid, signal.SIGKILL)
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), 5)


def test_agent_modules_do_not_import_torch() -> None:
    code = (
        "import sys, elastic.core.agent, elastic.core.local_rendezvous, elastic.core.logs, "
        "elastic.core.process, elastic.core.worker_env, elastic.core.job_state; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
