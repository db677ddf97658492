"""The agent raises its soft open-files limit to the hard one at start: the store host of
a large job holds a socket per connection."""

from __future__ import annotations

import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from elastic.harness.commands import REPO, cli_env, elastic_cmd, write_script

LOW = 256


def lowered() -> None:
    """In the child before it runs: a low soft limit under the hard one."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (LOW, hard))


@pytest.fixture(autouse=True)
def room_to_raise() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= LOW:
        pytest.skip(f"the hard open-files limit ({hard}) leaves nothing to raise")


@pytest.mark.timeout(60)
def test_raise_open_files_limit_raises_the_soft_limit_to_the_hard_one() -> None:
    code = textwrap.dedent(
        """
        import resource
        from elastic.core.launch.launcher import raise_open_files_limit
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        now = raise_open_files_limit()
        print(soft, now, *resource.getrlimit(resource.RLIMIT_NOFILE), hard)
        print(raise_open_files_limit())  # again: nothing left to do
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
        preexec_fn=lowered,
    )
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    before, now, soft, hard_after, hard = (int(x) for x in first.split())
    assert before == LOW and now == soft == hard_after == hard
    assert int(second) == hard


@pytest.mark.timeout(120)
def test_an_agent_started_with_a_low_limit_raises_it_for_itself_and_its_workers(
    tmp_path: Path,
) -> None:
    script = write_script(
        tmp_path,
        "worker.py",
        """
        import resource
        print("NOFILE", *resource.getrlimit(resource.RLIMIT_NOFILE), flush=True)
        """,
    )
    out = subprocess.run(
        elastic_cmd("run", "--standalone", "--nproc-per-node=1", script),
        capture_output=True,
        text=True,
        timeout=90,
        env=cli_env(),
        preexec_fn=lowered,
    )
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if "NOFILE" in ln)
    soft, hard = (int(x) for x in line.split()[-2:])
    assert soft == hard != LOW
