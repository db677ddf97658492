"""The benches' installed copy (``harness/installed_copy.py``): an interpreter that has
this checkout installed from a wheel, without the editable install's import hook, runs a
job with either launcher."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from elastic.harness.installed_copy import installed_python, without_checkout

pytestmark = pytest.mark.slow

SHOW = """
import os, sys
sys.stdout.write(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}\\n")
"""

PROBE = """
import sys, elastic
print(elastic.__file__)
print(sorted(m for m in sys.modules if "editable" in m))
"""


@pytest.mark.timeout(300)
def test_the_installed_copy_runs_both_launchers_without_the_editable_hook(
    tmp_path: Path,
) -> None:
    python = installed_python()
    assert installed_python() == python  # made once per state of the tree
    home = python.parent.parent
    env = without_checkout(dict(os.environ))  # as the benches run it
    probe = subprocess.run(
        [python, "-c", PROBE], capture_output=True, text=True, check=True, env=env
    )
    where, hooks = probe.stdout.splitlines()
    assert Path(where).is_relative_to(home), where  # the wheel's copy, not the checkout
    assert hooks == "[]", hooks
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    for launcher in (["elastic", "run"], ["torchrun"]):
        command = [str(home / "bin" / launcher[0]), *launcher[1:]]
        result = subprocess.run(
            [*command, "--standalone", "--nproc-per-node=2", str(script)],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
        )
        assert result.returncode == 0, result.stderr
        assert sorted(result.stdout.splitlines()) == ["rank 0 of 2", "rank 1 of 2"], launcher


def test_another_environment_gets_a_copy_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The temp folder is shared by every checkout on the machine: a copy made for one
    environment's dependencies (a path entry to its site folder) is not another's."""
    from elastic.harness import installed_copy

    here = installed_copy._copy_key(installed_copy.REPO)
    assert installed_copy._copy_key(installed_copy.REPO) == here
    monkeypatch.setattr(installed_copy.site, "getsitepackages", lambda: ["/elsewhere"])
    assert installed_copy._copy_key(installed_copy.REPO) != here


def _build_leftovers(repo: Path) -> dict[str, int]:
    """What a build in ``repo`` would leave or touch, with each entry's mtime."""
    found = [repo / "build", *repo.glob("*.egg-info")]
    found += [entry for folder in found if folder.is_dir() for entry in folder.iterdir()]
    return {str(path): path.stat().st_mtime_ns for path in found if path.exists()}


@pytest.mark.timeout(300)
def test_making_the_copy_leaves_the_checkout_as_it_was(tmp_path: Path) -> None:
    """The build leaves no ``build/`` or ``*.egg-info`` in the checkout and touches none
    there: an egg-info in the working directory is a distribution to every interpreter
    started there. (An editable install of the checkout makes one of its own, before
    this test: it must come out as it went in.)"""
    from elastic.harness import installed_copy

    before = _build_leftovers(installed_copy.REPO)
    installed_copy._made(installed_copy.REPO, tmp_path / "copy")  # a build, never a kept copy
    assert _build_leftovers(installed_copy.REPO) == before
