"""``ExitWait``: a wait between worker polls that ends when a watched process exits, so
the agent sees an exit at once instead of at its next poll."""

from __future__ import annotations

import subprocess
import sys
import time

from elastic.core.workers.exits import ExitWait
from elastic.core.workers.process import peek_exit
from elastic.testing.waits import wait_until

LONG = 30.0  # a wait that only an exit can end early


def child(seconds: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_an_exit_ends_the_wait() -> None:
    quick, slow = child(0.2), child(LONG)
    try:
        with ExitWait([quick.pid, slow.pid]) as exits:
            started = time.monotonic()
            exits.wait(LONG)
            took = time.monotonic() - started
        assert quick.poll() is not None, "the wait ended before any process exited"
        assert took < LONG / 2, f"the wait ran {took:.1f}s: the exit did not end it"
        assert slow.poll() is None
    finally:
        for p in (quick, slow):
            p.kill()
            p.wait()


def test_an_exit_seen_once_no_longer_ends_waits() -> None:
    done, slow = child(0), child(LONG)
    try:
        assert wait_until(lambda: peek_exit(done.pid) is not None, 10)  # a zombie, unreaped
        with ExitWait([done.pid, slow.pid]) as exits:
            exits.wait(LONG)  # at once: ``done`` has exited
            started = time.monotonic()
            exits.wait(0.3)  # only ``slow`` is watched now: the full timeout
            assert time.monotonic() - started >= 0.25
    finally:
        for p in (done, slow):
            p.kill()
            p.wait()


def test_without_a_pid_to_watch_it_sleeps_the_timeout() -> None:
    with ExitWait([]) as exits:
        started = time.monotonic()
        exits.wait(0.2)
        assert time.monotonic() - started >= 0.19
