"""Publishing failures job-wide, agreeing on one root cause, the exit-code policy, and
recognising start-up failures that restarting cannot fix (from real Python stderr)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from elastic.core.interfaces.failures import (
    COUNT_KEY,
    RECORD_KEY,
    FailureRecord,
    collect,
    is_deterministic_startup_failure,
    launcher_exit_code,
    publish,
    script_problem,
    summarize,
)
from elastic.core.interfaces.store import LocalStore


def rec(rank: int, ts: float, host: str = "h0", exit_code: int = 1, **kw: object) -> FailureRecord:
    return FailureRecord(
        role="trainer",
        rank=rank,
        local_rank=rank % 2,
        host=host,
        pid=1000 + rank,
        exit_code=exit_code,
        timestamp=ts,
        **kw,  # type: ignore[arg-type]
    )


def test_publish_collect_roundtrip_local_store() -> None:
    store = LocalStore()
    assert collect(store) == []
    records = [rec(0, 10.5, message="ValueError: x", extra={"k": [1]}), rec(1, 10.25)]
    for r in records:
        publish(store, r)
    assert store.get(COUNT_KEY) == b"2"
    assert collect(store) == records


def test_collect_skips_unreadable_and_missing() -> None:
    store = LocalStore()
    publish(store, rec(0, 1.0))
    store.set(RECORD_KEY.format(store.add(COUNT_KEY, 1)), b"{not json")
    store.add(COUNT_KEY, 1)  # a publisher that died between add and set
    publish(store, rec(3, 2.0))
    got = collect(store, grace=timedelta(milliseconds=50))
    assert [r.rank for r in got] == [0, 3]


def test_many_nodes_same_root_cause_threads() -> None:
    """Agents on four "nodes" publish concurrently into one store; every one of them
    computes the same root cause from what it collects."""
    store = LocalStore()
    base = 1_700_000_000.0
    per_node = {
        f"node{n}": [rec(n * 2 + i, base + 1 + n * 0.01 + i * 0.001, f"node{n}") for i in range(2)]
        for n in range(4)
    }
    per_node["node2"][1].timestamp = base + 0.123  # the real first failure, on node2

    def agent(host: str) -> None:
        for r in per_node[host]:
            publish(store, r)

    threads = [threading.Thread(target=agent, args=(h,)) for h in per_node]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    summaries = [summarize("job", collect(store)) for _ in per_node]
    assert all(s == summaries[0] for s in summaries)
    s = summaries[0]
    assert (s.root_cause.host, s.root_cause.rank) == ("node2", 5)
    assert len(s.others) == 7
    assert [o.timestamp for o in s.others] == sorted(o.timestamp for o in s.others)


NODE_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from datetime import timedelta
    from torch.distributed import TCPStore
    from elastic.core.interfaces.failures import FailureRecord, collect, publish, summarize

    port, host, ts, nodes = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    publish(store, FailureRecord(role="trainer", rank=ord(host[-1]) - 65, local_rank=0, host=host,
                                 pid=1, exit_code=1, timestamp=ts, message=f"boom on {host}"))
    store.add("published", 1)
    while int(store.add("published", 0)) < nodes:  # every node has published
        time.sleep(0.01)
    s = summarize("job", collect(store))
    print(json.dumps([s.root_cause.host, [o.host for o in s.others], s.exit_code]))
    """
)


