"""One launch description: every ``LaunchConfig`` field flows, by the one table in
``core/launch/views.py``, into the workers', the rendezvous's and the agent's views, with
its value; a field added or renamed on either side without its place there fails here."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
from elastic.api import launch_config_for
from elastic.core.agent.loop import LocalElasticAgent
from elastic.core.launch import views
from elastic.core.launch.config import LaunchConfig
from elastic.core.launch.launcher import create_handler
from elastic.core.rendezvous.local import LocalRendezvousHandler
from elastic.core.workers.process import DEFAULT_SIGNALS

# A value for every LaunchConfig field, each unlike its default, so that a value that did
# not flow cannot pass for one that did.
SAMPLE: dict[str, Any] = {
    "min_nodes": 2,
    "max_nodes": 5,
    "nproc_per_node": 3,
    "run_id": "job-7",
    "role": "trainer",
    "rdzv_backend": "c10d",
    "rdzv_endpoint": "198.18.0.1:29400",
    "rdzv_configs": {"join_timeout": "77"},
    "standalone": True,  # flips the backend and endpoint: checked apart, below
    "max_restarts": 4,
    "monitor_interval": 0.7,
    "start_method": "fork",
    "log_dir": "/tmp/elastic-logs",
    "redirects": {0: 1, 1: 2, 2: 3},
    "tee": {1: 2},
    "local_ranks_filter": frozenset({1}),
    "local_addr": "198.18.0.2",
    "node_rank": 3,
    "signals_to_handle": ("SIGTERM", "SIGUSR2"),
    "shutdown_timeout": 9.0,
    "extra_env": {"OMP_NUM_THREADS": "1"},
    "fingerprint": {"python": "3.11"},
    "allow_mismatch": frozenset({"python"}),
    "virtual_local_rank": True,
    "numa_binding": "exclusive",
    "warm_restarts": True,
    "duplicate_stdout_filters": ("loss",),
    "duplicate_stderr_filters": ("warn",),
    "rdzv_timeout": 120,
    "plugin_options": {"error_summary": "summary.json"},
    "stall_timeout": 60.0,
    "health_port": 8123,
    "preemption_signal": "SIGUSR1",
    "preemption_grace": 3.0,
    "quiet": True,
    "event_log_handler": "console",
}


def launch_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(LaunchConfig)}


def test_every_launch_field_has_its_place_in_the_table() -> None:
    assert sorted(views.FLOWS) == sorted(launch_fields()), (
        "give each LaunchConfig field its place in core/launch/views.py FLOWS"
    )
    agent_parameters = set(inspect.signature(LocalElasticAgent).parameters)
    for name, targets in views.FLOWS.items():
        assert targets, f"{name} flows nowhere"
        for target in targets:
            view, _, field = target.partition(":")
            if view == views.AGENT:
                assert name in agent_parameters, f"{name}: not a LocalElasticAgent argument"
            elif view != views.LAUNCH:
                view_fields = {f.name for f in dataclasses.fields(views.VIEWS[view])}
                assert (field or name) in view_fields, f"{name} -> {target}: no such field"


@pytest.mark.parametrize("view", sorted(views.VIEWS))
def test_every_field_of_a_view_comes_from_the_launch_or_says_who_sets_it(view: str) -> None:
    view_fields = {f.name for f in dataclasses.fields(views.VIEWS[view])}
    from_launch = set(views.flows_into(view).values())
    others = views.NOT_FROM_THE_LAUNCH[view]
    assert not from_launch & others
    assert sorted(from_launch | others) == sorted(view_fields), (
        f"every {views.VIEWS[view].__name__} field either flows from LaunchConfig "
        "(core/launch/views.py FLOWS) or is named in NOT_FROM_THE_LAUNCH"
    )


def test_the_sample_gives_every_field_a_value_unlike_its_default() -> None:
    assert sorted(SAMPLE) == sorted(launch_fields()), "give the new field a value in SAMPLE"
    defaults = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1)
    for name, value in SAMPLE.items():
        assert value != getattr(defaults, name), name
    assert SAMPLE["signals_to_handle"] != DEFAULT_SIGNALS


def test_every_field_arrives_in_its_views_with_its_value() -> None:
    config = LaunchConfig(**{**SAMPLE, "standalone": False})
    built = {
        "spec": views.worker_spec(config, "python", ("-c", "pass"), None),
        "rendezvous": views.rendezvous_parameters(config),
        "plugins": views.plugin_config(config, config.plugin_options, run_id=""),
    }
    agent = views.agent_arguments(config)
    checked = set()
    for name, targets in views.FLOWS.items():
        for target in targets:
            view, _, field = target.partition(":")
            if view == views.LAUNCH:
                continue
            got = agent[name] if view == views.AGENT else getattr(built[view], field or name)
            assert got == SAMPLE[name], f"{name} -> {target}: {got!r}"
            checked.add(name)
    assert checked == {n for n, t in views.FLOWS.items() if t != (views.LAUNCH,)}


def test_the_launchs_own_fields_reach_what_reads_them() -> None:
    """``standalone`` picks the handler and names the backend once (for every view);
    ``rdzv_timeout`` is folded into the backend's settings by the Python API."""
    config = LaunchConfig(**SAMPLE)
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("standalone", "")
    handler = create_handler(config)
    assert isinstance(handler, LocalRendezvousHandler)
    plugins = views.plugin_config(config, {}, handler.get_run_id())
    assert plugins.rdzv_backend == handler.get_backend() == "standalone"

    torch_style = LaunchConfig(**{**SAMPLE, "standalone": False, "rdzv_configs": {}})
    assert launch_config_for(torch_style).rdzv_configs == {"join_timeout": "120"}
