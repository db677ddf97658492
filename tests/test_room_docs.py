"""The docs that say where things are stay true of the tree: every package's docstring
names each of its modules, and every path docs/architecture.md's tables name exists."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Folders that are not packages of ``elastic`` (harness/ is one, though not in the wheel).
NOT_PACKAGES = {"tests", "bench", "examples", "build", "docs"}


def packages() -> list[pathlib.Path]:
    """Every folder of ``elastic`` with an ``__init__.py``, the root included."""
    found = [ROOT]
    for init in sorted(ROOT.rglob("__init__.py")):
        folder = init.parent
        parts = folder.relative_to(ROOT).parts
        if parts and parts[0] not in NOT_PACKAGES and not any(p.startswith(".") for p in parts):
            found.append(folder)
    return found


def owned(package: pathlib.Path) -> list[str]:
    """The names of a package's modules and subpackages."""
    modules = [p.stem for p in package.glob("*.py") if p.name != "__init__.py"]
    subpackages = [
        p.name
        for p in package.iterdir()
        if p.is_dir() and p.name not in NOT_PACKAGES and (p / "__init__.py").is_file()
    ]
    return sorted(modules + subpackages)


def unnamed(doc: str, names: list[str]) -> list[str]:
    """The names a docstring does not mention as a whole word."""
    return [n for n in names if not re.search(rf"(?<![\w.]){re.escape(n)}\b", doc)]


def test_every_package_docstring_names_its_modules() -> None:
    left_out = {}
    for package in packages():
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        missing = unnamed(doc, owned(package))
        if missing:
            left_out[str(package.relative_to(ROOT))] = missing
    assert left_out == {}, "modules their package's __init__ docstring does not name"


def test_a_module_left_out_is_seen() -> None:
    """Whole words only: ``logs`` does not name ``log``, nor ``a.store`` ``store``."""
    doc = "Owns ``logs``, ``process`` (see ``elastic.core.tcpstore.store``)."
    assert unnamed(doc, ["log", "logs", "process", "store"]) == ["log", "store"]


# A backticked path in a table row: ``something.py`` or ``folder/`` (``core/agent/loop.py``,
# ``agent/``, ``boot/sitecustomize.py``); keys, commands and module names are not paths.
PATH = re.compile(r"`([\w./-]+\.py|[\w.-]+(?:/[\w.-]+)*/)`")


def table_paths(markdown: str) -> list[tuple[str, str]]:
    """(row's first cell, path) for each path named in a table row; a path is relative to
    the repository, to the room the row is about (its first cell, ``core/launch/``) or to
    ``core/`` (the rooms the contracts name)."""
    found = []
    for line in markdown.splitlines():
        if not line.startswith("|"):
            continue
        first = line.strip("|").split("|")[0].strip()
        for path in PATH.findall(line):
            found.append((first, path))
    return found


def exists(first_cell: str, path: str) -> bool:
    room = re.match(r"`([\w./-]+/)`", first_cell)
    bases = [ROOT, ROOT / "core", *([ROOT / room.group(1)] if room else [])]
    return any((base / path).exists() for base in bases)


def test_every_path_in_the_architecture_tables_exists() -> None:
    paths = table_paths((ROOT / "docs" / "architecture.md").read_text())
    assert len(paths) > 50  # the room table alone names more than this
    assert [(cell, path) for cell, path in paths if not exists(cell, path)] == []


def test_a_path_that_does_not_exist_is_seen() -> None:
    rows = "| `core/launch/` | `config.py`, `launcher.py`, `gone.py` |\n| `x` | `core/agent/` |"
    found = table_paths(rows)
    assert found == [
        ("`core/launch/`", "core/launch/"),
        ("`core/launch/`", "config.py"),
        ("`core/launch/`", "launcher.py"),
        ("`core/launch/`", "gone.py"),
        ("`x`", "core/agent/"),
    ]
    assert [p for cell, p in found if not exists(cell, p)] == ["gone.py"]
