"""The agent as its own process (orphans, signals, tee and logs) and through the CLI
(environment parity with torchrun, a real gloo job restarting on a fresh port)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from elastic.harness.commands import write_script as script
from elastic.harness.processes import pid_alive
from elastic.testing.waits import wait_until

REPO = Path(__file__).resolve().parent.parent


# --- the agent as its own process ------------------------------------------------------
DRIVER = """
import json, sys
from elastic.core.agent.loop import LocalElasticAgent
from elastic.core.rendezvous.local import LocalRendezvousHandler
from elastic.core.interfaces.spec import WorkerSpec
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
# Values that differ by design: ids per run, paths under the run's log dir, and the port
# (each launcher runs on a free one of its own).
EXPECTED_DIFFERENCES = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["standalone", "static"])
def test_cli_worker_env_matches_torchrun(tmp_path: Path, backend: str) -> None:
    """The same variables with the same values as torchrun's, but for the store: with
    --standalone (torchrun's c10d) torchrun's workers share its agent's store and ours
    get a fresh one per round (``TORCHELASTIC_USE_AGENT_STORE`` True vs False); with
    static (torchrun's default) both use node 0's store on --master-port."""
    from elastic.harness.commands import cli_env, run_elastic
    from elastic.testing.ports import free_port

    dump = script(tmp_path, "dump_env.py", DUMP_ENV)
    env = cli_env()
    env.pop("OMP_NUM_THREADS", None)
    envs, ports = {}, {}
    for name, cmd in {
        "torchrun": [sys.executable, "-m", "torch.distributed.run"],
        "elastic": [sys.executable, "-m", "elastic", "run"],
    }.items():
        out = tmp_path / name
        out.mkdir()
        flags = ["--nproc-per-node=2", "--max-restarts=2", "--role=trainer"]
        if backend == "standalone":
            flags.append("--standalone")
        else:
            ports[name] = free_port()
            flags += ["--nnodes=1", "--node-rank=0", "--master-addr=127.0.0.1"]
            flags += ["--rdzv-backend=static", f"--master-port={ports[name]}"]
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
    expected = EXPECTED_DIFFERENCES
    if backend == "standalone":
        expected = expected | {"TORCHELASTIC_USE_AGENT_STORE"}
    for ours, theirs in zip(envs["elastic"], envs["torchrun"], strict=True):
        # Our own channels to the worker (preemption control, progress) come on top.
        extras = {k for k in ours if k.startswith("ELASTIC_")} - set(theirs)
        channels = {
            "ELASTIC_CONTROL_FILE",
            "ELASTIC_CONTROL_SLOT",
            "ELASTIC_PROGRESS_FILE",
            "ELASTIC_PREEMPTION_SIGNAL",  # which signal a listening worker defers, and how
            "ELASTIC_PREEMPTION_GRACE",  # long (a whole SLURM step signalled at once)
        }
        assert extras <= channels, extras
        assert sorted(set(ours) - extras) == sorted(theirs)
        differing = {k for k in theirs if ours[k] != theirs[k]}
        assert differing <= expected, {k: (ours[k], theirs[k]) for k in differing}
        assert ours["OMP_NUM_THREADS"] == theirs["OMP_NUM_THREADS"] == "1"
        if backend == "standalone":
            assert ours["MASTER_ADDR"] == theirs["MASTER_ADDR"] == "localhost"
            assert ours["TORCHELASTIC_USE_AGENT_STORE"] == "False"
            assert theirs["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        else:
            assert ours["MASTER_ADDR"] == theirs["MASTER_ADDR"] == "127.0.0.1"
            assert ours["MASTER_PORT"] == str(ports["elastic"])
            assert theirs["MASTER_PORT"] == str(ports["torchrun"])
            assert ours["TORCHELASTIC_USE_AGENT_STORE"] == "True"
            assert theirs["TORCHELASTIC_USE_AGENT_STORE"] == "True"


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
    from elastic.harness.commands import run_elastic

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
    from elastic.harness.commands import run_elastic

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


def test_cli_sigkill_leaves_no_orphans(tmp_path: Path, procs: Any) -> None:
    worker = script(tmp_path, "w.py", PID_THEN_WAIT)
    agent = procs.elastic("run", "--standalone", "--nproc-per-node=2", worker, str(tmp_path))
    pids = _worker_pids(tmp_path, 2)
    os.kill(agent.pid, signal.SIGKILL)
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), 5)


def test_agent_modules_do_not_import_torch() -> None:
    code = (
        "import sys, elastic.core.agent.loop, elastic.core.rendezvous.local, "
        "elastic.core.workers.logs, "
        "elastic.core.workers.process, elastic.core.workers.env, elastic.core.agent.failure; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
