"""The package's layers cannot rot: the import-linter contracts in pyproject.toml, no import
circle anywhere in the package, and torch's own launcher never imported by the product."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import grimp
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Code that is not the product: it may import anything, torch's launcher included.
NOT_PRODUCT = {"tests", "bench", "examples", "build"}


def test_import_linter_contracts_are_kept() -> None:
    lint = pathlib.Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint), "--no-cache", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("elastic")


def product_modules(graph: grimp.ImportGraph) -> list[str]:
    return sorted(
        m for m in graph.modules if m.startswith("elastic.") and m.split(".")[1] not in NOT_PRODUCT
    )


def test_no_import_circles_in_the_product(graph: grimp.ImportGraph) -> None:
    """Deferred and type-only imports count: a circle closed by either still couples."""
    modules = set(product_modules(graph))
    circles = set()
    for importer in modules:
        for imported in graph.find_modules_directly_imported_by(importer) & modules:
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back:
                circles.add(" -> ".join((importer, *back)))
    assert not circles, "import circles:\n" + "\n".join(sorted(circles))


def test_the_circle_check_sees_a_circle() -> None:
    """The check above can fail: a two-module circle in a throwaway package is found."""
    graph = grimp.ImportGraph()
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.a")
    assert graph.find_shortest_chain(importer="pkg.b", imported="pkg.a") == ("pkg.b", "pkg.a")


def test_the_product_never_imports_torchs_launcher() -> None:
    offenders = []
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        if parts[0] in NOT_PRODUCT or parts[0].startswith("."):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                if name.startswith(("torch.distributed.elastic", "torch.distributed.run")):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert not offenders, offenders
