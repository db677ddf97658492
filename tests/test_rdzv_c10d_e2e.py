"""``elastic run --rdzv-backend=c10d`` end to end: real agents on loopback, gloo workers."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from elastic.core.agent.departure import PEER_LOSS_WAIT
from elastic.harness.processes import Processes
from elastic.testing.waits import wait_until

pytestmark = pytest.mark.slow

TRAIN = """
import os, sys, time
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"START restart={restart} at={time.time():.3f}", flush=True)
if os.environ.get("FAIL_GROUP_RANK") == os.environ["GROUP_RANK"] and restart == 0:
    print(f"FAILING at={time.time():.3f}", flush=True)  # on stdout: the failure says nothing
    sys.exit(3)  # a worker failure on one node, first attempt only (before torch loads)
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print(f"RESULT rank={os.environ['RANK']} world={os.environ['WORLD_SIZE']} "
      f"group_rank={os.environ['GROUP_RANK']} restart={restart} sum={int(t.item())} "
      f"master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
dist.destroy_process_group()
stop = os.environ.get("STOP_FILE")
while stop and not os.path.exists(stop):
    time.sleep(0.1)
"""

RESULT = re.compile(r"RESULT rank=(\d+) world=(\d+) group_rank=(\d+) restart=(\d+) sum=(\d+)")
CONF = "heartbeat_interval=0.5,heartbeat_timeout=2.5,close_timeout=10,last_call_timeout=2"


class Agent:
    """One ``elastic run`` node whose output is collected as it runs."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def results(self) -> list[tuple[int, ...]]:
        # Workers share the console and run with -u, so one line may hold two results.
        return [tuple(map(int, m.groups())) for m in RESULT.finditer("".join(self.lines))]

    def text(self) -> str:
        self._reader.join(timeout=5) if self.proc.poll() is not None else None
        return "".join(self.lines)

    def wait(self, timeout: float = 30) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return code

    def kill_node(self) -> None:
        """SIGKILL the agent and its workers: the whole machine is gone."""
        os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture
def job(procs: Processes, port: int, tmp_path: Path):  # noqa: ANN201
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    stop = tmp_path / "stop"

    def start(
        nnodes: str,
        nproc: int = 1,
        extra_env: dict[str, str] | None = None,
        args: tuple[str, ...] = (),
        conf: str = CONF,
    ) -> Agent:
        env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            STOP_FILE=str(stop),
            RES_OPTIONS="timeout:1 attempts:1",
            **(extra_env or {}),
        )
        proc = procs.elastic(
            "run",
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=e2e",
            f"--rdzv-conf={conf}",
            "--monitor-interval=0.1",
            *args,
            str(script),
            env=env,
            stderr=subprocess.STDOUT,
        )
        return Agent(proc)

    def start_host(nnodes: str, nproc: int = 1, **kw: object) -> Agent:
        agent = start(nnodes, nproc, **kw)  # type: ignore[arg-type]
        assert wait_until(lambda: listening(port), timeout=20), agent.text()
        return agent

    start.host = start_host  # type: ignore[attr-defined]
    start.stop = stop  # type: ignore[attr-defined]
    return start


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def finish(agents: list[Agent], stop: Path, timeout: float = 30) -> None:
    stop.touch()
    for agent in agents:
        assert agent.wait(timeout) == 0, agent.text()


