"""The in-place regroup job on a simulated cluster (``tests/test_regroup_multihost.py``,
``bench/regroup.py``): an ``elastic.train`` worker on gloo (``REGROUP_WORKER``), the
events it writes (``read_events`` of ``elastic.harness.preemption_job``) and the job that
runs it on every host (``regroup_job``).

The state is an integer accumulator: step ``s`` adds the sum over 12 items of an integer
function of ``(s, item)``, each rank summing its share of the items and one all_reduce
adding the shares, so the final value is exactly (bit for bit) the same whatever the
world size was at each step, and equal to ``--reference``'s. It snapshots (rollback) and
syncs from the most tenured rank (the highest step). No checkpointer: every recovery is
in place. Events, one JSON line each in ``FAULTS_OUT/events.jsonl``: "start" (a process
started), "sync" (after ``state.sync``), "step" (a step completed: its value), "done";
each with the time, host, pid, and the rank, world and restart count of that moment.
A file ``FAULTS_OUT/stall-<host>`` makes that host's worker sleep 30 s in its next step
(and is removed): a worker that cannot reach a step boundary; ``late-<host>`` makes it
sleep as long after its step's all_reduce, so the other ranks wait for it in the step
agreement. With ``gone-before-connect-<host>``, a worker starting on that host says it is
ready to join the round's group, writes ``ready-<host>`` and never connects: a member gone
between joining a round and connecting to its group. A file ``slow-start-<host>``
holding a number makes a worker starting on that host write ``slow-started-<host>-<pid>``
and sleep that many seconds before it imports torch (a start-up that outlasts a change of
the job). A file ``hurry`` drops the pause between steps: a test that saw what it waited
for runs the rest of the job's steps (there so the job outlasts a slow change) at once
(``hurry_once``). ``REGROUP_HOLD_LAST=1``
holds the last step until the agent asks for a regroup (the job finishes at the boundary
meant to re-form it), ``REGROUP_EXIT_DELAY`` (s) delays the exit after "done".
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from elastic.harness.accumulator import ACCUMULATOR_STATE
from elastic.harness.cluster import Cluster, Host
from elastic.harness.multihost import START_RECORD, FaultJob, c10d_script_job, wait_until
from elastic.harness.preemption_job import last_step, read_events

REGROUP_WORKER = (
    """\
import faulthandler, json, os, socket, sys, time
t0 = time.time()  # the start record's time: before torch is imported
faulthandler.enable()

ITEMS = 12
MOD = 2**61 - 1


def share(step, rank, world):
    return sum((step * 7919 + i * 104729) % 1000003 for i in range(ITEMS) if i % world == rank)


def advance(value, total):
    return (value * 31 + total) % MOD


if sys.argv[1] == "--reference":
    value = 0
    for step in range(1, int(sys.argv[2]) + 1):
        value = advance(value, share(step, 0, 1))
    print(json.dumps(value))
    sys.exit(0)

slow = os.path.join(os.environ["FAULTS_OUT"], "slow-start-" + socket.gethostname())
if os.path.exists(slow):  # a test: a start-up that outlasts a change of the job
    mark = f"slow-started-{socket.gethostname()}-{os.getpid()}"
    open(os.path.join(os.environ["FAULTS_OUT"], mark), "w").close()
    time.sleep(float(open(slow).read()))

import torch
import torch.distributed as dist
import elastic

"""
    + START_RECORD
    + """\
