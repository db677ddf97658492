"""Metrics: put_metric/timed, the built-in sinks, isolation of a broken sink, third-party
sinks found through real entry points, and the lifecycle hook plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from elastic.core import metrics
from elastic.core.metrics import MetricData, configure_sinks, put_metric, timed
from elastic.core.plugin.config import ElasticConfig
from elastic.harness.distributions import make_distribution as make_dist
from elastic.harness.prometheus_names import convention_breaks


@pytest.fixture(autouse=True)
def clean_metrics(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in (
        "ELASTIC_METRICS_SINK",
        "ELASTIC_METRICS_JSONL",
        "ELASTIC_METRICS_PROMETHEUS",
        "ELASTIC_METRICS_DIR",
        "RANK",
    ):
        monkeypatch.delenv(var, raising=False)
    metrics.close_sinks()
    yield
    metrics.close_sinks()
    for name in ("broken", "nostart"):  # what the tests below register in-process
        metrics.SINKS.unregister(name)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_parse_sink_spec_keeps_colons_in_paths() -> None:
    assert metrics.parse_sink_spec(" console , jsonl:/a:b/m.jsonl,,prometheus") == [
        ("console", None),
        ("jsonl", "/a:b/m.jsonl"),
        ("prometheus", None),
    ]
    assert metrics.parse_sink_spec(None) == []


def test_no_sink_is_a_noop() -> None:
    configure_sinks(None)
    put_metric("anything", 1)  # nothing configured: must not raise or print


def test_console_sink(capsys: pytest.CaptureFixture[str]) -> None:
    configure_sinks("console")
    put_metric("rendezvous.duration", 1.5)
    err = capsys.readouterr().err
    assert "[elastic-metric]" in err
    assert "torchelastic.rendezvous.duration=1.5 (agent" in err


def test_jsonl_sink_explicit_path(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "m.jsonl"
    configure_sinks(f"jsonl:{path}")
    put_metric("a", 1)
    put_metric("b", 2.5, group="user")
    metrics.close_sinks()
    rows = read_jsonl(path)
    assert [(r["group"], r["name"], r["value"], r["rank"]) for r in rows] == [
        ("torchelastic", "a", 1.0, None),
        ("user", "b", 2.5, None),
    ]
    assert rows[0]["pid"] == os.getpid() and rows[0]["ts"] > 0


def test_jsonl_sink_path_from_env_then_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_METRICS_DIR", str(tmp_path / "logs"))
    sink = metrics.build_sinks("jsonl")[0][1]
    assert sink.path == tmp_path / "logs" / "metrics.jsonl"  # type: ignore[attr-defined]
    monkeypatch.setenv("ELASTIC_METRICS_JSONL", str(tmp_path / "env.jsonl"))
    assert metrics.build_sinks("jsonl")[0][1].path == tmp_path / "env.jsonl"  # type: ignore[attr-defined]


def test_prometheus_sink_file(tmp_path: Path) -> None:
    path = tmp_path / "elastic.prom"
    configure_sinks(f"prometheus:{path}")
    put_metric("rendezvous.duration", 0.25)
    put_metric("rendezvous.duration", 0.5)
    put_metric("restart", 1)
    text = path.read_text()
    assert "# TYPE torchelastic_rendezvous_duration gauge" in text
    assert 'torchelastic_rendezvous_duration{host="' in text
    lines = {
        line.rsplit(" ", 1)[0].split("{")[0]: line.rsplit(" ", 1)[1]
        for line in text.splitlines()
        if not line.startswith("#")
    }
    assert lines["torchelastic_rendezvous_duration"] == "0.5"
    assert lines["torchelastic_rendezvous_duration_observations_total"] == "2.0"
    assert lines["torchelastic_restart"] == "1.0"
    assert "# TYPE torchelastic_restart_observations_total counter" in text
    # prometheus-client's own parser reads it back (the exposition is the library's).
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["torchelastic_restart_observations"].type == "counter"
    assert families["torchelastic_rendezvous_duration"].samples[0].labels["host"]
    # Written by rename: no temp file is left next to it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elastic.prom"]


def test_prometheus_worker_file_per_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    configure_sinks(f"prometheus:{tmp_path / 'm.prom'}")
    put_metric("step", 7)
    text = (tmp_path / "m.rank3.prom").read_text()
    assert 'rank="3"' in text and "torchelastic_step{" in text


def test_broken_sink_is_dropped_once_and_others_continue(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    class Broken:
        calls = 0

        def emit(self, data: MetricData) -> None:
            Broken.calls += 1
            raise OSError("disk full")

    metrics.register_sink("broken", lambda arg: Broken())
    path = tmp_path / "m.jsonl"
    configure_sinks(f"broken,jsonl:{path}")
    for i in range(3):
        put_metric("x", i)
    metrics.close_sinks()
    err = capsys.readouterr().err
    assert err.count("metrics sink 'broken' failed (OSError: disk full)") == 1
    assert Broken.calls == 1
    assert [r["value"] for r in read_jsonl(path)] == [0, 1, 2]


def test_sink_that_cannot_start_is_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def factory(arg: str | None) -> metrics.MetricSink:
        raise RuntimeError("no endpoint")

    metrics.register_sink("nostart", factory)
    path = tmp_path / "m.jsonl"
    configure_sinks(f"nostart,jsonl:{path}")
    put_metric("x", 1)
    metrics.close_sinks()
    assert "metrics sink 'nostart' could not start (RuntimeError: no endpoint)" in (
        capsys.readouterr().err
    )
    assert len(read_jsonl(path)) == 1


def test_unknown_sink_name() -> None:
    with pytest.raises(ValueError) as info:
        metrics.validate_sink_names("console,statsd")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("unknown metrics sink 'statsd'; known sinks: ")
    assert "console, jsonl, prometheus" in message
    metrics.validate_sink_names("console,jsonl:/tmp/x.jsonl,prometheus")


def test_timed_decorator_and_block(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    configure_sinks(f"jsonl:{path}")

    @timed("work", group="user")
    def work(x: int) -> int:
        return x * 2

    assert work(21) == 42
    with pytest.raises(KeyError):
        with timed("block"):
            raise KeyError("boom")
    metrics.close_sinks()
    rows = read_jsonl(path)
    assert [(r["group"], r["name"]) for r in rows] == [
        ("user", "work.duration_seconds"),
        ("user", "work.duration"),  # the deprecated alias, for one release
        ("user", "work.success"),
        ("torchelastic", "block.failure"),
    ]
    assert 0 <= rows[0]["value"] < 1 and rows[1]["value"] == rows[0]["value"]
    assert work.__name__ == "work"


THIRD_PARTY_SINK = """
import json

