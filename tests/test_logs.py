"""Log layout (torchrun's), tee tailing with prefixes, and reading back failed workers."""

from __future__ import annotations

import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
from elastic.core.interfaces.spec import WorkerGroup, WorkerSpec
from elastic.core.workers.env import assign_ranks
from elastic.core.workers.logs import (
    LogLayout,
    LogTailer,
    Std,
    WorkerLogs,
    failure_record,
    script_syntax_error,
    tail_lines,
)
from elastic.core.workers.process import CONSOLE
from elastic.harness.commands import run_elastic, write_script


def test_layout_matches_torchrun(tmp_path: Path) -> None:
    layout = LogLayout("job", str(tmp_path), redirects={0: Std.ALL}, tee={1: Std.OUT}, suffix="x")
    logs = layout.attempt(0, 3)
    run_dir = tmp_path / "job_x"
    assert layout.run_dir == str(run_dir)
    assert logs[0].stdout == str(run_dir / "attempt_0" / "0" / "stdout.log")
    assert logs[0].stderr == str(run_dir / "attempt_0" / "0" / "stderr.log")
    assert not logs[0].tee_stdout and not logs[0].tee_stderr
    assert logs[1].stdout == str(run_dir / "attempt_0" / "1" / "stdout.log")
    assert logs[1].tee_stdout and logs[1].stderr == CONSOLE
    assert logs[2].stdout == CONSOLE and logs[2].stderr == CONSOLE
    for rank in range(3):
        assert logs[rank].error_file == str(run_dir / "attempt_0" / str(rank) / "error.json")
        assert (run_dir / "attempt_0" / str(rank)).is_dir()
    again = layout.attempt(2, 1)
    assert again[0].error_file == str(run_dir / "attempt_2" / "0" / "error.json")


def test_run_dir_is_unique_without_suffix(tmp_path: Path) -> None:
    a = LogLayout("job", str(tmp_path))
    b = LogLayout("job", str(tmp_path))
    a.attempt(0, 1)
    b.attempt(0, 1)
    assert a.run_dir != b.run_dir
    assert os.path.basename(a.run_dir or "").startswith("job_")


def test_default_log_dir_is_a_torchelastic_temp_dir() -> None:
    layout = LogLayout("job")
    assert layout.log_dir is not None
    assert os.path.basename(layout.log_dir).startswith("torchelastic_")
    layout.tidy()
    assert not os.path.exists(layout.log_dir)


def test_tidy_removes_only_an_empty_temp_dir_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    tempfile.tempdir = None  # read TMPDIR again
    try:
        empty, written = LogLayout("job"), LogLayout("job")
    finally:
        tempfile.tempdir = None
    empty.attempt(0, 2)
    logs = written.attempt(0, 1)
    Path(logs[0].error_file).write_text("{}")
    named = LogLayout("job", str(tmp_path / "named"))
    named.attempt(0, 1)
    for layout in (empty, written, named):
        layout.tidy()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [os.path.basename(written.log_dir or ""), "named"]
    )


def test_log_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("")
    with pytest.raises(NotADirectoryError):
        LogLayout("job", str(f))


def test_local_ranks_filter(tmp_path: Path) -> None:
    layout = LogLayout(
        "job", str(tmp_path), tee={0: Std.ALL, 1: Std.ALL}, local_ranks_filter=frozenset({0})
    )
    logs = layout.attempt(0, 3)
    assert logs[0].tee_stdout and logs[0].tee_stderr
    # teed but filtered out: still written to its files, not shown
    assert not logs[1].tee_stdout and logs[1].stdout.endswith("stdout.log")
    # not redirected and filtered out: nowhere
    assert logs[2].stdout == os.devnull and logs[2].stderr == os.devnull


def test_devnull_log_dir() -> None:
    logs = LogLayout("job", os.devnull).attempt(0, 2)
    assert logs[1] == WorkerLogs(CONSOLE, CONSOLE, "")


def test_tailer_prefixes_whole_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    f = tmp_path / "stdout.log"
    tailer = LogTailer([(str(f), "[trainer3]:", "stdout")], interval=0.01).start()
    with open(f, "w") as w:
        w.write("first\nsec")
        w.flush()
        time.sleep(0.1)
        w.write("ond\nno newline")
    tailer.stop()
    assert out.getvalue() == "[trainer3]:first\n[trainer3]:second\n[trainer3]:no newline\n"