@pytest.mark.parametrize("nodes,nproc", [(2, 2), (4, 1)])
def test_fixed_size_job_all_reduces(job, nodes: int, nproc: int) -> None:  # noqa: ANN001
    job.stop.touch()  # run once and exit
    agents = [job.host(str(nodes), nproc)] + [job(str(nodes), nproc) for _ in range(nodes - 1)]
    for agent in agents:
        assert agent.wait(60) == 0, agent.text()
    results = [r for a in agents for r in a.results()]
    world = nodes * nproc
    assert sorted(r[0] for r in results) == list(range(world))
    assert {r[1] for r in results} == {world}
    assert {r[4] for r in results} == {world * (world + 1) // 2}  # the all_reduce sum
    assert sorted({r[2] for r in results}) == list(range(nodes))


def test_scale_up_then_down_on_sigkill(job) -> None:  # noqa: ANN001
    host, second = job.host("2:3"), job("2:3")
    both = [host, second]
    assert wait_until(lambda: all(a.results() for a in both), 40), host.text() + second.text()
    assert {r[1] for a in both for r in a.results()} == {2}

    third = job("2:3")  # scale-up: everyone re-forms with three
    trio = [host, second, third]
    assert wait_until(lambda: all(any(r[1] == 3 for r in a.results()) for a in trio), 40), (
        third.text()
    )
    sums = {r[4] for a in trio for r in a.results() if r[1] == 3}
    assert sums == {6}

    third.kill_node()  # a non-host node dies: survivors re-form with two
    killed = time.monotonic()
    assert wait_until(
        lambda: all(a.results()[-1][1] == 2 and len(a.results()) >= 3 for a in both), 40
    ), host.text()
    assert time.monotonic() - killed < 20
    finish(both, job.stop)


def test_a_killed_agent_is_seen_at_once_not_after_heartbeat_timeout(job) -> None:  # noqa: ANN001
    """Its kernel closes its connection to rank 0's presence port: the survivors regroup
    in seconds although heartbeat_timeout is 30 s."""
    slow = CONF.replace("heartbeat_timeout=2.5", "heartbeat_timeout=30")
    trio = [job.host("2:3", conf=slow), job("2:3", conf=slow), job("2:3", conf=slow)]
    assert wait_until(lambda: all(any(r[1] == 3 for r in a.results()) for a in trio), 60), "".join(
        a.text() for a in trio
    )
    victim = next(a for a in trio[1:] if a.results()[0][2] != 0)  # not rank 0, not the host
    survivors = [a for a in trio if a is not victim]
    victim.kill_node()
    killed = time.monotonic()
    formed = re.compile(r"round \d+ formed: 2 nodes \(was 3\)")
    assert wait_until(lambda: all(formed.search(a.text()) for a in survivors), 20), survivors[
        0
    ].text()
    elapsed = time.monotonic() - killed
    print(f"survivors formed a new round {elapsed:.2f}s after the SIGKILL")
    assert elapsed < 5
    finish(survivors, job.stop)


def test_the_store_moves_when_its_host_is_preempted(job) -> None:  # noqa: ANN001
    """SIGTERM to the agent hosting the store: it hands the store to a member, the others
    regroup without it (no restart) and finish the job with exit 0."""
    trio = [job.host("2:3"), job("2:3"), job("2:3")]
    assert wait_until(lambda: all(any(r[1] == 3 for r in a.results()) for a in trio), 60), "".join(
        a.text() for a in trio
    )
    host, survivors = trio[0], trio[1:]
    host.proc.send_signal(signal.SIGTERM)
    noticed = time.monotonic()
    formed = re.compile(r"round \d+ formed: 2 nodes \(was 3\)")
    assert wait_until(lambda: all(formed.search(a.text()) for a in survivors), 20), (
        host.text() + survivors[0].text()
    )
    elapsed = time.monotonic() - noticed
    print(f"survivors formed a new round {elapsed:.2f}s after the store host's SIGTERM")
    assert elapsed < 3
    assert host.wait(30) == 128 + signal.SIGTERM
    assert "handed the c10d rendezvous store over" in host.text()
    finish(survivors, job.stop)
    assert all(r[3] == 0 for a in survivors for r in a.results())  # no restart spent


def test_sigkill_of_the_hosting_agent_fails_the_others_clearly(job) -> None:  # noqa: ANN001
    host = job.host("2")
    others = [job("2")]
    assert wait_until(lambda: all(a.results() for a in [host, *others]), 40), host.text()
    host.kill_node()
    started = time.monotonic()
    code = others[0].wait(30)
    assert code != 0
    assert time.monotonic() - started < 15
    assert (
        "rendezvous" in others[0].text()
        and "agent hosting the c10d store is gone" in others[0].text()
    )


def test_restart_budget_is_job_wide(job) -> None:  # noqa: ANN001
    job.stop.touch()
    env = {"FAIL_GROUP_RANK": "1"}
    # max_restarts=1: the one failure restarts every node once, with the same count.
    args = ("--max-restarts=1",)
    agents = [job.host("2", 1, extra_env=env, args=args), job("2", 1, extra_env=env, args=args)]
    codes = [a.wait(60) for a in agents]
    assert codes == [0, 0], "".join(a.text() for a in agents)
    results = [r for a in agents for r in a.results()]
    assert {r[3] for r in results} == {1}, results  # TORCHELASTIC_RESTART_COUNT everywhere
    assert len(results) == 2
    # A failure that says nothing of its cause (an exit code alone) could be a peer's
    # departure: it is a failure of its own once the other node's agent beat since, not
    # after the whole PEER_LOSS_WAIT for a departure that never comes.
    text = agents[1].text()
    failed, restarted = (
        float(m.group(1)) if (m := re.search(pattern, text)) else float("nan")
        for pattern in (r"FAILING at=([\d.]+)", r"START restart=1 at=([\d.]+)")
    )
    took = restarted - failed
    assert took < PEER_LOSS_WAIT - 2, f"restarted {took:.2f}s after the failure\n{text}"
    print(f"a failure that names nothing: the node restarted {took:.2f}s after it")


def test_two_jobs_on_one_endpoint_never_merge(job) -> None:  # noqa: ANN001
    other = ("--rdzv-id=other",)
    first = [job.host("2"), job("2")]
    second = [job("2", args=other), job("2", args=other)]
    everyone = first + second
    assert wait_until(lambda: all(a.results() for a in everyone), 60), "".join(
        a.text() for a in everyone
    )
    for pair in (first, second):
        results = [r for a in pair for r in a.results()]
        assert sorted(r[0] for r in results) == [0, 1]
        assert {(r[1], r[4]) for r in results} == {(2, 3)}  # world 2, sum 1+2
    # The second job finishes first: the store's host belongs to the first.
    job.stop.touch()
    for agent in second + first:
        assert agent.wait(60) == 0, agent.text()


def test_forged_join_is_ignored_with_a_token(job) -> None:  # noqa: ANN001
    token = {"ELASTIC_RDZV_TOKEN": "the-real-token-of-the-job-32-byte"}
    members = [job.host("2:3", extra_env=token), job("2:3", extra_env=token)]
    assert wait_until(lambda: all(a.results() for a in members), 40), members[0].text()
    forger = job("2:3", extra_env={"ELASTIC_RDZV_TOKEN": "a-guess-of-more-than-16-bytes"})
    time.sleep(8)  # several last-call windows: a real newcomer would have been admitted
    assert forger.results() == []
    assert all(len(a.results()) == 1 and a.results()[0][1] == 2 for a in members)
    # The forger cannot even connect: the store does not prove the forger's token (so
    # the forger never proves one either).
    assert forger.wait(10) != 0
    assert "holds another token than this node" in forger.text()
    finish(members, job.stop)


FINISH_AT_CHANGE = """
import os, sys, time
import elastic, torch.distributed as dist
elastic.init_process_group(backend="gloo")
out = os.environ["OUT"]
open(os.path.join(out, f"started-{os.environ['GROUP_RANK']}"), "w").close()
while not elastic.membership_changed():
    time.sleep(0.05)
# The job's last step is the boundary that was to regroup it: it ends instead.
open(os.path.join(out, "finished"), "w").close()
"""


@pytest.mark.timeout(120)
def test_workers_that_finish_instead_of_taking_the_new_round_end_the_joiner_too(
    procs: Processes, port: int, tmp_path: Path
) -> None:
    """A node joins a running job whose workers regroup in place; they reach their last
    step at the boundary meant to regroup them and exit 0 without taking the new round.
    The joiner's new workers wait for a group that will not come: the kept node says the
    job finished in that round, and both agents exit 0 at once (not after the joiner's
    process-group timeout, nor the exit barrier's)."""
    script = tmp_path / "finish.py"
    script.write_text(FINISH_AT_CHANGE)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OUT=str(tmp_path))

    def agent() -> Agent:
        return Agent(
            procs.elastic(
                "run",
                "--nnodes=1:2",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=finish",
                f"--rdzv-conf={CONF}",
                "--monitor-interval=0.1",
                "--max-restarts=0",
                str(script),
                env=env,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        )

    kept = agent()
    assert wait_until(lambda: (tmp_path / "started-0").exists(), 60), kept.text()
    joiner = agent()
    assert wait_until(lambda: (tmp_path / "finished").exists(), 60), kept.text() + joiner.text()
    ended = time.monotonic()
    assert kept.wait(60) == 0, kept.text()
    assert joiner.wait(60) == 0, joiner.text()
    took = time.monotonic() - ended
    assert took < 15, f"the agents exited {took:.1f}s after the job finished"
    assert not (tmp_path / "started-1").exists(), "the joiner's worker joined a group"