events = os.open(os.path.join(out, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)


def note(event, step, **kw):
    now = {k.lower(): int(os.environ[k]) for k in ("RANK", "WORLD_SIZE")}
    line = dict(rec, t=time.time(), event=event, step=step, rank=now["rank"],
                world=now["world_size"],
                restart=int(os.environ["TORCHELASTIC_RESTART_COUNT"]), **kw)
    os.write(events, (json.dumps(line) + "\\n").encode())  # one O_APPEND write per line


steps, pause = int(sys.argv[1]), float(sys.argv[2])
in_place = sys.argv[3:] != ["restart"]  # "restart": today's path, for the bench


"""
    + ACCUMULATOR_STATE
    + """
class Accumulator(AccumulatorState):
    def sync(self, world_size, rank):
        every = self.gather_snapshots(world_size)
        self.apply_snapshot(max(every, key=lambda s: s["step"]))  # the most tenured
        note("sync", self.step)


def train_step(state):
    rank, world = dist.get_rank(), dist.get_world_size()
    if state.step + 1 == steps and os.environ.get("REGROUP_HOLD_LAST"):
        # a test makes the job's last step boundary the one meant to regroup it
        held = time.monotonic() + 60
        while not elastic.membership_changed() and time.monotonic() < held:
            time.sleep(0.005)
    stall = os.path.join(out, "stall-" + rec["host"])
    if os.path.exists(stall):  # a test makes this worker miss the next step boundary
        os.unlink(stall)
        time.sleep(float(os.environ.get("REGROUP_STALL", "30")))
    total = torch.tensor([share(state.step + 1, rank, world)], dtype=torch.int64)
    dist.all_reduce(total)
    state.value = advance(state.value, int(total.item()))
    state.step += 1
    note("step", state.step, value=state.value)
    late = os.path.join(out, "late-" + rec["host"])
    if os.path.exists(late):  # a test keeps the peers waiting in the step agreement
        os.unlink(late)
        time.sleep(float(os.environ.get("REGROUP_STALL", "30")))
    if not os.path.exists(os.path.join(out, "hurry")):  # a test saw the change it waited for
        time.sleep(pause)
    return state.step >= steps


if os.path.exists(os.path.join(out, "gone-before-connect-" + rec["host"])):
    # a test: this worker says it is about to join the round's group (as
    # elastic.init_process_group does), then never connects, until its host is killed
    from elastic.core.workers.control_file import READY
    from elastic.training import control
    control.set_mine(READY, 1)
    open(os.path.join(out, "ready-" + rec["host"]), "w").close()
    time.sleep(600)
elastic.init_process_group(backend="gloo", timeout=60)
note("start", 0)
state = Accumulator()
last = elastic.train(train_step, state, checkpointer="", regroup_in_place=in_place)
note("done", last, value=state.value)
time.sleep(float(os.environ.get("REGROUP_EXIT_DELAY", "0")))  # a slow exit after the job
dist.barrier()
dist.destroy_process_group()
"""
)


def regroup_job(
    cluster: Cluster,
    workdir: Path,
    *,
    steps: int,
    pause: float,
    nnodes: str,
    args: list[str],
    launcher: str = "ours",
    in_place: bool = True,
    env: dict[str, str] | None = None,
) -> FaultJob:
    """A c10d job of ``REGROUP_WORKER``s on every host of ``cluster`` (not started);
    ``in_place=False`` runs it with ``elastic.train(..., regroup_in_place=False)``."""
    workdir.mkdir(parents=True, exist_ok=True)
    return c10d_script_job(
        cluster,
        workdir,
        REGROUP_WORKER,
        [str(steps), str(pause), *([] if in_place else ["restart"])],
        run_id="regroup",
        nnodes=nnodes,
        args=args,
        launcher=launcher,
        env=env,
    )


STEPS = 60
# A joining node's worker starts (imports torch) while the others train on: the job must
# outlast that on a loaded 2-core machine (20 s of steps did not, with one core taken by
# a busy loop). Every test that uses it drops the pause once its change is over
# (``hurry_once``), so a longer budget costs no time when things go as they should.
JOIN_STEPS = 400
# The same while the others train in a world of their own after a loss (``kept_first``):
# the job must not end before the new worker is up.
REJOIN_STEPS = 2 * JOIN_STEPS
CHANGE_AT = 5  # the fault comes once the job has done this many steps
PAUSE = 0.1  # s per step
FORM_TIMEOUT = 60.0  # first round: every agent imports and connects on 2 cores
FINISH_TIMEOUT = 90.0


def reference(tmp_path: Path, steps: int = STEPS) -> subprocess.Popen[str]:
    """The undisturbed run's final value, computed in one process (``expected_value``)."""
    script = tmp_path / "reference.py"
    script.write_text(REGROUP_WORKER)
    return subprocess.Popen(
        [sys.executable, str(script), "--reference", str(steps)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def expected_value(proc: subprocess.Popen[str]) -> int:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return int(json.loads(out))


@contextlib.contextmanager
def reference_run(tmp_path: Path, steps: int = STEPS) -> Iterator[Callable[[], int]]:
    """The undisturbed run (``reference``) beside a test's job: yields the call that waits
    for its final value, and kills it on the way out if the test ended first."""
    proc = reference(tmp_path, steps)
    try:
        yield lambda: expected_value(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def start_job(
    cluster: Cluster,
    workdir: Path,
    nnodes: str,
    hosts: list[Host],
    steps: int = STEPS,
    args: tuple[str, ...] = (),
) -> FaultJob:
    """A regroup job on ``hosts`` that formed and trained ``CHANGE_AT`` steps."""
    job = regroup_job(
        cluster,
        workdir,
        steps=steps,
        pause=PAUSE,
        nnodes=nnodes,
        args=["--max-restarts=0", *args],
    )
    formed = job.start_together(hosts, FORM_TIMEOUT)
    assert formed, f"the {len(hosts)}-node job did not form\n{job.texts()}"
    world = len(hosts)
    trained = wait_until(lambda: last_step(read_events(job.workdir), world) >= CHANGE_AT, 60)
    assert trained, f"the {world}-node job did not train\n{job.texts()}"
    return job


def finish(job: FaultJob, hosts: list[Host]) -> None:
    """Every agent of ``hosts`` exited 0."""
    for host in hosts:
        code = job.nodes[host.name].wait(timeout=FINISH_TIMEOUT)
        assert code == 0, f"{host.name} exited {code}\n{job.texts()}"


def all_done(seen: list[dict[str, Any]], workers: int, value: int, why: object = "") -> None:
    """``workers`` workers finished with the undisturbed run's ``value``, and no restart was
    spent; ``why``: what a failure shows besides."""
    done = [e for e in seen if e["event"] == "done"]
    assert len(done) == workers and {e["value"] for e in done} == {value}, (done, why)
    assert {e["restart"] for e in seen} == {0}, f"a restart was spent {why}"


def hurry_once(
    job: FaultJob, hosts: list[Host], world: int, since: float, timeout: float = 90.0
) -> None:
    """Once the worker of every host of ``hosts`` synced after ``since`` (it regrouped) and
    then completed a step in a ``world``-rank world (the change a test waited for is over),
    the workers drop their pause (``hurry``): the rest of the steps, there only so the job
    outlasts a slow change, prove nothing more at ``PAUSE`` each. Not seen before the job
    ends or within ``timeout``: the job keeps its pace and the test's assertions say why."""
    names = {h.name for h in hosts}
    over: list[bool] = []

    def seen() -> bool:
        events = [e for e in read_events(job.workdir) if e["t"] > since]
        synced: dict[str, float] = {}
        for e in events:
            if e["event"] == "sync":
                synced.setdefault(e["host"], e["t"])
        stepped = {
            e["host"]
            for e in events
            if e["event"] == "step" and e["world"] == world and e["t"] > synced.get(e["host"], 1e20)
        }
        if names <= stepped:
            over.append(True)
        return bool(over) or any(e["event"] == "done" for e in events)

    wait_until(seen, timeout, 0.2)
    if over:
        (job.workdir / "hurry").touch()


def workers_kept(job: FaultJob, kept: list[Host], since: float) -> list[dict[str, Any]]:
    """Asserts no node restarted its workers on a regroup bound and ``kept``'s workers
    were neither started again after ``since`` nor replaced (one pid each, ever); returns
    the job's events."""
    texts = job.texts()
    assert "did not take the new round in time" not in texts, texts
    names = {h.name for h in kept}
    restarted = [r for r in job.starts() if r["host"] in names and r["t"] > since]
    assert not restarted, f"kept workers started again: {restarted}\n{texts}"
    seen = read_events(job.workdir)
    for host in kept:
        pids = {e["pid"] for e in seen if e["host"] == host.name}
        assert len(pids) == 1, f"{host.name} ran {pids}"
    return seen