def test_tailer_waits_for_missing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    tailer = LogTailer([(str(tmp_path / "never"), "[x0]:", "stderr")], interval=0.01).start()
    tailer.stop()
    assert err.getvalue() == ""


def test_tail_lines(tmp_path: Path) -> None:
    f = tmp_path / "stderr.log"
    f.write_text("".join(f"line {i}\n" for i in range(100)))
    assert tail_lines(str(f), 3) == "line 97\nline 98\nline 99"
    assert tail_lines(str(tmp_path / "missing")) == ""
    assert tail_lines(None) == ""


def test_script_syntax_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n    pass\n")
    good = tmp_path / "good.py"
    good.write_text("print('ok')\n")
    message = script_syntax_error(sys.executable, ("-u", str(bad), "--flag"))
    assert message is not None and message.startswith("SyntaxError: ")
    assert script_syntax_error(sys.executable, ("-u", str(good))) is None
    assert script_syntax_error(sys.executable, ("-u", "-m", "bad")) is None
    assert script_syntax_error("/bin/true", (str(bad),)) is None
    assert script_syntax_error(print, ()) is None


def _group() -> WorkerGroup:
    spec = WorkerSpec(role="trainer", local_world_size=2, entrypoint="x")
    group = WorkerGroup(spec, group_rank=1, group_world_size=2, restart_count=1)
    group.workers = assign_ranks(spec, 1, 2)
    return group


def test_failure_record_from_error_file(tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    error_file.write_text(
        json.dumps(
            {
                "message": {
                    "message": "ValueError: boom",
                    "extraInfo": {
                        "py_callstack": "Traceback...\nValueError: boom",
                        "timestamp": "1700000000",
                        "timestamp_precise": "1700000000.25",
                    },
                }
            }
        )
    )
    group = _group()
    logs = WorkerLogs(error_file=str(error_file))
    rec = failure_record(
        group, group.workers[1], 42, 1, 1800000000.0, logs, node_id="n1", round_=3, host="h"
    )
    assert (rec.rank, rec.local_rank, rec.group_rank, rec.role) == (3, 1, 1, "trainer")
    assert rec.message == "ValueError: boom"
    assert rec.traceback.endswith("ValueError: boom")
    assert rec.timestamp == 1700000000.25
    assert rec.attempt == 1 and rec.extra == {"round": 3} and rec.node_id == "n1"
    assert rec.signal is None and rec.pid == 42 and rec.host == "h"
    assert rec.error_file == str(error_file)


def test_failure_record_from_stderr_tail(tmp_path: Path) -> None:
    stderr = tmp_path / "stderr.log"
    stderr.write_text("noise\n" * 50 + "Traceback (most recent call last):\nKeyError: 'x'\n\n")
    group = _group()
    logs = WorkerLogs(stderr=str(stderr), error_file=str(tmp_path / "error.json"))
    rec = failure_record(
        group, group.workers[0], 7, -9, 123.5, logs, node_id="n", round_=0, host="h"
    )
    assert rec.message == "KeyError: 'x'"
    assert len(rec.traceback.splitlines()) == 20
    assert rec.signal == "SIGKILL" and rec.exit_code == -9 and rec.timestamp == 123.5
    assert rec.stderr_path == str(stderr) and rec.stdout_path is None
    assert rec.error_file is None  # the worker wrote none: do not point at a missing file


@pytest.mark.timeout(120)
def test_a_run_leaves_no_empty_log_dir_behind_but_keeps_one_with_an_error_file(
    tmp_path: Path,
) -> None:
    ok = write_script(tmp_path, "ok.py", "print('ok')")
    failing = write_script(
        tmp_path, "fail.py", "import elastic\n\n@elastic.record\ndef main():\n    1 / 0\n\nmain()"
    )
    for script, code, kept in ((ok, 0, 0), (failing, 1, 1)):
        temp = tmp_path / f"temp-{code}"
        temp.mkdir()
        proc = run_elastic(
            "run", "--standalone", "--nproc-per-node=2", script, env={"TMPDIR": str(temp)}
        )
        assert proc.returncode == code, proc.stderr
        left = [p for p in temp.iterdir() if p.name.startswith("torchelastic_")]
        assert len(left) == kept, left
        if kept:
            assert list(left[0].rglob("error.json")), list(left[0].rglob("*"))
