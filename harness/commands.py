"""Running the CLI for real from a test: ``python -m elastic`` with this interpreter, the
environment it gets, and worker scripts written from indented literals."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


def elastic_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "elastic", *args]


def run_elastic(
    *args: str,
    timeout: float = 90,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m elastic ARGS`` to completion and return what it printed."""
    return subprocess.run(
        elastic_cmd(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(env),
        cwd=cwd,
    )


def write_script(tmp_path: Path, name: str, body: str) -> str:
    """A worker script from an indented literal; returns its path."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)
