"""The package as an installer and a type checker meet it: one version, the licence and
classifiers in the metadata, ``py.typed`` and the facade's stub in the wheel, typed
re-exports that match the lazy ones, and an ``import elastic`` that stays cheap."""

from __future__ import annotations

import ast
import email
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from elastic.harness.commands import REPO, cli_env
from elastic.harness.installed_copy import copy_tracked

# What docs/conformance.md and docs/plugins.md tell a plugin author to import or run.
PLUGIN_AUTHOR_KIT = [
    "agent_runner",
    "conformance",
    "conformance_node",
    "conformance_runner",
    "etcd",
    "pytest_plugin",
]


def lazy_names() -> dict[str, str]:
    """``_LAZY`` of ``__init__.py``, read without importing it."""
    tree = ast.parse((REPO / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_LAZY":
            value: dict[str, str] = ast.literal_eval(node.value)
            return value
    raise AssertionError("__init__.py has no _LAZY")


def test_the_stub_re_exports_every_lazy_name_from_its_target() -> None:
    stub = ast.parse((REPO / "__init__.pyi").read_text())
    typed = {}
    for node in stub.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                assert alias.asname == alias.name, f"{alias.name}: re-export it as itself"
                typed[alias.name] = f"{node.module}:{alias.name}"
    assert typed == lazy_names()


def test_import_elastic_imports_neither_torch_nor_the_core() -> None:
    code = (
        "import sys, elastic; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('elastic.')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=cli_env()
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed")
def test_a_type_checker_sees_the_lazy_names_types(tmp_path: Path) -> None:
    # The editable install of this layout (package-dir "." -> elastic) is an import hook,
    # which mypy does not follow: give it the tree under the name ``elastic``.
    (tmp_path / "path").mkdir()
    (tmp_path / "path" / "elastic").symlink_to(REPO)
    (tmp_path / "use.py").write_text(
        "import elastic\n"
        "reveal_type(elastic.LaunchConfig)\n"
        "reveal_type(elastic.__version__)\n"
        "elastic.no_such_name\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent", "use.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MYPYPATH": str(tmp_path / "path")},
    )
    out = result.stdout
    assert "-> elastic.core.launch.config.LaunchConfig" in out, out
    assert 'use.py:3: note: Revealed type is "str"' in out, out
    assert 'Module has no attribute "no_such_name"' in out, out


def test_the_version_has_one_source() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    dynamic = project["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "elastic.__version__"}
    import elastic

    assert importlib.metadata.version("elastic-launch") == elastic.__version__


@pytest.mark.skipif(
    importlib.util.find_spec("setuptools") is None, reason="no setuptools to build with"
)
def test_the_wheel_carries_licence_types_classifiers_and_the_kit(tmp_path: Path) -> None:
    # From a copy without build/: setuptools builds in the tree and never empties
    # build/lib, so a module that was once in the package would ship again.
    source = copy_tracked(REPO, tmp_path / "source")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = tmp_path.glob("elastic_launch-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_bytes(zf.read(meta_name))
    assert {"elastic/py.typed", "elastic/__init__.pyi", "elastic/__init__.py"} <= names
    # The plugin-author kit ships (docs/conformance.md, docs/plugins.md); the internal
    # harness, the tests and the benches do not.
    kit = {f"elastic/testing/{path.name}" for path in (REPO / "testing").glob("*.py")}
    assert {f"elastic/testing/{m}.py" for m in PLUGIN_AUTHOR_KIT} <= kit
    assert kit <= names, sorted(kit - names)
    assert (REPO / "harness" / "cluster.py").is_file()
    left_in = [
        n for n in names if n.startswith(("elastic/harness/", "elastic/tests/", "elastic/bench/"))
    ]
    assert left_in == []
    assert any(n.endswith("dist-info/licenses/LICENSE") for n in names), sorted(names)[:20]
    assert meta["License"] == "BSD-3-Clause"
    classifiers = meta.get_all("Classifier")
    assert "Operating System :: POSIX :: Linux" in classifiers
    assert "License :: OSI Approved :: BSD License" in classifiers
    assert "Programming Language :: Python :: 3.10" in classifiers
    assert meta["Version"] == importlib.metadata.version("elastic-launch")
