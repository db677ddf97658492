"""The same operations from real ``torch.distributed.TCPStore`` clients against torch's own
server and against ours: what the clients see must be the same, request type by request
type (every one torch's client sends), errors and timeouts included.

Used by ``tests/test_tcpstore_torch_diff.py`` (the torch the suite runs with) and, as a
script, by ``bench/torch_versions.py`` in a venv per torch version:
``python tests/tcpstore_differential.py`` prints the differences and exits 1 if any.

Each server runs in a process of its own: torch's client holds the GIL through
``list_keys``, which would starve a server thread of the same process (the agent that
serves a job's store is never a worker's process either).
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

HOST = "127.0.0.1"
TIMEOUT = 1.0  # what a call meant to time out waits
PATIENT = 20.0  # what a call meant to be answered may wait (only a bug waits that long)
SETTLE = 0.4  # time for a call to park, or for a second waiter to be (wrongly) woken

SERVE = {
    "torch": (
        "import sys; from datetime import timedelta; import torch.distributed as d\n"
        "s = d.TCPStore(%r, 0, None, True, timedelta(seconds=30), wait_for_workers=False)\n"
        "print(s.port, flush=True); sys.stdin.read()\n"
    ),
    "ours": (
        "import sys; from elastic.core.tcpstore import TCPStoreServer\n"
        "s = TCPStoreServer(%r, 0)\nprint(s.port, flush=True); sys.stdin.read(); s.close()\n"
    ),
}


@contextmanager
def served(kind: str) -> Iterator[int]:
    """The port of a server of ``kind`` (``torch``: its default, libuv; ``ours``)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE[kind] % HOST],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"the {kind} server did not start: {line!r}")
        yield int(line)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def outcome(call: Callable[[], Any]) -> Any:
    """What a call gave, comparable across servers: its result, or the kind of error
    (a timeout told apart from other store errors; no text, which names ports)."""
    try:
        result = call()
    except Exception as exc:
        name = type(exc).__name__
        if name == "DistStoreError" and "timeout" in str(exc):
            return ("raised", "timeout")
        return ("raised", name)
    return result


