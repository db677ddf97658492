"""Error files written and read across real worker processes, with torch's reader and
torch's ``@record`` as the peer implementation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from elastic.core.workers.errorfile import (
    ErrorFileContent,
    failure_time,
    read_error_file,
    write_error_file,
)

OURS = "from elastic import record"
TORCHS = "from torch.distributed.elastic.multiprocessing.errors import record"


def run_worker(
    tmp_path: Path, body: str, decorator_import: str = OURS, error_file: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``body`` as the decorated ``main`` of a fresh Python process."""
    script = tmp_path / "worker.py"
    script.write_text(
        f"{decorator_import}\n\n@record\ndef main():\n{textwrap.indent(body, '    ')}\n\n"
        "if __name__ == '__main__':\n    main()\n"
    )
    env = dict(os.environ)
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    if error_file is not None:
        env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60
    )


def torch_failure(path: Path, pid: int = 1, exitcode: int = 1):  # noqa: ANN201
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    return ProcessFailure(local_rank=0, pid=pid, exitcode=exitcode, error_file=str(path))


def test_decorated_exception_writes_torch_format(tmp_path: Path) -> None:
    err = tmp_path / "error.json"
    before = time.time()
    proc = run_worker(tmp_path, "raise ValueError('boom 42')", error_file=err)
    after = time.time()
    assert proc.returncode == 1
    assert "ValueError: boom 42" in proc.stderr  # re-raised, so Python printed it too

    data = json.loads(err.read_text())
    msg = data["message"]
    assert msg["message"] == "ValueError: boom 42"
    assert msg["extraInfo"]["timestamp"] == str(int(msg["extraInfo"]["timestamp"]))
    assert "Traceback (most recent call last)" in msg["extraInfo"]["py_callstack"]
    assert "in main" in msg["extraInfo"]["py_callstack"]
    # the traceback starts at the user's function, without the decorator's own frame
    assert "record.py" not in msg["extraInfo"]["py_callstack"]

    # torch's reader accepts it as its own
    failure = torch_failure(err)
    assert failure.message["message"] == "ValueError: boom 42"
    assert before - 1 <= failure.timestamp <= after

    # ours gets the sub-second time
    content = read_error_file(str(err))
    assert content is not None
    assert content.message == "ValueError: boom 42"
    assert "raise ValueError('boom 42')" in content.traceback
    assert content.precise and content.timestamp is not None
    assert before <= content.timestamp <= after
    assert not content.timestamp.is_integer()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]


def test_torch_record_file_readable_by_ours(tmp_path: Path) -> None:
    err = tmp_path / "error.json"
    proc = run_worker(tmp_path, "raise KeyError('missing')", TORCHS, error_file=err)
    assert proc.returncode == 1
    content = read_error_file(str(err))
    assert content is not None
    assert content.message == "KeyError: 'missing'"
    assert "raise KeyError('missing')" in content.traceback
    assert not content.precise
    assert content.timestamp is not None and content.timestamp.is_integer()
    # whole seconds: the agent-observed time within that second is preferred
    observed = content.timestamp + 0.25
    assert failure_time(content, observed) == observed


@pytest.mark.parametrize("decorator_import", [OURS, TORCHS], ids=["ours", "torch"])
def test_success_writes_nothing(tmp_path: Path, decorator_import: str) -> None:
    err = tmp_path / "error.json"
    proc = run_worker(tmp_path, "print('fine')", decorator_import, error_file=err)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "fine"
    assert not err.exists()


def test_system_exit_handling(tmp_path: Path) -> None:
    err = tmp_path / "error.json"
    assert run_worker(tmp_path, "import sys; sys.exit(0)", error_file=err).returncode == 0
    assert not err.exists()
    assert run_worker(tmp_path, "import sys; sys.exit(3)", error_file=err).returncode == 3
    assert not err.exists()  # like torch: an exit status is not an exception
    proc = run_worker(tmp_path, "import sys; sys.exit('bad config')", error_file=err)
    assert proc.returncode == 1
    content = read_error_file(str(err))
    assert content is not None and content.message == "SystemExit: bad config"


def test_unset_env_just_reraises(tmp_path: Path) -> None:
    proc = run_worker(tmp_path, "raise RuntimeError('no file')")
    assert proc.returncode == 1
    assert "RuntimeError: no file" in proc.stderr
    assert "TORCHELASTIC_ERROR_FILE is not set" in proc.stderr
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".json")]


def test_record_import_is_cheap(tmp_path: Path) -> None:
    code = (
        "import sys, elastic\n"
        "f = elastic.record(lambda: 1)\n"
        "assert f() == 1\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"


def test_read_tolerates_garbage_and_absence(tmp_path: Path) -> None:
    assert read_error_file(str(tmp_path / "absent.json")) is None
    empty = tmp_path / "empty.json"
    empty.write_text("  \n")
    assert read_error_file(str(empty)) is None
    assert read_error_file(str(tmp_path)) is None  # a directory is no error file

    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"Segmentation fault \xff(core dumped)\n")
    content = read_error_file(str(garbage))
    assert content is not None and "Segmentation fault" in content.message
    assert content.timestamp is None

    for doc in ([1, 2], {"other": 1}, {"message": 5}, "just a string"):
        path = tmp_path / "odd.json"
        path.write_text(json.dumps(doc))
        got = read_error_file(str(path))
        assert got is not None and got.timestamp is None

    bad_ts = tmp_path / "bad_ts.json"
    bad_ts.write_text(json.dumps({"message": {"message": "X", "extraInfo": {"timestamp": "?"}}}))
    assert read_error_file(str(bad_ts)) == ErrorFileContent("X", "", None, False)


def test_read_torch_string_message_format(tmp_path: Path) -> None:
    path = tmp_path / "new.json"
    path.write_text(json.dumps({"message": "OOM in allocator", "timestamp": "1700000000"}))
    content = read_error_file(str(path))
    assert content == ErrorFileContent("OOM in allocator", "", 1700000000.0, False)


def test_write_is_atomic_replace(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "error.json"
    for i in range(3):
        try:
            raise OSError(f"disk {i}")
        except OSError as exc:
            write_error_file(str(path), exc)
    content = read_error_file(str(path))
    assert content is not None and content.message == "OSError: disk 2"
    assert os.listdir(path.parent) == ["error.json"]
    torch_failure(path)  # torch still parses what we overwrote


def test_failure_time_rules() -> None:
    precise = ErrorFileContent("m", "", 100.5, True)
    assert failure_time(precise, 103.0) == 100.5
    whole = ErrorFileContent("m", "", 100.0, False)
    assert failure_time(whole, 100.3) == 100.3  # observed within the file's second
    assert failure_time(whole, 105.0) == pytest.approx(100.999)  # agent noticed late
    assert failure_time(whole, 99.0) == 100.0  # clocks disagree: trust the file
    assert failure_time(None, 42.0) == 42.0
    assert failure_time(ErrorFileContent("m", "", None), 42.0) == 42.0
