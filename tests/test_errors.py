"""The errors plugin: the summary table and JSON, and its hooks loaded through the real
entry point. End-to-end runs are in ``test_errors_e2e.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from elastic.core.interfaces.failures import FailureRecord, summarize
from elastic.core.interfaces.spec import WorkerSpec
from elastic.core.plugin.config import ElasticConfig
from elastic.core.plugin.host import PluginHost
from elastic.plugins.errors.summary import format_time, render_summary, summary_dict

T0 = 1_700_000_000.0
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/job/train.py", line 9, in main\n'
    "    raise ValueError('loss is nan')\n"
    "ValueError: loss is nan\n"
)


def failure(**kw: object) -> FailureRecord:
    fields: dict = {"role": "trainer", "local_rank": 0, "exit_code": 1, **kw}
    return FailureRecord(**fields)


def failures() -> list[FailureRecord]:
    return [
        failure(
            rank=3,
            local_rank=1,
            host="node-b",
            pid=4242,
            exit_code=-9,
            timestamp=T0 + 0.250,
            signal="SIGKILL",
            group_rank=1,
        ),
        failure(
            rank=0,
            host="node-a",
            pid=1111,
            timestamp=T0 + 0.123,
            group_rank=0,
            message="ValueError: loss is nan",
            traceback=TRACEBACK,
            error_file="/tmp/err/0/error.json",
        ),
        failure(
            rank=2,
            host="node-b",
            pid=4241,
            exit_code=-11,
            timestamp=T0 + 0.300,
            traceback="Fatal Python error: Segmentation fault\n",
            stderr_path="/logs/2/stderr.log",
            extra={"traceback_source": "stderr"},
        ),
    ]


def test_render_root_cause_first() -> None:
    text = render_summary(summarize("job-7", failures()))
    root_at, others_at = text.index("Root cause"), text.index("Other failures (2")
    assert root_at < others_at
    root = text[root_at:others_at]
    assert "node-a" in root and "rank       : 0 (local rank 0, node rank 0" in root
    assert "pid        : 1111" in root and "exit code 1" in root
    assert "ValueError: loss is nan" in root
    assert "    raise ValueError('loss is nan')" in root  # traceback, indented
    assert format_time(T0 + 0.123).split(" ")[1].endswith(".123")  # milliseconds
    others = text[others_at:]
    assert others.index("rank       : 3") < others.index("rank       : 2")  # time order
    assert "SIGKILL (signal 9) - possible OOM kill" in others
    assert "SIGSEGV (signal 11)" in others and "killed by SIGSEGV" in others
    assert "(+0.127s after root cause)" in others
    assert "stderr     : (last lines" in others and "Segmentation fault" in others
    assert "/logs/2/stderr.log" in others
    assert "FAILED (exit code 1)" in text


def test_render_hints_without_traceback() -> None:
    lone = failure(rank=0, host="h", pid=None, exit_code=2, timestamp=T0)
    text = render_summary(summarize("x", [lone]))
    assert "@elastic.record" in text and "Other failures: none" in text
    assert "<unknown>" in text


def host_with_errors_plugin() -> PluginHost:
    host = PluginHost()
    host.load()
    record = next(r for r in host.records if r.name == "errors")
    assert record.status == "ok", record.error
    assert set(record.hooks) >= {
        "elastic_agent_start",
        "elastic_worker_failed",
        "elastic_run_failed",
    }
    return host


def test_hooks_through_entry_point(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host = host_with_errors_plugin()
    out = tmp_path / "deep" / "summary.json"
    spec = WorkerSpec(role="trainer", local_world_size=2, entrypoint="python")
    config = ElasticConfig(plugin_options={"error_summary": str(out)})
    host.notify("elastic_agent_start", spec=spec, config=config)
    recs = failures()
    summary = summarize("job-7", recs)
    host.call_strict("elastic_run_failed", summary=summary)
    err = capsys.readouterr().err
    assert "Root cause" in err and "ValueError: loss is nan" in err
    assert f"error summary written to {out}" in err
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(summary_dict(summary)))
    assert data["format"] == "elastic.failure-summary/1"
    assert data["root_cause"]["host"] == "node-a" and data["exit_code"] == 1
    assert [o["rank"] for o in data["others"]] == [3, 2]
    assert data["others"][0]["signal_name"] == "SIGKILL"
    assert os.listdir(out.parent) == ["summary.json"]  # no temp file left behind

    # without --error-summary nothing is written
    host.notify("elastic_agent_start", spec=spec, config=ElasticConfig())
    host.call_strict("elastic_run_failed", summary=summary)
    assert "written to" not in capsys.readouterr().err


def test_worker_failed_logs_one_line(caplog: pytest.LogCaptureFixture) -> None:
    host = host_with_errors_plugin()
    with caplog.at_level("WARNING", logger="elastic.errors"):
        for rec in failures():
            host.notify("elastic_worker_failed", record=rec)
    lines = [r.getMessage() for r in caplog.records if r.name == "elastic.errors"]
    assert len(lines) == 3 and all("\n" not in line for line in lines)
    assert "rank 3 (local rank 1) on node-b, pid 4242, SIGKILL" in lines[0]
    assert lines[1].endswith("exit code 1: ValueError: loss is nan")
