"""``--health-port``: /healthz, /readyz and /metrics of a real agent while its gloo
workers run, while one hangs, and while it waits for its rendezvous; a taken port is one
line and exit 2; the agent serving it has no torch in its address space."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from elastic.harness.commands import cli_env, run_elastic, write_script
from elastic.harness.distributions import make_distribution
from elastic.harness.processes import Processes
from elastic.harness.prometheus_names import convention_breaks
from elastic.testing.ports import free_port
from elastic.testing.waits import wait_until

T = 4.0

WORKER = """
import json, os, sys, time
import torch
import torch.distributed as dist
import elastic

out = sys.argv[1]
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(1)
for step in range(25):  # ~5 s of steady progress
    time.sleep(0.2)
    dist.all_reduce(t)
    elastic.heartbeat()
if rank == 1 and attempt == 0:
    # Written whole, then renamed: the test reads it as soon as the name appears.
    with open(os.path.join(out, "hang.json.tmp"), "w") as f:
        json.dump({"t": time.time()}, f)
    os.replace(os.path.join(out, "hang.json.tmp"), os.path.join(out, "hang.json"))
    time.sleep(300)
dist.all_reduce(t)
dist.destroy_process_group()
open(os.path.join(out, f"done-{attempt}-{rank}"), "w").close()
"""


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""  # not listening (yet, or any more)


def metrics(port: int) -> dict[str, list]:
    from prometheus_client.parser import text_string_to_metric_families

    status, text = get(port, "/metrics")
    assert status == 200, text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_health_during_a_run_and_a_stall(procs: Processes, tmp_path: Path) -> None:
    port = free_port()
    script = write_script(tmp_path, "worker.py", WORKER)
    agent = procs.elastic(
        "run",
        "--standalone",
        "--nproc-per-node=2",
        f"--health-port={port}",
        f"--stall-timeout={T}",
        "--max-restarts=1",
        script,
        str(tmp_path),
    )
    assert wait_until(lambda: get(port, "/healthz")[0] == 200, timeout=30)
    assert wait_until(lambda: get(port, "/progressz")[0] == 200, timeout=60), get(
        port, "/progressz"
    )
    status, body = get(port, "/progressz")
    assert body.startswith("running: 2 workers"), body
    assert get(port, "/readyz") == (200, "running\n")
    samples = metrics(port)
    assert samples["elastic_workers_progressing"][0].value == 1
    assert samples["elastic_stall_timeout_seconds"][0].value == T
    beats = {s.labels["rank"]: s.value for s in samples["elastic_worker_heartbeats"]}
    assert set(beats) == {"0", "1"}
    idle = {s.labels["rank"] for s in samples["elastic_worker_idle_seconds"]}
    alias = {s.labels["rank"] for s in samples["elastic_worker_seconds_since_progress"]}
    assert idle == alias == {"0", "1"}
    assert convention_breaks(get(port, "/metrics")[1]) == []
    assert "process_cpu_seconds" in samples  # prometheus-client's process collector
    maps = Path(f"/proc/{agent.pid}/maps").read_text()
    assert "libtorch" not in maps  # the agent serving all this never imported torch

    if not wait_until(lambda: (tmp_path / "hang.json").exists(), timeout=60):
        agent.kill()
        pytest.fail(f"rank 1 never hung: {agent.communicate()[1]}")
    hung_at = json.loads((tmp_path / "hang.json").read_text())["t"]
    seen: list[tuple[float, int, str]] = []

    def not_ready() -> bool:
        code, text = get(port, "/progressz")
        seen.append((time.time() - hung_at, code, text.strip()))
        return code == 503 and ("not progressing" in text or "stalled" in text)

    assert wait_until(not_ready, timeout=T + 10, interval=0.1), seen
    assert seen[-1][0] <= T + 2, seen  # 503 before the stall is acted on (at T/2)
    assert metrics(port)["elastic_workers_progressing"][0].value == 0
    assert get(port, "/healthz")[0] == 200  # alive all along: the agent's loop runs
    assert get(port, "/readyz")[0] == 200
    _, err = agent.communicate(timeout=90)
    assert agent.returncode == 0, err
    assert (tmp_path / "done-1-0").exists() and (tmp_path / "done-1-1").exists()
    assert get(port, "/healthz")[0] == 0  # the endpoint ends with the agent


@pytest.mark.timeout(90)
def test_readyz_while_waiting_for_the_rendezvous(procs: Processes, tmp_path: Path) -> None:
    port, rdzv = free_port(), free_port()
    script = write_script(tmp_path, "noop.py", "pass\n")
    agent = procs.elastic(
        "run",
        "--nnodes=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{rdzv}",
        "--rdzv-id=health-wait",
        f"--health-port={port}",
        script,
        env=cli_env({"ELASTIC_LIVENESS_TIMEOUT": "1"}),
    )
    assert wait_until(lambda: get(port, "/healthz")[0] == 200, timeout=30)
    # Readiness never holds the rendezvous up (a not-ready pod loses its DNS name behind a
    # headless Service): ready while waiting, even past the liveness bound, since the
    # loop waits in the rendezvous, a wait with its own deadline.
    time.sleep(2.5)
    assert get(port, "/healthz") == (200, "ok\n")
    assert get(port, "/readyz") == (200, "waiting for rendezvous\n")
    status, body = get(port, "/progressz")
    assert (status, body.strip()) == (503, "waiting for rendezvous")
    assert get(port, "/nope")[0] == 404
    status, text = get(port, "/metrics")
    assert convention_breaks(text) == []
    samples = metrics(port)
    assert samples["elastic_restarts"][0].value == 0
    assert samples["elastic_restart_count"][0].value == 0  # deprecated alias, one release
    assert samples["elastic_agent_live"][0].value == 1
    assert samples["elastic_workers_progressing"][0].value == 0
    assert samples["elastic_agent_ready"][0].value == 0  # its deprecated alias
    agent.send_signal(signal.SIGTERM)
    agent.communicate(timeout=30)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["flag", "torch-env"])
def test_taken_port_is_one_line_and_exit_2(tmp_path: Path, how: str) -> None:
    marker = tmp_path / "ran"
    script = write_script(tmp_path, "w.py", f"open({str(marker)!r}, 'w').close()\n")
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        flags = [f"--health-port={port}"] if how == "flag" else []
        env = {"TORCHELASTIC_HEALTH_CHECK_PORT": str(port)} if how != "flag" else {}
        proc = run_elastic("run", "--standalone", *flags, script, env=env, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("elastic run: error:"), proc.stderr
    assert f"--health-port {port}" in lines[0] and "in use" in lines[0]
    assert not marker.exists()  # nothing started


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flag", "env", "expected"),
    [
        ("--health-port=70000", {}, "not a port"),
        ("--stall-timeout=0", {}, "positive number"),
        ("", {"PET_STALL_TIMEOUT": "-3"}, "--stall-timeout"),
        ("", {"PET_STALL_TIMEOUT": "soon"}, "--stall-timeout"),
    ],
)
def test_bad_values_are_one_line_and_exit_2(
    tmp_path: Path, flag: str, env: dict[str, str], expected: str
) -> None:
    script = write_script(tmp_path, "w.py", "pass\n")
    flags = [flag] if flag else []
    proc = run_elastic("run", "--standalone", *flags, script, env=env, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert expected in lines[0]


STUCK_PLUGIN = """
import os, time
from elastic.core.plugin.hookspecs import hookimpl

