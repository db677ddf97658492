"""``--stall-timeout`` end to end: real gloo workers where rank 1 never reaches an
``all_reduce`` (it sleeps) while rank 0 waits in it, standalone and on two c10d nodes.

The agent must find the hang within the timeout + 2 s (+ a margin for this loaded 2-core
machine), dump both ranks' stacks (rank 1 in its sleep, rank 0 in ``all_reduce``), name
rank 1 the root cause on every node, and with a restart left finish the job. A worker
busy in one long call, or waiting at start-up for a peer that is still busy, is left
alone; ``elastic.heartbeat()`` is cheap."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from elastic.harness.commands import elastic_cmd, run_elastic, write_script
from elastic.harness.processes import Processes
from elastic.testing.ports import free_port

T = 4.0  # the stall timeout used throughout
MARGIN = 1.5  # a loaded 2-core machine delays the monitor and the CPU samples

WORKER = """
import json, os, sys, time
import torch
import torch.distributed as dist
import elastic

out, beat, more = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(1)
for step in range(3):
    dist.all_reduce(t)
    if beat:
        elastic.heartbeat()
if rank == 1 and attempt == 0:
    with open(os.path.join(out, "hang.json"), "w") as f:
        json.dump({"t": time.time(), "pid": os.getpid()}, f)
    time.sleep(300)  # rank 1 never reaches the all_reduce below
dist.all_reduce(t)
for step in range(more):  # attempt 1: keep running a little, progressing
    time.sleep(0.2)
    dist.all_reduce(t)
    elastic.heartbeat()
dist.destroy_process_group()
open(os.path.join(out, f"done-{attempt}-{rank}"), "w").close()
"""


def worker(tmp_path: Path) -> str:
    return write_script(tmp_path, "hang.py", WORKER)


def hang_time(tmp_path: Path) -> float:
    """When rank 1 went to sleep: its file's last write, which comes after the time the
    file holds (a loaded machine can hold the worker between the two)."""
    path = tmp_path / "hang.json"
    return max(json.loads(path.read_text())["t"], path.stat().st_mtime)


def check_summary(data: dict, tmp_path: Path, source: str | None = None) -> None:
    """Rank 1 (asleep) is the root cause with its stack; rank 0's stack is in all_reduce;
    the stall was found within T + 2 s of the hang."""
    root = data["root_cause"]
    assert root["rank"] == 1, root["message"]
    assert root["signal"] == "SIGKILL" and data["exit_code"] == 137
    stall = root["extra"]["stall"]
    assert stall["waiting"] is None and "time.sleep(300)" in stall["where"]
    assert "time.sleep(300)" in root["extra"]["stacks"]
    assert root["message"].startswith("stalled: no progress for")
    if source is not None:
        assert stall["source"] == source
    found = stall["detected_at"] - hang_time(tmp_path)
    print(f"stall found {found:.2f}s after the hang (T={T})")
    assert found <= T + 2 + MARGIN
    others = [o for o in data["others"] if o["rank"] == 0]
    assert others, data["others"]
    assert "in all_reduce" in others[0]["extra"]["stacks"]
    assert "all_reduce" in others[0]["extra"]["stall"]["waiting"]


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("beat", ["0", "1"], ids=["cpu-time", "heartbeat"])
def test_standalone_hang_found_dumped_and_blamed(tmp_path: Path, beat: str) -> None:
    summary = tmp_path / "summary.json"
    proc = run_elastic(
        "run",
        "--standalone",
        "--nproc-per-node=2",
        f"--stall-timeout={T}",
        f"--error-summary={summary}",
        worker(tmp_path),
        str(tmp_path),
        beat,
        "0",
        timeout=120,
    )
    assert proc.returncode == 137, proc.stderr
    data = json.loads(summary.read_text())
    check_summary(data, tmp_path, source="heartbeat" if beat == "1" else "cpu")
    err = proc.stderr
    assert "elastic: stall: worker rank" in err
    assert "time.sleep(300)" in err and "in all_reduce" in err  # the printed summary
    assert "killed by the agent" in err and "possible OOM kill" not in err
    pid = json.loads((tmp_path / "hang.json").read_text())["pid"]
    stacks = tmp_path / "stacks.txt"
    assert not stacks.exists()  # the dumps live next to each worker's error file
    assert data["root_cause"]["pid"] == pid


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_standalone_hang_restarts_and_finishes(tmp_path: Path) -> None:
    proc = run_elastic(
        "run",
        "--standalone",
        "--nproc-per-node=2",
        f"--stall-timeout={T}",
        "--max-restarts=1",
        worker(tmp_path),
        str(tmp_path),
        "0",
        "0",
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "done-1-0").exists() and (tmp_path / "done-1-1").exists()
    assert not (tmp_path / "done-0-0").exists()  # attempt 0 never finished: it hung
    assert proc.stderr.count("elastic: stall: worker rank") == 1


def two_nodes(
    procs: Processes, tmp_path: Path, *flags: str, more: str = "0"
) -> tuple[list[subprocess.Popen[str]], str, str]:
    port, run_id = free_port(), f"stall-{os.getpid()}-{time.monotonic_ns()}"
    script = worker(tmp_path)
    agents = [
        procs.elastic(
            "run",
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={run_id}",
            f"--stall-timeout={T}",
            "--monitor-interval=0.1",
            *[f.format(node=node) for f in flags],
            script,
            str(tmp_path),
            "0",
            more,
        )
        for node in range(2)
    ]
    return agents, f"127.0.0.1:{port}", run_id


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_nodes_hang_found_dumped_and_blamed_on_both(procs: Processes, tmp_path: Path) -> None:
    summary = str(tmp_path / "summary-{node}.json")
    agents, _, _ = two_nodes(procs, tmp_path, f"--error-summary={summary}")
    outputs = [a.communicate(timeout=150) for a in agents]
    for node, (agent, (_, err)) in enumerate(zip(agents, outputs, strict=True)):
        assert agent.returncode == 137, err
        data = json.loads(Path(summary.format(node=node)).read_text())
        check_summary(data, tmp_path)  # every node: rank 1 first, rank 0's stack too
        assert "time.sleep(300)" in err and "in all_reduce" in err
    finders = [err for _, err in outputs if "elastic: stall: worker rank 1" in err]
    assert finders, "the node of the sleeping rank found the stall"


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_nodes_hang_restarts_and_finishes(procs: Processes, tmp_path: Path) -> None:
    agents, endpoint, run_id = two_nodes(procs, tmp_path, "--max-restarts=1", more="40")
    deadline = time.monotonic() + 120
    while not (tmp_path / "done-1-0").exists() and time.monotonic() < deadline:
        if list(tmp_path.glob("done-*")) or all(a.poll() is not None for a in agents):
            break
        status = subprocess.run(
            elastic_cmd(
                "status",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={endpoint}",
                f"--rdzv-id={run_id}",
            ),
            capture_output=True,
            text=True,
            timeout=30,
        )
        if "root cause: rank 1" in status.stdout:
            # the published root cause of attempt 0 with its stack, while attempt 1 runs
            assert "time.sleep(300)" in status.stdout, status.stdout
            break
        time.sleep(0.5)
    else:
        pytest.fail("elastic status never showed the stall's root cause")
    for agent in agents:
        _, err = agent.communicate(timeout=120)
        assert agent.returncode == 0, err
    assert (tmp_path / "done-1-0").exists() and (tmp_path / "done-1-1").exists()


LEFT_ALONE = """
import os, sys, time
import elastic

