"""The rule that a node fails alone until it has joined (``core/agent/joining.py``) and
the summary's order for such failures. The whole path on real agents:
``tests/test_agent_faults.py``."""

from __future__ import annotations

import time

from elastic.core.agent.joining import Joining
from elastic.core.agent.restarts import claim_restart
from elastic.core.agent.store_call import store_call
from elastic.core.interfaces.failures import BEFORE_JOINING, FailureRecord, summarize
from elastic.core.interfaces.store import LocalStore


def test_the_nodes_of_the_first_round_have_joined_from_the_start() -> None:
    store = LocalStore()
    first, second = Joining(), Joining()
    first.attempt_started(store, 3, store_call)
    second.attempt_started(store, 3, store_call)
    assert first.in_first_round and second.in_first_round
    assert not first.fails_alone(store, 3, store_call)


def test_a_first_round_that_does_not_parse_keeps_the_old_rules() -> None:
    store = LocalStore()
    store.set("agent/first_round", b"x" * 100)
    node = Joining()
    node.attempt_started(store, 4, store_call)
    assert node.in_first_round and node.joined


def test_a_late_joiner_fails_alone_until_it_ran_or_a_member_failed_too() -> None:
    store = LocalStore()
    Joining().attempt_started(store, 0, store_call)  # the job's first round
    late = Joining(window=0.2)
    late.attempt_started(store, 2, store_call)
    late.attempt_ended()  # at once: start-up
    assert late.in_first_round is False and not late.joined
    assert late.fails_alone(store, 2, store_call)
    claim_restart(store, 2, "another-node")  # a member failed this round
    assert not late.fails_alone(store, 2, store_call)
    late.attempt_started(store, 3, store_call)  # the first round is read only once
    time.sleep(0.25)
    late.attempt_ended()  # lived past start-up: a member that ran from now on
    assert late.joined and not late.fails_alone(store, 4, store_call)


def rec(host: str, ts: float, *, alone: bool = False) -> FailureRecord:
    extra: dict[str, object] = {"round": 5}
    if alone:
        extra[BEFORE_JOINING] = True
    return FailureRecord("r", 0, 0, host, 1, 1, ts, extra=extra)


def test_a_failure_before_joining_is_the_root_cause_only_when_nothing_else_failed() -> None:
    alone = rec("new", 1.0, alone=True)
    assert summarize("job", [alone]).root_cause.host == "new"
    later = rec("old", 2.0)
    summary = summarize("job", [alone, later])
    assert summary.root_cause.host == "old" and summary.others == [alone]


def test_the_summary_of_a_node_that_left_alone_says_so() -> None:
    from elastic.plugins.errors.summary import render_summary

    text = render_summary(summarize("job", [rec("new", 1.0, alone=True)]))
    assert "this node LEFT the job (exit code 1); the job goes on without it" in text
    assert "FAILED" not in text
    assert "FAILED (exit code 1)" in render_summary(summarize("job", [rec("old", 1.0)]))


def test_status_says_the_root_cause_node_left_before_joining() -> None:
    from dataclasses import asdict

    from elastic.cli.status import render
    from elastic.core.interfaces.rendezvous import JobStatus

    status = JobStatus("job", "c10d", "running", 3, None, 2, 3)
    status.root_cause = asdict(rec("new", 1.0, alone=True))
    assert "root cause: rank 0 on new (before it joined: that node left" in render(status)
    status.root_cause = asdict(rec("old", 1.0))
    assert "root cause: rank 0 on old exit 1" in render(status)
