"""Throwaway installed distributions, for tests of plugin discovery through real metadata."""

from __future__ import annotations

import textwrap
from pathlib import Path


def make_distribution(root: Path, name: str, entry_points: str, modules: dict[str, str]) -> Path:
    """A throwaway installed distribution exactly as pip leaves one (``.dist-info`` with
    METADATA and entry_points.txt, plus its modules) under ``root``; returns ``root``,
    the directory to put on ``sys.path`` or ``PYTHONPATH``."""
    info = root / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    return root