mode = sys.argv[1]
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
assert attempt == "0", "the worker was restarted: it was taken for a hung one"
if mode == "heartbeat":  # heartbeats around calls shorter than the timeout
    for _ in range(4):
        elastic.heartbeat()
        time.sleep({short})
elif mode == "busy":  # one long call that computes, longer than the timeout
    end = time.monotonic() + {long}
    while time.monotonic() < end:
        sum(range(2_000_000))
    time.sleep({short})
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["heartbeat", "busy"])
def test_long_call_is_left_alone(tmp_path: Path, mode: str) -> None:
    script = write_script(tmp_path, "long.py", LEFT_ALONE.format(short=T * 0.6, long=T * 1.5))
    started = time.monotonic()
    proc = run_elastic("run", "--standalone", f"--stall-timeout={T}", script, mode, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert "stall" not in proc.stderr
    assert time.monotonic() - started >= T * 1.5  # it really ran past the timeout


SLOW_PEER = """
import os, time
import torch
import torch.distributed as dist

if os.environ["RANK"] == "1":  # busy for longer than the timeout before joining
    end = time.monotonic() + {busy}
    while time.monotonic() < end:
        sum(range(2_000_000))
dist.init_process_group("gloo")  # rank 0 waits here, idle, for rank 1
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_waiting_for_a_busy_peer_is_not_a_stall(tmp_path: Path) -> None:
    script = write_script(tmp_path, "slow_peer.py", SLOW_PEER.format(busy=T * 1.75))
    proc = run_elastic(
        "run", "--standalone", "--nproc-per-node=2", f"--stall-timeout={T}", script, timeout=90
    )
    assert proc.returncode == 0, proc.stderr
    assert "stall" not in proc.stderr


# A worker whose interpreter shuts down unregisters faulthandler: it no longer answers a
# dump. This one does so by hand, then stays idle for `idle` s and exits 0.
MUTE = """
import faulthandler, signal, sys, time
faulthandler.unregister(signal.SIGURG)
time.sleep(float(sys.argv[1]))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("idle", "stalls"), [(T + 0.5, False), (60.0, True)])
def test_a_worker_that_does_not_answer_is_blamed_only_once_it_neither_answers_nor_exits(
    tmp_path: Path, idle: float, stalls: bool
) -> None:
    from elastic.core.watchdog.stall import NO_ANSWER_GRACE

    script = write_script(tmp_path, "mute.py", MUTE)
    started = time.monotonic()
    proc = run_elastic("run", "--standalone", f"--stall-timeout={T}", script, str(idle), timeout=90)
    took = time.monotonic() - started
    if not stalls:  # it exited by itself within the grace: not a hang
        assert proc.returncode == 0, proc.stderr
        assert "stall" not in proc.stderr
    else:
        assert proc.returncode != 0, proc.stderr
        assert "stuck at <no stack: the worker did not answer>" in proc.stderr
        assert T + NO_ANSWER_GRACE <= took < T + NO_ANSWER_GRACE + 10 * MARGIN, took


