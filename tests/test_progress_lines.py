"""The lines that tell a person what the rendezvous is doing
(core/rendezvous/round/progress_lines.py): real ``elastic run`` agents on loopback with the
c10d backend, stderr read as it comes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from elastic.harness.processes import Processes
from elastic.testing.waits import wait_until

CONF = "heartbeat_interval=0.5,heartbeat_timeout=2.5,last_call_timeout=5"
WAITING = re.compile(r"^elastic: waiting for nodes: (\d+) joined, need (\d+) \(max (\d+)\)")
FORMED = re.compile(r"^elastic: round (\d+) formed: (\d+) nodes?")

# Workers that need no torch: they run until the stop file exists.
TRAIN = """
import os, time
stop = os.environ["STOP_FILE"]
while not os.path.exists(stop):
    time.sleep(0.1)
"""


class Node:
    """One ``elastic run`` whose stderr lines are collected as they come."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def matching(self, pattern: re.Pattern[str]) -> list[re.Match[str]]:
        return [m for m in map(pattern.match, list(self.lines)) if m]

    def first(self, pattern: re.Pattern[str]) -> int:
        """Index of the first line matching ``pattern``, or -1."""
        for i, line in enumerate(list(self.lines)):
            if pattern.match(line):
                return i
        return -1

    def wait(self, timeout: float = 30) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return code

    def text(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
def node(procs: Processes, port: int, tmp_path: Path):  # noqa: ANN201
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    stop = tmp_path / "stop"

    def start(nnodes: str, *args: str, env: dict[str, str] | None = None) -> Node:
        proc = procs.elastic(
            "run",
            f"--nnodes={nnodes}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=progress",
            f"--rdzv-conf={CONF}",
            "--monitor-interval=0.1",
            *args,
            str(script),
            env=dict(os.environ, PYTHONUNBUFFERED="1", STOP_FILE=str(stop), **(env or {})),
            stdout=subprocess.DEVNULL,
        )
        return Node(proc)

    start.stop = stop  # type: ignore[attr-defined]
    return start


@pytest.mark.timeout(60)
def test_the_first_node_says_whom_it_waits_for_until_the_second_arrives(node) -> None:  # noqa: ANN001
    first = node("2")
    assert wait_until(lambda: first.first(WAITING) >= 0, timeout=20), first.text()
    second = node("2")
    assert wait_until(lambda: second.first(FORMED) >= 0, timeout=20), second.text()
    node.stop.touch()
    assert first.wait() == 0, first.text()
    assert second.wait() == 0, second.text()

    waiting = first.first(WAITING)
    assert waiting >= 0, first.text()
    assert WAITING.match(first.lines[waiting]).groups() == ("1", "2", "2"), first.text()  # type: ignore[union-attr]
    assert "join_timeout in " in first.lines[waiting]
    formed = first.first(FORMED)
    assert 0 <= waiting < formed, first.text()
    assert first.lines[formed] == "elastic: round 0 formed: 2 nodes; this node is rank 0"
    # A round that forms at once prints no waiting line.
    assert second.first(WAITING) < 0, second.text()
    assert second.lines[second.first(FORMED)].endswith("this node is rank 1")


@pytest.mark.timeout(60)
def test_a_waiting_node_reads_what_the_coordinator_knows(node) -> None:  # noqa: ANN001
    """Two nodes wait for a third: the coordinator counts the join records, the other
    node can only know "2 joined" from the coordinator's progress record."""
    a, b = node("3"), node("3")

    def told_two_joined(n: Node) -> bool:
        return ("2", "3", "3") in {m.groups() for m in n.matching(WAITING)}

    assert wait_until(lambda: told_two_joined(a) and told_two_joined(b), timeout=30), (
        a.text() + b.text()
    )
    c = node("3")
    for n in (a, b, c):
        assert wait_until(lambda n=n: n.first(FORMED) >= 0, timeout=20), n.text()
    node.stop.touch()
    for n in (a, b, c):
        assert n.wait() == 0, n.text()
    for n in (a, b):
        counts = {m.groups() for m in n.matching(WAITING)}
        assert ("2", "3", "3") in counts, n.text()


@pytest.mark.timeout(60)
def test_the_survivors_name_the_node_that_left_and_the_new_size(node) -> None:  # noqa: ANN001
    nodes = [node("2:3") for _ in range(3)]
    for n in nodes:
        assert wait_until(lambda n=n: n.first(FORMED) >= 0, timeout=20), n.text()
    assert all(
        n.lines[n.first(FORMED)].startswith("elastic: round 0 formed: 3 nodes") for n in nodes
    )
    time.sleep(1)
    leaver, survivors = nodes[1], [nodes[0], nodes[2]]
    os.kill(leaver.proc.pid, signal.SIGTERM)
    changed = re.compile(
        r"^elastic: round (\d+) formed: 2 nodes \(was 3\); left: (\S+); came: -; "
        r"this node is rank ([01])$"
    )
    for n in survivors:
        assert wait_until(lambda n=n: n.matching(changed), timeout=20), n.text()
    node.stop.touch()
    for n in survivors:
        assert n.wait() == 0, n.text()
    leaver.wait()
    ranks = set()
    for n in survivors:
        (m,) = n.matching(changed)
        # Every agent runs on this host, so the node is named by its id: host:pid:suffix.
        assert f":{leaver.proc.pid}:" in m.group(2), n.text()
        ranks.add(m.group(3))
    assert ranks == {"0", "1"}


@pytest.mark.timeout(60)
def test_quiet_prints_no_progress_line(node) -> None:  # noqa: ANN001
    first = node("2", "--quiet")
    time.sleep(3.5)  # long enough for a waiting line
    second = node("2", env={"ELASTIC_QUIET": "1"})
    time.sleep(1)
    node.stop.touch()
    assert first.wait() == 0, first.text()
    assert second.wait() == 0, second.text()
    for n in (first, second):
        assert n.first(WAITING) < 0 and n.first(FORMED) < 0, n.text()


@pytest.mark.timeout(30)
def test_a_standalone_node_prints_nothing_new(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    out = subprocess.run(
        [sys.executable, "-m", "elastic", "run", "--standalone", str(script)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert "elastic:" not in out.stderr, out.stderr


def test_the_coordinator_names_only_members_it_still_waits_for() -> None:
    """A member of the last round known to have left (its ``lost`` entry, a heartbeat
    that says so or stopped) is not "missing": the line names only those waited for."""
    from elastic.core.rendezvous.round import records as R
    from elastic.core.rendezvous.round.progress_lines import Forming, RoundProgress
    from elastic.core.tcpstore import TCPStoreServer
    from elastic.core.tcpstore.view import Connection, PrefixStore

    server = TCPStoreServer("127.0.0.1", 0)
    conn = Connection("127.0.0.1", server.port, timeout=5.0)
    try:
        store = PrefixStore(conn, "job/")
        said: list[str] = []
        lines = RoundProgress(said.append, 2, 5, time.monotonic() + 600)
        lines.started -= 10  # past the first line's and the first record's delays
        lines._next_line = 0.0
        prev = R.Roster(0, members=["a", "b", "c", "d"], hosts=list("ABCD"))
        lines.coordinating(store, 1, [{"id": "a"}, {"id": "b"}], prev, {"a", "b", "c"})
        assert said and "missing C (from the last round)" in said[-1], said
        published = Forming.from_json(store.get(R.progress_key(1)))
        assert published is not None and published.missing == ("C",)
    finally:
        conn.close()
        server.close()


def test_the_round_line_names_who_left_and_came_as_the_coordinator_counted() -> None:
    """The coordinator works out the change from the last round's roster to the new one
    (names for at most ``MAX_NAMES`` nodes, complete counts); each node's line says it."""
    from elastic.core.interfaces.rendezvous import RendezvousInfo
    from elastic.core.rendezvous.round import records as R
    from elastic.core.rendezvous.round.progress_lines import membership_change, round_line

    old = R.Roster(3, members=[f"n{i}" for i in range(12)], hosts=[f"h{i}" for i in range(12)])
    new = R.Roster(4, members=["n0", "x", "y"], hosts=["h0", "hx", "h0"])
    change = membership_change(old, new)
    assert change is not None
    assert (change.left_count, change.came_count) == (11, 2)
    assert change.left == [f"h{i}" for i in range(1, 9)]  # MAX_NAMES of them
    assert change.came == ["hx", "y"]  # "y" shares h0 with n0: named by its id
    prev = RendezvousInfo(None, 1, 12, "h", 1, round=3)  # type: ignore[arg-type]
    info = RendezvousInfo(None, 2, 3, "h", 1, round=4, change=change)  # type: ignore[arg-type]
    line = round_line(prev, info)
    assert line == (
        "elastic: round 4 formed: 3 nodes (was 12); left: h1, h2, h3, h4, h5, h6, h7, h8 "
        "and 3 more; came: hx, y; this node is rank 2"
    )
    same = RendezvousInfo(None, 0, 3, "h", 1, round=5, change=membership_change(new, new))  # type: ignore[arg-type]
    assert (
        round_line(info, same)
        == "elastic: round 5 formed: 3 nodes (the same nodes); this node is rank 0"
    )
    assert membership_change(None, new) is None  # the job's first round
