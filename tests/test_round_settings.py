"""The round's liveness settings as parsed from ``--rdzv-conf``: the heartbeat interval
not given follows the job's size (a bounded rate of keep-alives at the store and rank 0),
a value given is taken as given, and the rules' errors are one line naming the keys."""

from __future__ import annotations

import pytest
from elastic.core.interfaces.rendezvous import RendezvousConfigError, RendezvousParameters
from elastic.core.rendezvous.round.settings import (
    KEEP_ALIVES_PER_SECOND,
    default_interval,
    parse_round_settings,
)


def liveness(max_nodes: int, **conf: str) -> tuple[float, float]:
    params = RendezvousParameters("c10d", "127.0.0.1:29400", "job", 1, max_nodes, config=conf)
    settings = parse_round_settings(params)
    return settings.heartbeat_interval, settings.heartbeat_timeout


@pytest.mark.parametrize(
    ("max_nodes", "expected"),
    [(1, (1.0, 5.0)), (8, (1.0, 5.0)), (512, (1.0, 5.0)), (1024, (2.0, 10.0)), (4096, (8.0, 40.0))],
)
def test_the_interval_not_given_keeps_the_jobs_keep_alives_within_a_rate(
    max_nodes: int, expected: tuple[float, float]
) -> None:
    assert liveness(max_nodes) == expected
    interval, _ = expected
    assert max_nodes / interval <= KEEP_ALIVES_PER_SECOND


def test_values_given_are_taken_as_given_whatever_the_size() -> None:
    assert liveness(4096, heartbeat_interval="0.5", heartbeat_timeout="3") == (0.5, 3.0)
    assert liveness(4096, keep_alive_interval="1", keep_alive_max_attempt="3") == (1.0, 3.0)


def test_one_value_given_and_the_other_from_the_size() -> None:
    # The interval alone: the timeout is five of the size's intervals.
    assert liveness(1024, heartbeat_interval="0.5") == (0.5, 10.0)
    assert liveness(8, heartbeat_interval="0.5") == (0.5, 5.0)
    # The timeout alone: the interval leaves room for two heartbeats within it.
    assert liveness(1024, heartbeat_timeout="3") == (1.5, 3.0)
    assert liveness(1024, heartbeat_timeout="30") == (2.0, 30.0)
    # torch's attempts alone multiply the size's interval.
    assert liveness(2048, keep_alive_max_attempt="3") == (4.0, 12.0)


def test_a_timeout_too_short_is_the_same_error_at_any_size() -> None:
    """The size never turns a setting that works at 1 s into an error, nor the reverse."""
    for max_nodes in (8, 4096):
        with pytest.raises(RendezvousConfigError, match="must be at least twice"):
            liveness(max_nodes, heartbeat_timeout="1.5")
    assert default_interval(8) == 1.0


def test_our_names_and_torchs_together_are_refused() -> None:
    with pytest.raises(RendezvousConfigError, match="not both"):
        liveness(8, heartbeat_interval="1", keep_alive_interval="1")
