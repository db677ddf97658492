"""The agent with real worker processes: env, restarts, budget, signals, orphans, logs."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from elastic.core.agent.loop import LocalElasticAgent
from elastic.core.agent.restarts import restarts_used
from elastic.core.interfaces.job_keys import FAILED_KEY
from elastic.core.interfaces.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousFencedError,
    RendezvousGracefulExitError,
    RendezvousInfo,
    RendezvousStoreGoneError,
)
from elastic.core.interfaces.spec import RunResult, WorkerSpec, WorkerState
from elastic.core.plugin.config import ElasticConfig
from elastic.core.plugin.hookspecs import hookimpl
from elastic.core.plugin.host import PluginHost
from elastic.core.rendezvous.local import LocalRendezvousHandler
from elastic.harness.commands import write_script as script
from elastic.harness.processes import pid_alive
from elastic.harness.worker_specs import make_spec

REPO = Path(__file__).resolve().parent.parent


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
    assert restarts_used(handler.store) == 2


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
    assert restarts_used(handler.store) == 0
    assert agent.get_worker_group().round == 1


class BrokenStoreHandler(LocalRendezvousHandler):
    def lost_nodes(self) -> list[str]:
        raise RendezvousConnectionError("store at 10.0.0.1:29400 is gone")


@pytest.mark.parametrize(
    ("raised", "seen"),
    [
        (RendezvousConnectionError("no answer in 10.0s"), RendezvousFencedError),
        (RendezvousStoreGoneError("nothing serves it"), RendezvousStoreGoneError),
    ],
)
def test_a_store_unanswered_while_the_job_re_forms_fences_and_a_store_gone_ends(
    raised: Exception, seen: type[Exception]
) -> None:
    """A store call of the in-place regroup's own waits (the readiness count) that goes
    unanswered is a partition: fence and rejoin (the loop's path for fenced), never exit;
    a store its host says is gone stays final."""
    from elastic.core.agent.outcome import Outcome

    agent = LocalElasticAgent(make_spec(LocalRendezvousHandler("job"), ("-c", "pass"), 1))

    def regroup(outcome: Outcome, peers: list[str] | None) -> None:
        raise raised

    agent._regroup_in_place = regroup  # type: ignore[method-assign]
    with pytest.raises(seen):
        agent._regroup_across_moves(Outcome.LOST_NODE)


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


class ClosedByOthersHandler(LocalRendezvousHandler):
    """One round, then the job is closed (the other nodes finished it), failed or not."""

    def __init__(self, run_id: str, failed: bool) -> None:
        super().__init__(run_id)
        self.failed = failed

    def next_rendezvous(self) -> RendezvousInfo:
        if self._round >= 1:
            if self.failed:
                self.store.set(FAILED_KEY, "1")
            raise RendezvousClosedError("closed")
        return super().next_rendezvous()


@pytest.mark.parametrize("failed", [False, True])
def test_job_closed_while_this_node_regroups(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], failed: bool
) -> None:
    # Our worker fails, so we regroup; meanwhile the others finished the job (exit 0 for
    # the scheduler) or spent its budget (the job's failure).
    crash = script(tmp_path, "crash.py", "raise SystemExit(3)\n")
    handler = ClosedByOthersHandler("job", failed)
    result, _ = run_agent(("-u", crash), 1, handler=handler, max_restarts=3)
    err = capfd.readouterr().err
    if failed:
        assert result.state == WorkerState.FAILED and result.exit_code != 0, result
        assert "the job failed on another node" in result.message
    else:
        assert result.state == WorkerState.SUCCEEDED and result.exit_code == 0, result
        assert "the job finished on the other nodes while this node was regrouping" in err


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
    def elastic_agent_start(self, spec: WorkerSpec, config: ElasticConfig) -> None:
        self.calls.append(("start", dict(config.plugin_options)))

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
        config=ElasticConfig(plugin_options={"k": "v"}),
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
