"""``--warm-restarts`` end to end: a restart's workers run in the spares the agent started
while the first workers ran (``core/workers/spare.py``), with torch already imported, as
the script would have run afresh (its environment, arguments, ``__main__``, streams), and
no spare outlives its agent, even a SIGKILLed one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from elastic.core.workers.spare import SPARE_DELAY, SparePool, _Plan, _Spare, _unfit
from elastic.harness.commands import cli_env, elastic_cmd, run_elastic
from elastic.testing.waits import wait_until

pytestmark = pytest.mark.timeout(120)

WORKER = """\
import json, os, sys, time
preloaded = "torch" in sys.modules  # before this script imports anything
import torch

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
record = {
    "attempt": attempt, "rank": os.environ["RANK"], "pid": os.getpid(),
    "cmdline": open("/proc/self/cmdline").read().split("\\0"), "preloaded": preloaded,
    "argv": sys.argv, "file": __file__, "path0": sys.path[0], "name": __name__,
    "error_file": os.environ["TORCHELASTIC_ERROR_FILE"],
}
out = sys.argv[1]
with open(os.path.join(out, f"{attempt}-{record['rank']}.json"), "w") as f:
    json.dump(record, f)
print(f"stdout of attempt {attempt} rank {record['rank']}")
if attempt == 0:
    # Long enough for the spares to be made (SPARE_DELAY after the start).
    time.sleep(float(sys.argv[2]) if os.environ["RANK"] == "1" else 120)
    sys.exit(3)
"""


def spares_marked(mark: str) -> list[int]:
    """Live spare processes whose environment carries ``mark``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if b"spare_main.py" in cmdline and f"SPARE_TEST={mark}".encode() in environ:
            found.append(int(pid))
    return found


def job_files(tmp_path: Path) -> tuple[Path, Path, str]:
    """The worker script, the folder its records go to, and a mark for its spares."""
    script = tmp_path / "train.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    return script, out, uuid.uuid4().hex


def test_a_restart_runs_in_warm_spares_as_it_would_afresh(tmp_path: Path) -> None:
    script, out, mark = job_files(tmp_path)
    proc = run_elastic(
        "run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--warm-restarts",
        f"--log-dir={tmp_path / 'logs'}",
        "--redirects=1",
        str(script),
        str(out),
        str(SPARE_DELAY + 2.0),
        timeout=100,
        env={"SPARE_TEST": mark},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = {r: json.loads((out / f"0-{r}.json").read_text()) for r in ("0", "1")}
    again = {r: json.loads((out / f"1-{r}.json").read_text()) for r in ("0", "1")}
    for rank, record in again.items():
        assert any(a.endswith("spare_main.py") for a in record["cmdline"]), record
        assert record["preloaded"], "the spare had not imported torch"
        assert not first[rank]["preloaded"]
        for same in ("argv", "file", "path0", "name"):
            assert record[same] == first[rank][same], same
        assert record["rank"] == rank and record["name"] == "__main__"
        assert record["error_file"] != first[rank]["error_file"]  # the attempt's own
    logs = list((tmp_path / "logs").rglob("stdout.log"))
    texts = {str(p): p.read_text() for p in logs}
    assert any("stdout of attempt 1 rank 1" in t for t in texts.values()), texts
    assert not any("stdout of attempt 1" in t for p, t in texts.items() if "attempt_0" in p), (
        texts
    )  # each attempt's lines in its own files
    assert wait_until(lambda: not spares_marked(mark), 10), "spares outlived the agent"


def test_no_spare_outlives_a_sigkilled_agent(tmp_path: Path) -> None:
    script, out, mark = job_files(tmp_path)
    agent = subprocess.Popen(
        elastic_cmd(
            "run", "--standalone", "--nproc-per-node=1", "--warm-restarts", str(script),
            str(out), "120",
        ),
        env=cli_env({"SPARE_TEST": mark}),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert wait_until(lambda: bool(spares_marked(mark)), 30), "no spare was made"
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=10)
        started = time.monotonic()
        assert wait_until(lambda: not spares_marked(mark), 10), "a spare outlived its agent"
        assert time.monotonic() - started < 5
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
        for pid in spares_marked(mark):
            os.kill(pid, signal.SIGKILL)


def test_a_spare_stands_in_only_for_what_changes_between_attempts() -> None:
    cmd = ["python", "-u", "train.py"]
    env = {"RANK": "0", "MASTER_PORT": "1", "PYTHONPATH": "/a", "OMP_NUM_THREADS": "1"}
    spare = _Spare(_Plan(cmd, env, None, 0), subprocess.Popen(["sleep", "30"]), -1)
    try:
        assert _unfit(spare, cmd, {**env, "RANK": "3", "MASTER_PORT": "2"}, None) is None
        assert "PYTHONPATH" in str(_unfit(spare, cmd, {**env, "PYTHONPATH": "/b"}, None))
        assert "OMP_NUM_THREADS" in str(
            _unfit(spare, cmd, {k: v for k, v in env.items() if k != "OMP_NUM_THREADS"}, None)
        )
        assert _unfit(spare, ["python", "-u", "other.py"], env, None) == "the command differs"
        assert _unfit(spare, cmd, env, {0}) == "its CPUs differ"
    finally:
        spare.proc.kill()
        spare.proc.wait()
    assert SparePool().take(0, cmd, env, "", "", None) is None  # no spare made yet


PLAIN_WORKER = """\
import os, sys, time
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt == 0:
    time.sleep(float(sys.argv[2]))
    sys.exit(1)
with open(os.path.join(sys.argv[1], "attempt-1"), "w") as f:
    f.write(open("/proc/self/cmdline").read())
"""


def test_a_worker_without_torch_failing_early_restarts_in_a_spare_with_stall_dumps(
    tmp_path: Path,
) -> None:
    """No torch to wait for, and --stall-timeout's per-attempt stack file: the spare is
    made 2 s in and used."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_WORKER)
    proc = run_elastic(
        "run", "--standalone", "--nproc-per-node=1", "--max-restarts=1", "--warm-restarts",
        "--stall-timeout=30", str(script), str(tmp_path), str(SPARE_DELAY + 1.5),
        timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "spare_main.py" in (tmp_path / "attempt-1").read_text()