@hookimpl
def elastic_check_workers(workers):
    # Called from the agent's own loop every monitor tick: once told, it never returns.
    while os.path.exists(os.environ["STUCK_MARKER"]):
        time.sleep(0.05)
"""


@pytest.mark.timeout(120)
def test_a_stuck_agent_loop_fails_liveness(procs: Processes, tmp_path: Path) -> None:
    """A hook plugin that hangs in the agent's loop (not a worker): /healthz and /readyz
    turn 503 after ELASTIC_LIVENESS_TIMEOUT while the HTTP thread still answers, and
    come back once the loop does."""
    port, marker = free_port(), tmp_path / "stuck"
    site = make_distribution(
        tmp_path / "site",
        "stuck_plugin",
        "[elastic.plugins]\nstuck = stuck_plugin\n",
        {"stuck_plugin": STUCK_PLUGIN},
    )
    script = write_script(tmp_path, "w.py", "import time\ntime.sleep(60)\n")
    env = cli_env(
        {
            "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
            "STUCK_MARKER": str(marker),
            "ELASTIC_LIVENESS_TIMEOUT": "2",
        }
    )
    agent = procs.elastic("run", "--standalone", f"--health-port={port}", script, env=env)
    assert wait_until(lambda: get(port, "/readyz") == (200, "running\n"), timeout=30)
    time.sleep(2.5)  # monitoring for longer than the bound: every tick is a wait
    assert get(port, "/healthz") == (200, "ok\n")
    marker.touch()
    t0 = time.monotonic()
    assert wait_until(lambda: get(port, "/healthz")[0] == 503, timeout=10), get(port, "/healthz")
    assert 1.5 <= time.monotonic() - t0 <= 5
    status, body = get(port, "/healthz")
    assert body.startswith("stuck: the agent's loop has not come back for "), body
    assert body.rstrip().endswith("(bound 2s) while running"), body
    assert get(port, "/readyz")[0] == 503
    assert metrics(port)["elastic_agent_live"][0].value == 0
    marker.unlink()  # the loop comes back: alive again
    assert wait_until(lambda: get(port, "/healthz") == (200, "ok\n"), timeout=10)
    agent.send_signal(signal.SIGTERM)
    agent.communicate(timeout=30)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf"])
def test_a_bad_liveness_timeout_is_one_line_and_exit_2(tmp_path: Path, value: str) -> None:
    script = write_script(tmp_path, "w.py", "pass\n")
    env = {"ELASTIC_LIVENESS_TIMEOUT": value}
    proc = run_elastic("run", "--standalone", f"--health-port={free_port()}", script, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"ELASTIC_LIVENESS_TIMEOUT={value!r}: expected a positive number" in lines[0]
