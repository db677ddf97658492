"""Each optional feature without its extra: one line naming the extra, exit status 2, no
traceback, before anything starts; ``elastic plugins list`` shows the same line as the
plugin's status. The extra's modules are made unimportable in the CLI's process
(``sys.modules[name] = None``, what Python does for a module it must not import)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from elastic.harness.commands import REPO, cli_env
from elastic.testing.ports import free_port

# Runs the real CLI with the modules named in argv[1] (comma-separated) unimportable.
WITHOUT = """\
import runpy, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
sys.argv = ["elastic", *sys.argv[2:]]
runpy.run_module("elastic", run_name="__main__", alter_sys=True)
"""

ETCD = ("etcd", "urllib3")
PROMETHEUS = ("prometheus_client",)


def elastic_without(modules: tuple[str, ...], *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT, ",".join(modules), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
        cwd=cwd,
    )


def one_line(result: subprocess.CompletedProcess, expected: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [expected], result.stderr


@pytest.mark.parametrize(
    ("backend", "missing", "needed"),
    [
        ("etcd", ETCD, "python-etcd"),
        ("etcd-v2", ETCD, "python-etcd"),
        ("etcd-v3", ETCD, "urllib3"),
        # urllib3 alone is what etcd-v3 needs: python-etcd absent does not stop it.
        ("etcd-v2", ("etcd",), "python-etcd"),
    ],
)
def test_an_etcd_backend_without_the_etcd_extra(
    tmp_path: Path, backend: str, missing: tuple[str, ...], needed: str
) -> None:
    (tmp_path / "w.py").write_text("print('ran')\n")
    result = elastic_without(
        missing,
        "run",
        f"--rdzv-backend={backend}",
        "--rdzv-endpoint=127.0.0.1:1",
        "w.py",
        cwd=tmp_path,
    )
    one_line(
        result,
        f"elastic run: error: Invalid value for '--rdzv-backend': rendezvous backend "
        f"'{backend}' needs {needed}: pip install 'elastic-launch[etcd]'",
    )
    assert "ran" not in result.stdout
    status = elastic_without(
        missing,
        "status",
        f"--rdzv-backend={backend}",
        "--rdzv-endpoint=127.0.0.1:1",
        "--rdzv-id=job",
        cwd=tmp_path,
    )
    one_line(
        status,
        f"elastic status: error: rendezvous backend '{backend}' needs {needed}: "
        "pip install 'elastic-launch[etcd]'",
    )


def test_etcd_v3_needs_only_urllib3(tmp_path: Path) -> None:
    result = elastic_without(("etcd",), "plugins", "list", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (v3,) = [line for line in result.stdout.splitlines() if " etcd-v3 " in line]
    assert v3.endswith(" ok"), v3


PROMETHEUS_LINE = "needs prometheus-client: pip install 'elastic-launch[prometheus]'"


@pytest.mark.parametrize("feature", ["sink", "health"])
def test_prometheus_features_without_the_prometheus_extra(tmp_path: Path, feature: str) -> None:
    (tmp_path / "w.py").write_text("print('ran')\n")
    if feature == "sink":
        flag = f"--metrics-sink=prometheus:{tmp_path}/m.prom"
        expected = (
            "elastic run: error: Invalid value for '--metrics-sink': metrics sink "
            f"'prometheus' {PROMETHEUS_LINE}"
        )
    else:
        flag = f"--health-port={free_port()}"
        expected = f"elastic run: error: --health-port (its /metrics) {PROMETHEUS_LINE}"
    result = elastic_without(PROMETHEUS, "run", "--standalone", flag, "w.py", cwd=tmp_path)
    one_line(result, expected)
    assert "ran" not in result.stdout and not (tmp_path / "m.prom").exists()


def test_plugins_list_shows_each_missing_extra_as_the_plugin_s_status(tmp_path: Path) -> None:
    result = elastic_without((*ETCD, *PROMETHEUS), "plugins", "list", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    status = {}
    for line in result.stdout.splitlines()[1:]:
        group, name, *_ = line.split()
        status[(group, name)] = line.split("  ")[-1].strip()
    etcd = "pip install 'elastic-launch[etcd]'"
    assert status[("elastic.rendezvous", "etcd")] == (
        f"error: rendezvous backend 'etcd' needs python-etcd: {etcd}"
    )
    assert status[("elastic.rendezvous", "etcd-v2")] == (
        f"error: rendezvous backend 'etcd-v2' needs python-etcd: {etcd}"
    )
    assert status[("elastic.rendezvous", "etcd-v3")] == (
        f"error: rendezvous backend 'etcd-v3' needs urllib3: {etcd}"
    )
    assert status[("elastic.metrics", "prometheus")] == (
        f"error: metrics sink 'prometheus' {PROMETHEUS_LINE}"
    )
    # Everything that needs no extra still loads.
    for key in [("elastic.rendezvous", "c10d"), ("elastic.rendezvous", "static")]:
        assert status[key] == "ok", result.stdout
    assert status[("elastic.metrics", "jsonl")] == "ok"


def test_the_extras_are_the_ones_the_errors_name() -> None:
    """pyproject's extras and ``EXTRAS`` agree: every distribution an error names is in
    the extra it names; the test extra pulls in every other one; nothing pins torch."""
    from elastic.core.plugin.extras import EXTRAS

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for distribution, extra in EXTRAS.values():
        assert any(req.startswith(distribution) for req in extras[extra]), (distribution, extra)
    others = sorted(name for name in extras if name != "test")
    assert f"elastic-launch[{','.join(others)}]" in extras["test"]
    requirements = [*project["dependencies"], *(r for e in extras.values() for r in e)]
    assert not [r for r in requirements if r.startswith("torch")]
    assert not [r for r in project["dependencies"] if r.split(">")[0] in ("numpy", "python-etcd")]
