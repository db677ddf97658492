"""The randomized fault campaign (bench/campaign.py): its checker names each violation,
its schedule keeps the job above its minimum, and a short seeded run on the simulated
network passes on etcd-v3."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest
from elastic.harness.cluster import require_cluster

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


check_mod = load("campaign_check")


def steps(world: str, first: int, last: int, t0: float, ranks: int = 2) -> list[dict]:
    value = {s: s * 10 for s in range(first, last + 1)}
    return [
        {"event": "step", "world_id": world, "step": s, "value": value[s], "rank": r,
         "t": t0 + 0.1 * (s - first)}
        for s in range(first, last + 1)
        for r in range(ranks)
    ]  # fmt: skip


def done(step: int, ranks: int = 2) -> list[dict]:
    return [{"event": "done", "step": step, "value": step * 10, "t": 99.0}] * ranks


REFERENCE = {s: s * 10 for s in range(1, 100)}


def judge(events: list[dict], faults: int = 1, codes=None, leftovers=None):
    return check_mod.check(
        events,
        reference=REFERENCE,
        faults=faults,
        member_exit_codes=codes if codes is not None else {"a": 0, "b": 0},
        leftovers=leftovers or {},
    )


def test_one_world_after_another_with_one_step_redone_passes() -> None:
    verdict = judge(steps("w1", 1, 10, 0.0) + steps("w2", 10, 20, 5.0) + done(20))
    assert verdict.ok, verdict.violations
    assert (verdict.worlds, verdict.redone, verdict.final_step) == (2, 1, 20)


def test_state_lost_to_a_restart_counts_as_redone() -> None:
    # the job reached step 40, then every worker restarted from nothing and stopped at 3
    verdict = judge(steps("w1", 1, 40, 0.0) + steps("w2", 1, 3, 9.0) + done(3), faults=2)
    assert verdict.redone == 3 + 37
    assert any("40 steps redone for 2 faults" in v for v in verdict.violations)


def test_two_worlds_at_the_same_time_are_named() -> None:
    verdict = judge(steps("w1", 1, 20, 0.0) + steps("w2", 1, 20, 0.5) + done(20), faults=50)
    assert any("two worlds" in v for v in verdict.violations)


def test_a_final_state_unlike_the_undisturbed_one_is_named() -> None:
    wrong = [{"event": "done", "step": 20, "value": 7, "t": 99.0}]
    verdict = judge(steps("w1", 1, 20, 0.0) + wrong)
    assert any("undisturbed" in v for v in verdict.violations)


def test_more_steps_redone_than_faults_is_named() -> None:
    verdict = judge(steps("w1", 1, 10, 0.0) + steps("w2", 1, 20, 5.0) + done(20), faults=2)
    assert verdict.redone == 10
    assert any("10 steps redone for 2 faults" in v for v in verdict.violations)


@pytest.mark.parametrize(
    "codes, finished, words",
    [
        ({"a": 0, "b": 1}, True, "b's agent (exit 1)"),
        ({"a": 0, "b": None}, True, "b's agent (still running)"),
        ({"a": 1, "b": 0}, False, "b's agent (exit 0)"),
    ],
)
def test_exit_codes_must_be_the_jobs_outcome(codes, finished, words) -> None:
    events = steps("w1", 1, 5, 0.0) + (done(5) if finished else [])
    verdict = judge(events, codes=codes)
    assert [v for v in verdict.violations if v.startswith(words)], verdict.violations


def test_leftover_processes_are_named() -> None:
    verdict = judge(steps("w1", 1, 5, 0.0) + done(5), leftovers={"node1": [123]})
    assert verdict.violations == ["processes left behind on node1: [123]"]


def test_the_time_budget_splits_training_regroups_stalls_and_start_ups() -> None:
    events = steps("w1", 1, 10, 0.0) + steps("w2", 10, 20, 1.4) + steps("w3", 1, 5, 10.0)
    events.append({"event": "sync", "pid": 7, "t": 9.0})
    starts = [{"pid": 1, "t": -3.0}, {"pid": 7, "t": 5.0}, {"pid": 8, "t": 6.0}]
    budget = check_mod.time_budget(events, starts)
    assert budget == {
        "training_s": 2.3,  # 0.9 + 1.0 + 0.4
        "regroups": [0.5],
        "stalls": [7.6],
        "state_lost": 1,  # w3 began again at step 1
        "fresh_startup_s": [4.0],  # pid 1 started before the first step: not counted
        "fresh_never_synced": 1,
    }


def test_a_schedule_is_the_seeds_and_never_goes_below_the_minimum() -> None:
    first = check_mod.plan(7, 4, 150.0, (5.0, 10.0))
    assert first == check_mod.plan(7, 4, 150.0, (5.0, 10.0))
    assert first != check_mod.plan(8, 4, 150.0, (5.0, 10.0))
    faults = [f for f in first if f.kind != "heal"]
    gaps = [b.at - a.at for a, b in zip(faults, faults[1:], strict=False)]
    assert gaps and min(gaps) >= 5.0 - 0.01
    up = {0, 1, 2, 3}
    for fault in first:
        if fault.kind == "replace":
            assert fault.host not in up
            up.add(fault.host)
        elif fault.kind == "heal":
            up.add(fault.host)
        else:
            assert fault.host in up and len(up) > 2
            up.discard(fault.host)
    assert {f.kind for f in first} >= {"sigterm", "sigkill", "cut", "heal", "replace", "store"}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("impl, seed", [("etcd-v3", 1), ("c10d", 1)])
def test_a_short_seeded_campaign_has_no_violation(impl: str, seed: int, tmp_path: Path) -> None:
    require_cluster()
    campaign = load("campaign")
    args = argparse.Namespace(
        variant="in-place", duration=25.0, gap=(5.0, 10.0), pause=0.1, baseline=0.0,
        baseline_rate=10.0, settle=8.0, warm_restarts=False,
    )  # fmt: skip
    report = campaign.run_seed(args, impl, seed, tmp_path)
    assert report["faults_injected"] >= 2, report["faults"]
    assert not report["violations"], (report["violations"], report["logs"])
