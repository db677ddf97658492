"""Run the backend conformance suite as one call: ``run_conformance(target)``.

The suite itself is ``elastic.testing.conformance.RendezvousConformance`` (subclass it to
get one pytest test per case). This runs the same cases from inside a single test, for
plugin authors who would rather write one line: each case gets fresh ``nodes`` and a
fresh ``run_id``, exactly as the suite's fixtures give them, and the report says which
passed, failed (with the reason) or skipped. The ``elastic_conformance`` fixture is this
function.
"""

from __future__ import annotations

import inspect
import traceback
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest
from elastic.testing.conformance import Nodes, RendezvousConformance, RendezvousTarget


@dataclass
class ConformanceReport:
    backend: str
    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def assert_passed(self) -> None:
        """Fail the calling test, naming every case that failed and why."""
        if self.failed:
            lines = [f"{case}: {why}" for case, why in self.failed.items()]
            raise AssertionError(
                f"the {self.backend} backend failed {len(self.failed)} conformance case(s):\n"
                + "\n".join(lines)
            )


def case_names(suite: type[RendezvousConformance] = RendezvousConformance) -> list[str]:
    return sorted(n for n in dir(suite) if n.startswith("test_"))


def _reason(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}".replace("\n", " ")


def run_case(suite: RendezvousConformance, case: str, target: RendezvousTarget) -> None:
    method = getattr(suite, case)
    nodes = Nodes(target)
    provided: dict[str, Any] = {
        "nodes": nodes,
        "run_id": f"conf-{uuid.uuid4().hex[:10]}",
        "rdzv_target": target,
    }
    wanted = list(inspect.signature(method).parameters)
    missing = [name for name in wanted if name not in provided]
    if missing:
        raise TypeError(f"needs fixture(s) {', '.join(missing)}, which only pytest can give")
    try:
        method(**{name: provided[name] for name in wanted})
    finally:
        nodes.close()


def run_conformance(
    target: RendezvousTarget,
    cases: Iterable[str] | None = None,
    suite: type[RendezvousConformance] = RendezvousConformance,
) -> ConformanceReport:
    """Run ``cases`` (default: all) of ``suite`` against ``target``; never raises for a
    failing case (see ``ConformanceReport.assert_passed``)."""
    chosen = list(cases) if cases is not None else case_names(suite)
    unknown = sorted(set(chosen) - set(case_names(suite)))
    if unknown:
        raise ValueError(f"no such conformance case(s): {', '.join(unknown)}")
    report = ConformanceReport(target.backend)
    instance = suite()
    for case in chosen:
        try:
            run_case(instance, case, target)
        except pytest.skip.Exception as exc:
            report.skipped[case] = str(exc.msg)
        except Exception as exc:  # noqa: BLE001 - a failing case is reported, not raised
            report.failed[case] = _reason(exc)
        else:
            report.passed.append(case)
    return report
