"""bench/regress.py's verdict: a figure is worse only past the larger of the tolerance and
the base's own spread, and bad arguments are one line."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "regress.py"


def load_regress():
    spec = importlib.util.spec_from_file_location("bench_regress", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


regress = load_regress()


def test_a_slowdown_past_the_tolerance_is_worse() -> None:
    verdict = regress.judge("launch", [1.0, 1.01, 0.99], [1.2, 1.21, 1.19], 0.10)
    assert verdict.regressed
    assert verdict.change == pytest.approx(0.2)


def test_a_change_inside_the_base_spread_is_noise() -> None:
    # the base moves 30% between identical runs: 20% slower is not evidence
    verdict = regress.judge("agents8", [1.0, 1.3, 1.1], [1.3, 1.35, 1.3], 0.10)
    assert verdict.noise == pytest.approx(0.3 / 1.1)
    assert not verdict.regressed


def test_faster_is_never_worse() -> None:
    assert not regress.judge("rss", [100.0, 100.0], [50.0, 51.0], 0.0).regressed


@pytest.mark.parametrize(
    "args, words",
    [(["--figures", "launch,nope"], "unknown figure(s) nope"), (["--rounds", "1"], "at least 2")],
)
def test_bad_arguments_are_one_line(args: list[str], words: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert words in proc.stderr
    assert "Traceback" not in proc.stderr