def test_nodes_agree_over_tcpstore(tmp_path: Path) -> None:
    """Three nodes share a real TCPStore, as with c10d rendezvous: two separate processes
    and this one (hosting the store). Their clocks' sub-second order decides the root
    cause, not publication order."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    script = tmp_path / "node.py"
    script.write_text(NODE_SCRIPT)
    times = {"nodeA": "1700000000.900", "nodeB": "1700000000.200"}
    env = {**os.environ, "RES_OPTIONS": "timeout:1 attempts:1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(server.port), host, ts, "3"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for host, ts in times.items()
    ]
    # this process is nodeC; it publishes first, so publication order is not time order
    publish(server, rec(2, 1700000000.5, "nodeC"))  # type: ignore[arg-type]
    server.add("published", 1)
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        outs.append(json.loads(out))
    ours = summarize("job", collect(server))  # type: ignore[arg-type]
    outs.append([ours.root_cause.host, [o.host for o in ours.others], ours.exit_code])
    assert outs == [["nodeB", ["nodeC", "nodeA"], 1]] * 3
    del server


def test_summary_order_and_rounds() -> None:
    records = [
        rec(0, 5.0, extra={"round": 1}),
        rec(1, 1.0, extra={"round": 0}),  # an earlier round, restarted past
        rec(2, 4.0, extra={"round": 1}),
        rec(3, 4.0, extra={"round": 1}),
    ]
    s = summarize("r", records)
    assert s.run_id == "r"
    assert s.root_cause.rank == 2  # ties broken by rank
    assert [o.rank for o in s.others] == [3, 0]
    # without rounds, the earliest of all wins
    s = summarize("r", [rec(0, 5.0), rec(1, 1.0)])
    assert s.root_cause.rank == 1
    with pytest.raises(ValueError):
        summarize("r", [])
    d = s.to_dict()
    assert d["root_cause"]["rank"] == 1 and json.dumps(d)


@pytest.mark.parametrize(
    ("exit_code", "signal", "expected"),
    [
        (1, None, 1),
        (3, None, 3),
        (0, None, 1),  # a failure never exits 0
        (300, None, 255),
        (-9, None, 137),
        (-11, "SIGSEGV", 139),
        (-9, "SIGKILL", 137),
        (137, None, 137),  # exited with 137 itself (e.g. a shell wrapper): passed through
    ],
)
def test_exit_code_policy(exit_code: int, signal: str | None, expected: int) -> None:
    r = rec(0, 1.0, exit_code=exit_code, signal=signal)
    assert launcher_exit_code(r) == expected
    assert summarize("r", [r]).exit_code == expected


def python_failure(tmp_path: Path, *args: str, script: str | None = None) -> FailureRecord:
    """Run Python for real and make the record an agent would: exit code + stderr tail."""
    if script is not None:
        (tmp_path / "main.py").write_text(script)
    p = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=tmp_path, timeout=30
    )
    assert p.returncode != 0
    tail = "\n".join(p.stderr.splitlines()[-20:])
    return rec(0, 1.0, exit_code=p.returncode, traceback=tail)


def test_deterministic_startup_failures(tmp_path: Path) -> None:
    assert is_deterministic_startup_failure(python_failure(tmp_path, "missing_script.py"))
    assert is_deterministic_startup_failure(python_failure(tmp_path, "-m", "no_such_mod_zz"))
    assert is_deterministic_startup_failure(python_failure(tmp_path, "-m", "json.no_such_zz"))
    assert is_deterministic_startup_failure(
        python_failure(tmp_path, "main.py", script="def f(:\n    pass\n")
    )
    assert is_deterministic_startup_failure(
        python_failure(tmp_path, "main.py", script="if True:\nprint(1)\n")
    )
    assert is_deterministic_startup_failure(
        python_failure(tmp_path, "main.py", script="import no_such_dependency_zz\n")
    )
    # the same kind of message from an error file (decorated worker) counts too
    assert is_deterministic_startup_failure(
        rec(0, 1.0, message="SyntaxError: invalid syntax (model.py, line 3)")
    )


def test_runtime_failures_are_not_deterministic(tmp_path: Path) -> None:
    assert not is_deterministic_startup_failure(
        python_failure(tmp_path, "main.py", script="raise ValueError('x')\n")
    )
    lazy_import = "def main():\n    import no_such_dependency_zz\n\nmain()\n"
    assert not is_deterministic_startup_failure(
        python_failure(tmp_path, "main.py", script=lazy_import)
    )
    crash = "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n"
    r = python_failure(tmp_path, "main.py", script=crash)
    assert r.exit_code == -11 and not is_deterministic_startup_failure(r)
    assert not is_deterministic_startup_failure(rec(0, 1.0, exit_code=-9, signal="SIGKILL"))


def test_script_problem_matches_python(tmp_path: Path) -> None:
    """The pre-launch check says what Python itself would, and the agent's detector
    recognises it."""
    assert script_problem(str(tmp_path / "absent.py")) is not None
    for name, source in [
        ("ok.py", "print(1)\n"),
        ("bad.py", "def f(:\n"),
        ("tab.py", "if 1:\nx\n"),
    ]:
        (tmp_path / name).write_text(source)
        problem = script_problem(str(tmp_path / name))
        if name == "ok.py":
            assert problem is None
            continue
        assert problem is not None
        real = python_failure(tmp_path, name)
        assert problem.splitlines()[-1] == real.traceback.splitlines()[-1]
        assert is_deterministic_startup_failure(rec(0, 1.0, message=problem))
    missing = script_problem(str(tmp_path / "absent.py"))
    assert missing is not None and "can't open file" in missing
    assert is_deterministic_startup_failure(rec(0, 1.0, exit_code=2, message=missing))