def scenario(port: int) -> list[tuple[str, Any]]:
    """Every request type, through torch's client; the outcome of each step in order."""
    from torch.distributed import TCPStore

    clients: list[Any] = []

    def client(timeout: float = TIMEOUT) -> Any:
        store = TCPStore(HOST, port, None, False, timedelta(seconds=timeout))
        clients.append(store)
        return store

    a, b, c = client(), client(), client()
    seen: list[tuple[str, Any]] = []

    def step(name: str, call: Callable[[], Any]) -> None:
        seen.append((name, outcome(call)))

    def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
        box: list[Any] = []
        thread = threading.Thread(target=lambda: box.append(outcome(call)), daemon=True)
        thread.start()
        return thread, box

    def settled(*boxes: list[Any]) -> list[list[Any]]:
        """The boxes, once one holds an answer and SETTLE passed for a wrong second."""
        deadline = time.monotonic() + PATIENT
        while not any(boxes) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(SETTLE)
        return [list(box) for box in boxes]

    def joined(*threads: threading.Thread) -> bool:
        for thread in threads:
            thread.join(PATIENT + TIMEOUT)
        return True

    # keys: SET, GET, APPEND, MULTI_SET/GET, ADD, COMPARE_SET, CHECK, DELETE_KEY, counts
    step("set", lambda: a.set("k", "v"))
    step("append to a key", lambda: a.append("k", "+w"))
    step("append makes a key", lambda: a.append("fresh", "x"))
    step("get", lambda: (b.get("k"), b.get("fresh")))
    step("multi_set", lambda: a.multi_set(["m1", "m2"], ["1", ""]))
    step("multi_get", lambda: b.multi_get(["m1", "m2", "k"]))
    step("multi_get of a missing key", lambda: b.multi_get(["m1", "nope"]))
    step("in step after the timeout", lambda: b.get("m1"))
    step("add", lambda: (a.add("n", 5), b.add("n", -7)))
    step("add wraps at 64 bits", lambda: (a.add("big", 2**63 - 1), a.add("big", 1)))
    step("add reads a number as strtoll", lambda: (a.set("s", " 12xy"), a.add("s", 1)))
    step("add to text drops", lambda: (c.set("t", "text"), client().add("t", 1)))
    step("compare_set", lambda: [a.compare_set("cs", "", "1"), a.compare_set("cs", "x", "2")])
    step("compare_set matching", lambda: a.compare_set("cs", "1", "2"))
    step("compare_set absent", lambda: a.compare_set("absent", "e", "d"))
    step("check", lambda: (a.check(["k", "n"]), a.check(["k", "nope"])))
    step("delete_key", lambda: (a.delete_key("fresh"), a.delete_key("fresh")))
    step("num_keys", lambda: a.num_keys())
    step("list_keys", lambda: sorted(a.list_keys()))

    # queues: a namespace of their own, seen by CHECK and WAIT
    step("queue_push", lambda: (a.queue_push("q", "v1"), a.queue_push("q", "v2")))
    step("queue_len", lambda: b.queue_len("q"))
    step("a queue is no key", lambda: (b.num_keys(), sorted(b.list_keys()), b.delete_key("q")))
    step("check sees a queue", lambda: b.check(["q"]))
    step("get of a queue's name", lambda: b.get("q"))
    step("queue_pop", lambda: b.queue_pop("q"))
    step("queue_pop without blocking", lambda: b.queue_pop("q", False))
    step("queue_pop of an empty queue", lambda: b.queue_pop("q", False))
    step("queue_len of an empty queue", lambda: b.queue_len("q"))
    step("queue_pop blocks, then times out", lambda: b.queue_pop("q"))
    step("in step after the pop timed out", lambda: b.get("k"))
    step("empty values", lambda: (a.queue_push("e", ""), a.queue_len("e"), a.queue_pop("e")))
    step("a key and a queue of one name", lambda: (a.queue_push("k", "Q"), a.get("k")))

    # One push wakes one blocked pop, the first to block; the next push the other. The
    # parked calls run on clients that wait long (PATIENT), so only what the server
    # answers ends them.
    d, e = client(PATIENT), client(PATIENT)
    first, got_first = in_thread(lambda: d.queue_pop("w"))
    time.sleep(SETTLE)
    second, got_second = in_thread(lambda: e.queue_pop("w"))
    time.sleep(SETTLE)
    step("push one", lambda: a.queue_push("w", "one"))
    step("one push, two blocked pops", lambda: settled(got_first, got_second))
    step("push two", lambda: a.queue_push("w", "two"))
    step("two pushes", lambda: joined(first, second) and (got_first, got_second))

    # ... and one WAIT of two parked on a queue's name
    first, woke_first = in_thread(lambda: d.wait(["w2"]))
    time.sleep(SETTLE)
    second, woke_second = in_thread(lambda: e.wait(["w2"]))
    time.sleep(SETTLE)
    step("push to a name waited for", lambda: a.queue_push("w2", "x"))
    step("one push, two waits", lambda: settled(woke_first, woke_second))
    step("push again", lambda: a.queue_push("w2", "y"))
    step("two pushes, two waits", lambda: joined(first, second) and (woke_first, woke_second))

    # APPEND wakes every wait
    first, woke_first = in_thread(lambda: d.wait(["ap"]))
    second, woke_second = in_thread(lambda: e.wait(["ap"]))
    time.sleep(SETTLE)
    step("append to a key waited for", lambda: a.append("ap", "x"))
    step("append, two waits", lambda: joined(first, second) and (woke_first, woke_second))

    # BARRIER: a count on the key, which parks the caller below its world size
    step("barrier of one", lambda: a.barrier("b1", 1))
    first, passed = in_thread(lambda: d.barrier("b2", 2))
    time.sleep(SETTLE)
    step("barrier of two, one in", lambda: list(passed))
    step("barrier of two, both in", lambda: (c.barrier("b2", 2), joined(first), passed))
    step("barrier count", lambda: a.get("b2"))
    step("barrier alone times out", lambda: a.barrier("b3", 2))
    step("in step after the barrier timed out", lambda: a.get("b3"))
    step("barrier counts the timed-out one", lambda: b.barrier("b3", 2))
    step("barrier past its count", lambda: (c.barrier("b3", 2), a.get("b3")))
    waiting, woke = in_thread(lambda: b.wait(["b4"]))  # times out unless woken
    time.sleep(SETTLE)
    step("barrier below its count", lambda: a.barrier("b4", 3))
    step("... wakes no wait", lambda: joined(waiting) and woke)
    first, passed = in_thread(lambda: d.barrier("b5", 3))
    time.sleep(SETTLE)
    step("add releases a parked barrier", lambda: (a.add("b5", 1), joined(first), passed))
    first, passed = in_thread(lambda: d.barrier("b6", 3))
    time.sleep(SETTLE)
    step("a barrier that completes releases others", lambda: (c.barrier("b6", 2), joined(first)))
    step("... whatever their count", lambda: passed)
    step("barrier on text drops", lambda: client().barrier("t", 1))
    step("the others stay", lambda: (a.get("t"), b.get("k"), c.num_keys()))
    step("list_keys at the end", lambda: sorted(c.list_keys()))
    del clients[:]
    return seen


def differences(port_torch: int, port_ours: int) -> tuple[list[tuple[str, Any]], list[str]]:
    """The scenario's outcomes on torch's server, and each step whose outcome on ours
    differs (one line each)."""
    import torch.distributed  # noqa: F401 -- once, not by two threads at a time

    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # half the waiting
        theirs_run, ours_run = pool.submit(scenario, port_torch), pool.submit(scenario, port_ours)
        theirs, ours = theirs_run.result(), ours_run.result()
    lines = [
        f"{name}: torch's server {want!r}, ours {got!r}"
        for (name, want), (_, got) in zip(theirs, ours, strict=True)
        if want != got
    ]
    return theirs, lines


def main() -> int:
    import torch

    with served("torch") as port_torch, served("ours") as port_ours:
        theirs, lines = differences(port_torch, port_ours)
    for line in lines:
        print(line)
    print(f"torch {torch.__version__}: {len(theirs)} steps, {len(lines)} difference(s)")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
