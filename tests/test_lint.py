"""The tree stays ruff-clean (lint and format), as the style guide asks."""

from __future__ import annotations

import subprocess
import sys

import pytest
from elastic.harness.commands import REPO


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff_is_clean(args: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