@pytest.mark.timeout(60)
def test_heartbeat_is_cheap_and_a_no_op_outside_elastic(tmp_path: Path) -> None:
    from elastic.core.watchdog.beats import ENV_PROGRESS, ProgressFile

    progress = ProgressFile(str(tmp_path / "progress"))
    code = (
        "import time, elastic\n"
        "n = 200_000\n"
        "t = time.perf_counter()\n"
        "for _ in range(n): elastic.heartbeat()\n"
        "print(n / (time.perf_counter() - t))\n"
    )
    rates = {}
    for name, env in (("under elastic", {ENV_PROGRESS: progress.path}), ("outside", {})):
        base = {k: v for k, v in os.environ.items() if k != ENV_PROGRESS}
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**base, **env},
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        rates[name] = float(out.stdout)
    under, outside = rates["under elastic"], rates["outside"]
    print(f"elastic.heartbeat(): {under:,.0f} calls/s ({outside:,.0f} outside elastic run)")
    assert under >= 20_000 and outside >= 20_000
    count, when = progress.read()
    assert count == 200_000 and abs(when - time.time()) < 30  # the agent sees every call
    progress.close()


@pytest.mark.timeout(60)
def test_dump_chains_an_existing_sitecustomize_and_spares_others(tmp_path: Path) -> None:
    """The boot sitecustomize runs the one it shadows, a dump shows the sleeping frame,
    and SIGURG does not hurt a process that never registered."""
    from elastic.core.watchdog import stacks

    user = tmp_path / "user_site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = '1'\n")
    script = write_script(
        tmp_path,
        "sleeper.py",
        """
        import os, sys, time
        print(os.environ.get("USER_SITE_RAN"), flush=True)
        def nap():
            time.sleep(30)
        nap()
        """,
    )
    dump_file = str(tmp_path / "stacks.txt")
    env = {**os.environ, **stacks.worker_env(dump_file, str(user))}
    registered = subprocess.Popen(
        [sys.executable, script], env=env, stdout=subprocess.PIPE, text=True
    )
    plain = subprocess.Popen(
        [sys.executable, "-I", script], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert registered.stdout is not None and plain.stdout is not None
        assert registered.stdout.readline().strip() == "1"  # the user's sitecustomize ran
        plain.stdout.readline()
        # The print returns a moment before nap() is entered: dump until it sleeps.
        deadline, where = time.monotonic() + 10.0, ""
        while not where.endswith("in nap: time.sleep(30)") and time.monotonic() < deadline:
            pair = {0: (registered.pid, dump_file), 1: (plain.pid, dump_file)}
            dumps = stacks.dump_stacks(pair)
            assert 0 in dumps
            where = dumps[0].where()
        assert where.endswith("in nap: time.sleep(30)"), where
        assert dumps[0].waiting_in() is None
        os.kill(plain.pid, stacks.DUMP_SIGNAL)  # never registered: ignored by default
        time.sleep(0.3)
        assert registered.poll() is None and plain.poll() is None
    finally:
        registered.kill()
        plain.kill()
        registered.wait()
        plain.wait()


TRAIN = """
import sys, time
import elastic

steps = [0]


def step(state):  # idle steps (a sleep), each shorter than the timeout
    steps[0] += 1
    time.sleep({nap})
    return steps[0] >= 4  # 4 naps: idle past the timeout and the time a stall is found in


if sys.argv[1] == "train":
    elastic.train(step, elastic.State(), checkpointer="")
else:  # the same steps without elastic.train: no heartbeat, no CPU time
    while not step(None):
        pass
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("via", ["train", "plain"])
def test_elastic_train_heartbeats_every_step(tmp_path: Path, via: str) -> None:
    script = write_script(tmp_path, "train.py", TRAIN.format(nap=T * 0.6))
    proc = run_elastic("run", "--standalone", f"--stall-timeout={T}", script, via, timeout=90)
    if via == "train":
        assert proc.returncode == 0, proc.stderr
        assert "stall" not in proc.stderr
    else:  # the control: idle for longer than the timeout with no heartbeat is a stall
        assert proc.returncode == 137, proc.stderr
        assert "elastic: stall: worker rank 0" in proc.stderr
