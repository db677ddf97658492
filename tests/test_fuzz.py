"""A bounded coverage-guided run of every fuzz target (``bench/fuzz.py``): the checked-in
corpus (``tests/fuzz_corpus/<target>/``, every crash ever found among it) is replayed,
then mutated for a few hundred inputs. Any input that makes a parser raise anything but
its documented refusal fails the test, and names the saved input. Longer runs and their
figures: ``python bench/fuzz.py --seconds 300`` (docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris", reason="atheris is in the test extra: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parent.parent
FUZZ = ROOT / "bench" / "fuzz.py"
CORPUS = ROOT / "tests" / "fuzz_corpus"
# Inputs per target: a few thousand in all, seconds each (etcd's targets are slower per
# input: a failed watch pauses 50 ms, as the product does).
RUNS = {
    "store-request": 1000,
    "store-session": 1000,
    "signed-record": 800,
    "etcd-v3-reply": 80,
    "etcd-v2-reply": 80,
    "control-file": 600,
    "slurm-hostlist": 800,
    "rdzv-conf": 800,
    "replay": 300,
}


def targets() -> list[str]:
    out = subprocess.run(
        [sys.executable, str(FUZZ), "--list"], capture_output=True, text=True, check=True
    )
    return [line.split()[0] for line in out.stdout.splitlines()]


def test_every_target_has_a_bound_and_a_corpus() -> None:
    assert sorted(targets()) == sorted(RUNS)
    for name in RUNS:
        assert any((CORPUS / name).iterdir()), name


@pytest.mark.timeout(240)
@pytest.mark.parametrize("target", sorted(RUNS))
def test_a_bounded_fuzz_run_finds_no_crash(target: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(FUZZ), "--target", target, "--runs", str(RUNS[target])]
        + ["--seconds", "120", "--artifacts", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
    )
    assert proc.stdout.strip(), proc.stderr[-3000:]
    (result,) = json.loads(proc.stdout.strip().splitlines()[-1])
    crashes = {path: Path(path).read_bytes()[:200] for path in result["crashes"]}
    assert not crashes, f"{target} crashed on {crashes}:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The corpus was replayed and the run went on past it.
    seeds = len(list((CORPUS / target).iterdir()))
    assert result["inputs"] >= min(RUNS[target], seeds), result


CRASHING = """
from fuzz_targets import target


@target("parses-nothing")
def parses_nothing():
    \"\"\"A parser that fails on one byte: the runner must say so.\"\"\"

    def one(data: bytes) -> None:
        if data[:1] == b"!":
            raise ValueError("a crash")

    return one
"""


@pytest.mark.timeout(120)
def test_the_runner_reports_a_crash_and_saves_its_input(tmp_path: Path) -> None:
    module = tmp_path / "targets.py"
    module.write_text(CRASHING)
    (tmp_path / "seeds" / "parses-nothing").mkdir(parents=True)
    (tmp_path / "seeds" / "parses-nothing" / "bang").write_bytes(b"!x")
    proc = subprocess.run(
        [sys.executable, str(FUZZ), "--module", str(module), "--target", "parses-nothing"]
        + ["--runs", "50", "--corpus", str(tmp_path / "seeds")]
        + ["--artifacts", str(tmp_path / "out"), "--json"],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    (result,) = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["crashes"]) == 1, result
    assert Path(result["crashes"][0]).read_bytes() == b"!x"
    assert "ValueError: a crash" in proc.stderr
