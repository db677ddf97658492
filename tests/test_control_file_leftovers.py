"""What an agent killed by SIGKILL leaves in the temp folder (its control file, the round
and stack files beside it) is removed by the next agent that ends normally; a live
agent's files, and one made this instant, are never touched (``sweep_leftovers``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from elastic.core.workers.control_file import (
    LEFTOVER_AGE,
    PREFIX,
    ControlFile,
    round_path,
    stack_path,
    sweep_leftovers,
)
from elastic.harness.commands import cli_env, elastic_cmd, run_elastic

# A child process makes a control file and dies without closing it, as SIGKILL would.
DIES_HOLDING = """
import os, sys
from elastic.core.workers.control_file import ControlFile, round_path, stack_path
node = ControlFile(1, directory=sys.argv[1])
for path in (round_path(node.path), stack_path(node.path, 0)):
    open(path, "w").close()
print(node.path, flush=True)
os._exit(0)
"""


def _left_by_a_dead_agent(folder: Path) -> Path:
    out = subprocess.run(
        [sys.executable, "-c", DIES_HOLDING, str(folder)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env=cli_env(),
    )
    return Path(out.stdout.strip())


def _age(path: Path) -> None:
    old = time.time() - LEFTOVER_AGE - 5
    os.utime(path, (old, old))


def _ours(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"{PREFIX}*"))


@pytest.mark.timeout(120)
def test_a_dead_agents_files_go_a_live_ones_and_a_new_ones_stay(tmp_path: Path) -> None:
    dead = _left_by_a_dead_agent(tmp_path)
    fresh = _left_by_a_dead_agent(tmp_path)  # dead too, but made this instant
    live = ControlFile(1, directory=str(tmp_path))
    try:
        _age(dead)
        _age(Path(live.path))
        assert sweep_leftovers(str(tmp_path)) == [str(dead)]
        assert not dead.exists()
        assert not Path(round_path(str(dead))).exists()
        assert not Path(stack_path(str(dead), 0)).exists()
        assert fresh.exists() and Path(round_path(str(fresh))).exists()
        assert Path(live.path).exists()  # its agent holds the lock
    finally:
        live.close()
    assert not Path(live.path).exists()


@pytest.mark.timeout(180)
def test_an_agent_killed_mid_run_is_cleaned_up_by_the_next_one(tmp_path: Path) -> None:
    """The user's view: SIGKILL an agent, its control file stays; the next job on the
    machine that ends normally removes it."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    env = cli_env({"TMPDIR": str(folder)})
    agent = subprocess.Popen(
        elastic_cmd("run", "--standalone", "--nproc-per-node=1", str(sleeper)),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        assert agent.stdout is not None
        assert agent.stdout.readline().strip() == "up"
        (left,) = _ours(folder)
        os.kill(agent.pid, signal.SIGKILL)  # the agent alone; its worker follows it
        agent.wait(timeout=30)
    finally:
        try:
            os.killpg(agent.pid, signal.SIGKILL)  # anything left in its session
        except ProcessLookupError:
            pass
    assert left.exists()
    _age(left)
    hello = tmp_path / "hello.py"
    hello.write_text("print('hello')\n")
    result = run_elastic(
        "run", "--standalone", "--nproc-per-node=1", str(hello), env={"TMPDIR": str(folder)}
    )
    assert result.returncode == 0, result.stderr
    assert _ours(folder) == []
