"""The package's layers cannot rot: the import-linter contracts in pyproject.toml hold for
every module of the product, each one refuses an import that runs the wrong way (tried on a
copy of the package), and torch's own launcher is never imported by the product."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Code that is not the product: it may import anything, torch's launcher included.
NOT_PRODUCT = {"tests", "bench", "harness", "examples", "build", "docs"}


def lint_imports(package: pathlib.Path, copy: bool) -> str:
    """lint-imports' report, with `package`'s pyproject.toml, on the ``elastic`` that imports:
    the one this test runs against, or the copy in `package` (a directory named
    ``elastic``) when `copy` says so. Asserts nothing."""
    lint = pathlib.Path(sys.executable).with_name("lint-imports")
    # Wide enough that no contract's name is wrapped in the report.
    env = {**os.environ, "COLUMNS": "400"}
    if copy:
        env["PYTHONPATH"] = str(package.parent)
    result = subprocess.run(
        [str(lint), "--no-cache", "--no-logo", str(package / "pyproject.toml")],
        cwd=package,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return result.stdout + result.stderr


def contract_verdicts(report: str) -> dict[str, str]:
    """Each contract's name -> KEPT or BROKEN, from a lint-imports report."""
    return dict(re.findall(r"^(.+) (KEPT|BROKEN)$", report, re.MULTILINE))


def product_folders() -> list[pathlib.Path]:
    """Every folder of the product that holds Python, the top one included."""
    return sorted(
        {
            path.parent
            for path in ROOT.rglob("*.py")
            if not (set(path.relative_to(ROOT).parts[:1]) & NOT_PRODUCT)
            and not any(part.startswith(".") for part in path.relative_to(ROOT).parts)
        }
    )


def test_every_folder_of_the_product_is_a_package_the_wheel_names() -> None:
    """A folder without ``__init__.py`` is invisible to the contracts (grimp reads packages
    only), and one missing from pyproject's list is missing from the wheel."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = product_folders()
    assert [f for f in folders if not (f / "__init__.py").is_file()] == []
    names = {".".join(("elastic", *f.relative_to(ROOT).parts)) for f in folders}
    assert sorted(listed["packages"]) == sorted(names)


def test_the_contracts_are_kept() -> None:
    report = lint_imports(ROOT, copy=False)
    verdicts = contract_verdicts(report)
    assert verdicts and set(verdicts.values()) == {"KEPT"}, report[-4000:]


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The product and its pyproject.toml, copied as a package named ``elastic``."""
    copy = tmp_path_factory.mktemp("pristine") / "elastic"
    shutil.copytree(
        ROOT,
        copy,
        ignore=shutil.ignore_patterns(*NOT_PRODUCT, ".*", "__pycache__", "*.egg-info"),
    )
    return copy


# (module of the product, the import added to it, the contract that must refuse it, the
# line the refusal must contain)
UPWARD_IMPORTS = [
    pytest.param(
        "core/rendezvous/round/records.py",
        "import elastic.core.agent.loop",
        "core's rooms import only rooms below them",
        "elastic.core.rendezvous is not allowed to import elastic.core.agent",
        id="round-imports-the-agent",
    ),
    pytest.param(
        "core/rendezvous/round/signing.py",
        "from elastic.core.rendezvous.round import protocol",
        "the rendezvous round:",
        "elastic.core.rendezvous.round.signing is not allowed to import "
        "elastic.core.rendezvous.round.protocol",
        id="round-signing-imports-the-protocol",
    ),
    pytest.param(
        "plugins/rdzv_etcd_v3/store.py",
        "import elastic.core.agent.loop",
        "a plugin imports only core's public rooms",
        "elastic.plugins is not allowed to import elastic.core.agent",
        id="plugin-imports-the-agent",
    ),
    pytest.param(
        "training/regroup.py",
        "import elastic.core.agent.regroup",
        "training code (in workers) never imports the agent's side",
        "elastic.training is not allowed to import elastic.core.agent",
        id="training-imports-the-agent",
    ),
    pytest.param(
        "api.py",
        "import elastic.cli.main",
        "nothing imports the CLI",
        "elastic.api is not allowed to import elastic.cli",
        id="api-imports-the-cli",
    ),
    pytest.param(
        "core/agent/start.py",
        "import elastic.core.agent.loop",
        "no import circle",
        "- .start -> .loop (1 import)",
        id="a-circle-inside-a-room",
    ),
]


def test_the_untouched_copy_keeps_every_contract(package_copy: pathlib.Path) -> None:
    """The copy is what the refusals below are measured against: it must pass as the tree does."""
    report = lint_imports(package_copy, copy=True)
    verdicts = contract_verdicts(report)
    assert verdicts and set(verdicts.values()) == {"KEPT"}, report[-4000:]


@pytest.mark.parametrize(("module", "line", "contract", "refusal"), UPWARD_IMPORTS)
def test_a_contract_refuses_an_import_running_the_wrong_way(
    package_copy: pathlib.Path,
    tmp_path: pathlib.Path,
    module: str,
    line: str,
    contract: str,
    refusal: str,
) -> None:
    changed = tmp_path / "elastic"
    shutil.copytree(package_copy, changed)
    target = changed / module
    target.write_text(target.read_text() + f"\n{line}  # added by tests/test_layers.py\n")

    report = lint_imports(changed, copy=True)

    broken = [name for name, verdict in contract_verdicts(report).items() if verdict == "BROKEN"]
    assert any(name.startswith(contract) for name in broken), report[-4000:]
    assert refusal in report, report[-4000:]


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