class FileSink:
    def __init__(self, arg):
        self.path = arg

    def emit(self, data):
        with open(self.path, "a") as f:
            f.write(json.dumps([data.group, data.name, data.value]) + "\\n")
"""


def test_third_party_sink_through_entry_points(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    site = make_dist(
        tmp_path / "site",
        "acme_sink",
        "[elastic.metrics]\nacme = acme_sink:FileSink\nacme-broken = acme_broken:Sink\n",
        {"acme_sink": THIRD_PARTY_SINK, "acme_broken": "raise ImportError('needs libfoo')\n"},
    )
    monkeypatch.syspath_prepend(str(site))
    assert {"acme", "acme-broken", "console"} <= set(metrics.known_sink_names())
    metrics.validate_sink_names("acme:/x,console")

    out = tmp_path / "acme.out"
    configure_sinks(f"acme-broken,acme:{out},console")
    put_metric("restart", 1)
    err = capsys.readouterr().err
    assert (
        "metrics sink 'acme-broken' from acme_sink==0.1 (acme_broken:Sink) failed to load: "
        "ImportError: needs libfoo; it is skipped"
    ) in err
    assert "torchelastic.restart=1" in err  # console still works
    assert json.loads(out.read_text()) == ["torchelastic", "restart", 1.0]


def test_worker_reads_sink_from_env_without_torch_or_plugin_scan(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    code = (
        "import sys\n"
        "from elastic import put_metric\n"
        "put_metric('loss', 0.5, group='user')\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert 'elastic.plugins.errors' not in sys.modules, 'plugins scanned'\n"
    )
    env = dict(os.environ, ELASTIC_METRICS_SINK=f"jsonl:{path}", RANK="1")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
    rows = read_jsonl(path)
    assert [(r["name"], r["value"], r["rank"]) for r in rows] == [("loss", 0.5, 1)]


def test_events_plugin_through_plugin_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic.core.interfaces.failures import FailureRecord
    from elastic.core.interfaces.rendezvous import RendezvousInfo
    from elastic.core.interfaces.spec import RunResult, WorkerGroup, WorkerSpec, WorkerState
    from elastic.core.plugin.host import PluginHost

    monkeypatch.setenv("ELASTIC_PLUGINS", "metrics")  # just ours, as a real entry point
    monkeypatch.setenv("ELASTIC_METRICS_DIR", str(tmp_path))
    host = PluginHost()
    spec = WorkerSpec(role="trainer", local_world_size=2, entrypoint="train.py")
    config = ElasticConfig(plugin_options={"metrics_sink": "jsonl,prometheus"})
    host.notify("elastic_agent_start", spec=spec, config=config)
    record = next(r for r in host.records if r.name == "metrics")
    assert record.status == "ok", record.error

    # Workers get explicit absolute paths, so their cwd and env do not matter.
    assert host.worker_env(config) == {
        "ELASTIC_METRICS_SINK": (
            f"jsonl:{tmp_path / 'metrics.jsonl'},prometheus:{tmp_path / 'metrics.prom'}"
        )
    }
    info = RendezvousInfo(store=None, rank=0, world_size=2, master_addr="h", master_port=1, round=3)  # type: ignore[arg-type]
    group = WorkerGroup(spec=spec, restart_count=1)
    failure = FailureRecord(
        role="trainer", rank=1, local_rank=1, host="h", pid=9, exit_code=-9, timestamp=1.0
    )
    host.notify("elastic_rendezvous_complete", info=info, duration=0.75)
    host.notify("elastic_workers_started", group=group)
    host.notify("elastic_worker_failed", record=failure)
    host.notify("elastic_restart", group=group, reason="failure")
    host.notify("elastic_membership_changed", old_world_size=1, new_world_size=2, round=3)
    host.notify("elastic_run_end", result=RunResult(state=WorkerState.SUCCEEDED), duration=9.5)

    got = {r["name"]: r["value"] for r in read_jsonl(tmp_path / "metrics.jsonl")}
    assert got == {
        "rendezvous.duration_seconds": 0.75,
        "rendezvous.duration": 0.75,  # deprecated aliases, for one release
        "rendezvous.round": 3,
        "rendezvous.world_size": 2,
        "workers.started": 0,
        "workers.restarts": 1,
        "workers.restart_count": 1,
        "workers.failed": 1,
        "workers.failed.exit_code": -9,
        "restart": 1,
        "restart.failure": 1,
        "membership.changed": 1,
        "membership.world_size": 2,
        "run.duration_seconds": 9.5,
        "run.duration": 9.5,
        "run.succeeded": 1,
        "run.exit_code": 0,
    }
    text = (tmp_path / "metrics.prom").read_text()
    assert "torchelastic_run_duration_seconds{" in text
    assert (
        "# HELP torchelastic_run_duration deprecated alias of torchelastic_run_duration_seconds"
        in text
    )
    assert convention_breaks(text) == []


def test_the_convention_check_sees_the_old_names() -> None:
    old = (
        "# TYPE elastic_restart_count gauge\nelastic_restart_count 1.0\n"
        "# TYPE torchelastic_run_duration gauge\ntorchelastic_run_duration 2.0\n"
        "# HELP elastic_x deprecated alias of elastic_y, for one release\n"
        "# TYPE elastic_x gauge\nelastic_x 1.0\n"
    )
    assert convention_breaks(old) == [
        "elastic_restart_count: a gauge named like a counter or a summary",
        "torchelastic_run_duration: a duration without its unit",
        "elastic_x: alias of elastic_y, which is missing",
    ]


def test_events_plugin_without_sink_sets_nothing() -> None:
    from elastic.core.interfaces.spec import WorkerSpec
    from elastic.plugins.metrics import events

    spec = WorkerSpec(role="trainer", local_world_size=1, entrypoint="train.py")
    plugin = events.MetricsPlugin()
    plugin.elastic_agent_start(spec, ElasticConfig(plugin_options={"metrics_sink": None}))
    assert plugin.elastic_worker_env(ElasticConfig()) is None
    assert plugin.sinks.sinks == []
    assert metrics.sink_manager().sinks == []  # the process-wide sinks are not touched


def test_two_agents_have_their_own_metrics_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elastic.core.interfaces.spec import WorkerSpec
    from elastic.core.plugin.host import PluginHost

    monkeypatch.setenv("ELASTIC_PLUGINS", "metrics")
    spec = WorkerSpec(role="trainer", local_world_size=1, entrypoint="train.py")
    hosts = [PluginHost(), PluginHost()]
    for i, host in enumerate(hosts):
        config = ElasticConfig(plugin_options={"metrics_sink": f"jsonl:{tmp_path / f'{i}.jsonl'}"})
        host.notify("elastic_agent_start", spec=spec, config=config)
    first, second = (host.get_plugin("metrics") for host in hosts)
    assert first is not second
    assert host.worker_env(ElasticConfig()) == {
        "ELASTIC_METRICS_SINK": f"jsonl:{tmp_path / '1.jsonl'}"
    }
    assert hosts[0].worker_env(ElasticConfig()) == {
        "ELASTIC_METRICS_SINK": f"jsonl:{tmp_path / '0.jsonl'}"
    }


def test_metrics_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import elastic.core.metrics, elastic.core.checkpoint\n"
        "import elastic.plugins.metrics.events, elastic.plugins.checkpoint_fs.hooks\n"
        "import elastic.plugins.checkpoint_fs.directory\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
