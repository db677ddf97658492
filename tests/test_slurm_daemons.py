"""``elastic run`` under a real SLURM (issue 35): munge, slurmctld and one slurmd per
simulated host (``elastic.harness.slurm``), jobs submitted with the real ``srun``,
``sbatch``, ``scancel`` and ``scontrol``, on three hosts with their own names and addresses.

- ``srun -N2 --ntasks-per-node=1 elastic run --nproc-per-node=2`` is one job of 4 workers
  (ranks 0-3, node ranks by SLURM_NODEID, one all_reduce across both hosts); the same line
  in an ``sbatch`` script completes.
- SLURM ends a whole step at once, workers included: ``scancel --signal=TERM`` on the step,
  preemption by a higher partition's job (``GraceTime``), ``--signal=TERM@N`` before the
  time limit. Each time every rank saves at the same step before anything dies, that step
  being the last one any rank completed: 0 steps lost. The preempted batch script, the
  README's, then requeues its job.
- ``scontrol requeue`` of an ``sbatch --requeue`` job: the requeued run (run id
  ``<job>.0.r1``, ``TORCHELASTIC_RESTART_COUNT`` 0 again) resumes from the checkpoint the
  first run took and finishes; on ``etcd-v3``, whose store outlives the job, a finished job
  requeued runs again as a new job instead of meeting its own closed run id.
- ``elastic run --nnodes=2`` in a batch script without ``srun``, and in the shell of an
  interactive ``srun --pty`` step, stops at once with one line saying what to do.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from elastic.harness.multihost import ETCD_CLIENT_PORT, start_etcd
from elastic.harness.preemption_job import PREEMPT_WORKER, hurry_once, read_events
from elastic.harness.records import RANK_RECORD_WORKER
from elastic.harness.slurm import (  # noqa: F401  (the fixtures)
    SlurmCluster,
    slurm_cluster,
    slurm_fixture,
)
from elastic.testing.waits import wait_until

pytestmark = pytest.mark.slow

ELASTIC_RUN = f"{sys.executable} -m elastic run"
STEPS = 400  # longer than any test waits: the job ends by the signal
PAUSE = 0.1  # s per step
NOTICE_AFTER = 5  # steps completed before the step is signalled
START_TIMEOUT = 90.0  # s until the workers train (4 imports of torch on 2 shared cores)


def one_job_line(tmp_path: Path) -> tuple[str, Path]:
    """The srun line of the 4-worker job and the directory its workers write to."""
    script, out = tmp_path / "w.py", tmp_path / "out"
    script.write_text(RANK_RECORD_WORKER)
    out.mkdir()
    line = f"srun -N2 --ntasks-per-node=1 {ELASTIC_RUN} --nproc-per-node=2 {script} {out}"
    return line, out


def assert_one_job(slurm: SlurmCluster, out: Path, job_id: str, log: str) -> None:
    records = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    hosts = [h.name for h in slurm.cluster.hosts]
    assert [(r["rank"], r["world"], r["group_rank"], r["host"]) for r in records] == [
        (0, 4, 0, hosts[0]),
        (1, 4, 0, hosts[0]),
        (2, 4, 1, hosts[1]),
        (3, 4, 1, hosts[1]),
    ], log
    assert {r["run_id"] for r in records} == {f"{job_id}.0"}, log
    assert {r["sum"] for r in records} == {10.0}, log  # one all_reduce over both hosts


def job_of(log: str) -> str:
    found = re.search(r"elastic: from SLURM job (\d+) step", log)
    assert found, log
    return found.group(1)


@pytest.mark.timeout(240)
def test_an_srun_step_is_one_job_of_every_nodes_workers(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    line, out = one_job_line(tmp_path)
    done = slurm.run(line.split(), timeout=180)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    assert_one_job(slurm, out, job_of(log), log)


@pytest.mark.timeout(240)
def test_the_same_line_in_an_sbatch_script_completes(slurm: SlurmCluster, tmp_path: Path) -> None:
    line, out = one_job_line(tmp_path)
    log_file = tmp_path / "job.out"
    job = slurm.sbatch(f"#!/bin/sh\n{line}\n", "-N2", f"--output={log_file}")
    assert wait_until(lambda: slurm.job(job).get("JobState") == "COMPLETED", 180, 0.5), (
        slurm.job(job),
        log_file.read_text() if log_file.exists() else "",
    )
    assert_one_job(slurm, out, job, log_file.read_text())


# --- the whole step signalled ------------------------------------------------------------


def preempt_line(workdir: Path, *srun_options: str, steps: int = STEPS) -> str:
    """The srun line of a 2-node job of ``PREEMPT_WORKER``s checkpointing under workdir."""
    script, ckpt = workdir / "preempt.py", workdir / "ckpt"
    script.write_text(PREEMPT_WORKER)
    ckpt.mkdir(exist_ok=True)
    options = " ".join(srun_options)
    return (
        f"srun -N2 --ntasks-per-node=1 {options} {ELASTIC_RUN} --nproc-per-node=2 "
        f"{script} {ckpt} {steps} 0 {PAUSE}"
    )


def steps_done(workdir: Path) -> int:
    return max((e["step"] for e in read_events(workdir) if e["event"] == "step"), default=0)


def wait_training(
    workdir: Path,
    steps: int = NOTICE_AFTER,
    slurm: SlurmCluster | None = None,
    proc: subprocess.Popen[str] | None = None,
) -> None:
    """Until the job's workers completed ``steps``; on failure the message has what srun
    printed (``proc``'s, stopped) and the cluster's state."""
    if wait_until(lambda: steps_done(workdir) >= steps, START_TIMEOUT, 0.2):
        return
    printed = ""
    if proc is not None:
        proc.kill()
        printed = communicate(proc, 30)
    state = "" if slurm is None else f"queue {slurm.queue()}\n{slurm.logs()}"
    pytest.fail(
        f"no {steps} steps within {START_TIMEOUT:g} s: {read_events(workdir)[-3:]}\n"
        f"srun printed: {printed}\n{state}"
    )


def assert_saved_before_anything_died(workdir: Path, log: str) -> int:
    """Every rank saved at one step, the last any rank completed; both agents say the
    save was complete. The saved step."""
    events = read_events(workdir)
    saved = [e for e in events if e["event"] == "saved"]
    assert sorted(e["rank"] for e in saved) == [0, 1, 2, 3], log
    assert {e["why"] for e in saved} == {"notice"}, log
    at = {e["step"] for e in saved}
    assert len(at) == 1, at
    last = max(e["step"] for e in events if e["event"] == "step")
    assert at == {last}, f"steps lost: saved at {at}, last completed {last}\n{log}"
    assert log.count("elastic: the job's checkpoint is complete; leaving") == 2, log
    assert "no complete checkpoint" not in log, log
    return last


def worker_env(workdir: Path) -> dict[str, str]:
    return {"FAULTS_OUT": str(workdir), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def communicate(proc: subprocess.Popen[str], timeout: float) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return out


@pytest.mark.timeout(240)
def test_scancel_signal_term_on_the_step_checkpoints_first(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    proc = slurm.popen(
        preempt_line(tmp_path).split(),
        env=slurm.env(worker_env(tmp_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_training(tmp_path, NOTICE_AFTER, slurm, proc)
    (job,) = slurm.queue()
    signalled = slurm.run(["scancel", "--signal=TERM", f"{job}.0"])
    assert signalled.returncode == 0, signalled.stderr
    log = communicate(proc, 60)
    assert proc.returncode == 143, log  # srun: the tasks' exit code, 128 + SIGTERM
    assert_saved_before_anything_died(tmp_path, log)


@pytest.mark.timeout(240)
def test_preemption_with_a_grace_time_checkpoints_first(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    log_file = tmp_path / "job.out"
    # The README's batch script: signalled (saved), it asks to come back.
    requeue = '[ $? -eq 143 ] && scontrol requeue "$SLURM_JOB_ID"'
    low = slurm.sbatch(
        f"#!/bin/sh\n{preempt_line(tmp_path)}\n{requeue}\n",
        "-N2",
        "--requeue",
        "-p",
        "main",
        f"--output={log_file}",
        env=worker_env(tmp_path),
    )
    wait_training(tmp_path, NOTICE_AFTER, slurm)
    preempted_at = time.time()
    urgent = slurm.sbatch("#!/bin/sh\ntrue\n", "-N3", "--exclusive", "-p", "urgent")
    assert wait_until(lambda: slurm.job(urgent).get("JobState") == "COMPLETED", 90, 0.5), slurm.job(
        urgent
    )
    log = log_file.read_text()
    last = assert_saved_before_anything_died(tmp_path, log)
    saved = next(e for e in read_events(tmp_path) if e["event"] == "saved" and e["step"] == last)
    assert saved["t"] - preempted_at < 20, saved  # long before the grace time's SIGKILL
    requeued = lambda: slurm.job(low).get("Restarts") == "1"  # noqa: E731
    assert wait_until(requeued, 30, 0.3), slurm.job(low)


# --signal=TERM@WARN: slurmctld sends the signal from its periodic check (every 30 s) once
# the time left is WARN + 30 s or less ("may send it up to 60 seconds earlier than
# specified", sbatch(1)). Submitted with a limit far off, the job's limit is brought
# within reach once its workers train, as an operator's scontrol does: the signal comes at
# the next check, at most 30 s later, and the limit, LIMIT_AFTER s or more away, never
# before the save. (Waiting for a 2-minute limit took 50 to 80 s; with --time=1 the
# signal came before the workers' first step 1 run in 3.)
WARN = 170  # s before the limit: its window covers LIMIT_AFTER plus a minute's rounding
LIMIT_AFTER = 100  # s from the update to the limit at least


def limit_within_reach(slurm: SlurmCluster, job: str) -> int:
    """Sets the running job's time limit to the first whole minute at least LIMIT_AFTER s
    from now; the seconds left then."""
    h, m, sec = (int(x) for x in slurm.job(job)["RunTime"].split("-")[-1].split(":"))
    ran = 3600 * h + 60 * m + sec
    minutes = -(-(ran + LIMIT_AFTER) // 60)
    done = slurm.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}"])
    assert done.returncode == 0, done.stderr
    left = 60 * minutes - ran
    assert LIMIT_AFTER <= left <= WARN + 30, left
    return left


@pytest.mark.timeout(240)
def test_signal_before_the_time_limit_checkpoints_first(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    line = preempt_line(tmp_path, "--time=30", f"--signal=TERM@{WARN}", steps=STEPS * 4)
    proc = slurm.popen(
        line.split(),
        env=slurm.env(worker_env(tmp_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_training(tmp_path, 1, slurm, proc)
    (job,) = slurm.queue()
    limit_within_reach(slurm, job)
    log = communicate(proc, 150)
    assert proc.returncode == 143, log
    assert_saved_before_anything_died(tmp_path, log)


def start_requeued_now(slurm: SlurmCluster, job: str) -> None:
    """What an operator does instead of waiting for the BeginTime SLURM holds a requeued job
    back by: start it now, in a later second than the one its old credential was revoked
    in (slurmd refuses a credential issued in that second: "Job credential revoked", the
    job FAILED; 1 run in 3 when the job had just completed)."""
    assert wait_until(lambda: slurm.job(job).get("JobState") == "PENDING", 60, 0.3)
    time.sleep(1.0)
    slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])


@pytest.mark.timeout(300)
def test_a_requeued_job_resumes_from_the_checkpoint(slurm: SlurmCluster, tmp_path: Path) -> None:
    steps = 60
    script, ckpt = tmp_path / "preempt.py", tmp_path / "ckpt"
    script.write_text(PREEMPT_WORKER)
    ckpt.mkdir()
    log_file = tmp_path / "job.out"
    line = (
        f"srun -N2 --ntasks-per-node=1 {ELASTIC_RUN} --nproc-per-node=2 --max-restarts=0 "
        f"{script} {ckpt} {steps} 0 {PAUSE}"
    )
    job = slurm.sbatch(
        f"#!/bin/sh\n{line}\n",
        "-N2",
        "--requeue",
        "--open-mode=append",
        f"--output={log_file}",
        env=worker_env(tmp_path),
    )
    wait_training(tmp_path, NOTICE_AFTER, slurm)
    requeued = slurm.run(["scontrol", "requeue", job])
    assert requeued.returncode == 0, requeued.stderr
    start_requeued_now(slurm, job)  # the first run's step is over: the job is pending
    # both hosts' workers of the requeued run stepped: the rest of its steps without pause
    hosts = {h.name for h in slurm.cluster.hosts[:2]}
    hurry_once(tmp_path, hosts, 4, time.time(), timeout=120)
    assert wait_until(lambda: slurm.job(job).get("JobState") == "COMPLETED", 180, 0.5), (
        slurm.job(job),
        log_file.read_text(),
    )
    log = log_file.read_text()
    assert slurm.job(job)["Restarts"] == "1", slurm.job(job)
    assert re.search(rf"--rdzv-id={job}\.0$", log, re.M), log  # the first run
    assert re.search(rf"--rdzv-id={job}\.0\.r1$", log, re.M), log  # the requeued run
    events = read_events(tmp_path)
    first, second = split_runs(events)
    saved = {e["step"] for e in first if e["event"] == "saved"}
    last = max(e["step"] for e in first if e["event"] == "step")
    assert saved == {last}, (saved, last, log)
    starts = [e for e in second if e["event"] == "start"]
    assert {e["step"] for e in starts} == {last}, log  # resumed from the checkpoint
    assert {e["restart"] for e in starts} == {0}, log  # a fresh restart budget
    assert sorted(e["rank"] for e in second if e["event"] == "done") == [0, 1, 2, 3], log
    assert {e["step"] for e in second if e["event"] == "done"} == {steps}


@pytest.mark.timeout(300)
def test_a_finished_job_requeued_on_etcd_v3_is_a_new_job(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """etcd outlives the job: the requeued run must not meet the first run's closed id."""
    etcd_host = slurm.cluster.hosts[2]
    etcd = start_etcd([etcd_host], tmp_path)
    try:
        script = tmp_path / "w.py"
        script.write_text(RANK_RECORD_WORKER)
        out = tmp_path / "out"
        log_file = tmp_path / "job.out"
        line = (
            f"srun -N2 --ntasks-per-node=1 {ELASTIC_RUN} --nproc-per-node=2 "
            f"--rdzv-backend=etcd-v3 --rdzv-endpoint={etcd_host.addr}:{ETCD_CLIENT_PORT} "
            f"{script} {out}/r$run"
        )
        batch = f"#!/bin/sh\nrun=${{SLURM_RESTART_COUNT:-0}}\nmkdir -p {out}/r$run\n{line}\n"
        job = slurm.sbatch(batch, "-N2", "--requeue", "--open-mode=append", f"--output={log_file}")
        completed = lambda: slurm.job(job).get("JobState") == "COMPLETED"  # noqa: E731
        assert wait_until(completed, 180, 0.5), (slurm.job(job), log_file.read_text())
        requeued = slurm.run(["scontrol", "requeue", job])
        assert requeued.returncode == 0, requeued.stderr
        start_requeued_now(slurm, job)
        ran_again = lambda: completed() and slurm.job(job).get("Restarts") == "1"  # noqa: E731
        assert wait_until(ran_again, 180, 0.5), job_state(slurm, job, log_file)
    finally:
        for proc in etcd:
            proc.kill()
            proc.wait()
    log = log_file.read_text()
    assert "already finished" not in log, log
    for run, run_id in ((0, f"{job}.0"), (1, f"{job}.0.r1")):
        records = [json.loads(p.read_text()) for p in sorted((out / f"r{run}").glob("*.json"))]
        assert [(r["rank"], r["world"]) for r in records] == [(i, 4) for i in range(4)], log
        assert {r["run_id"] for r in records} == {run_id}, log


def job_state(slurm: SlurmCluster, job: str, log_file: Path) -> str:
    """What a failure message needs of a job: its state and why, and what it printed."""
    fields = slurm.job(job)
    keys = ("JobState", "Reason", "Restarts", "SubmitTime", "EligibleTime", "StartTime", "EndTime")
    printed = log_file.read_text() if log_file.exists() else ""
    return f"{ {k: fields.get(k) for k in keys} }\n{printed}\n{slurm.logs()}"


def split_runs(events: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The first run's events and the requeued run's (its workers started after every
    event of the first: the job ran again from scratch)."""
    pids = {e["pid"] for e in events if e["event"] == "start"}
    first_pids = sorted(pids, key=lambda p: min(e["t"] for e in events if e["pid"] == p))[:4]
    first = [e for e in events if e["pid"] in first_pids]
    return first, [e for e in events if e["pid"] not in first_pids]


# --- launches SLURM cannot complete --------------------------------------------------------


@pytest.mark.timeout(120)
def test_several_nodes_in_a_batch_script_without_srun_is_one_line(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    script = tmp_path / "w.py"
    script.write_text(RANK_RECORD_WORKER)
    log_file = tmp_path / "job.out"
    line = f"{ELASTIC_RUN} --nnodes=2 --nproc-per-node=1 {script} {tmp_path}"
    job = slurm.sbatch(f"#!/bin/sh\n{line}\n", "-N2", f"--output={log_file}")
    assert wait_until(lambda: slurm.job(job).get("JobState") == "FAILED", 60, 0.3), slurm.job(job)
    assert slurm.job(job)["ExitCode"] == "2:0"
    lines = log_file.read_text().strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].endswith(
        f"elastic run --nnodes=2 in SLURM job {job} but not in an srun step (a batch script "
        "or salloc shell) is one agent on one node and would wait forever for 1 more; start "
        "one agent per node instead: srun -N2 --ntasks-per-node=1 elastic run ... (SLURM "
        "fills --nnodes and the rendezvous)"
    ), lines


@pytest.mark.timeout(120)
def test_the_shell_of_an_interactive_step_is_one_line(slurm: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text(RANK_RECORD_WORKER)
    # What a user types at the prompt of srun -N2 --pty bash: only task 0 has the terminal.
    typed = f"[ $SLURM_PROCID = 0 ] && exec {ELASTIC_RUN} --nproc-per-node=1 {script} {tmp_path}"
    done = slurm.run(
        ["script", "-qec", f"srun -N2 --pty bash -c '{typed}'", "/dev/null"], timeout=90
    )
    # srun adds its own line per task ("task 0: Exited with exit code 2"); the terminal
    # may add a NUL.
    output = done.stdout.replace("\0", "")
    lines = [line for line in output.splitlines() if line.strip() and "srun: " not in line]
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(lines) == 1, lines
    assert "this is the shell of an interactive step (srun --pty) of 2 nodes" in lines[0]
    assert "srun --overlap --ntasks-per-node=1 elastic run" in lines[0], lines
