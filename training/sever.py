"""Freeing a kept worker from the script's own collective with a peer that is gone.

``bounded`` bounds the waits ``elastic.train`` makes itself (the step agreement, the
sync, a new group's creation). The script's own collectives (its step's ``all_reduce``,
DDP's buckets) wait in C++ for as long as the group's timeout: with a peer gone without
closing its connections (its host's cable cut, its machine gone) that is minutes, past the
agent's bound for taking the next round, and the agent restarts the worker, losing the
state it kept in place. No Python code runs in the main thread meanwhile.

So a regrouping worker notes which sockets its group opened (``note``: the ones that
appeared in ``/proc/self/fd`` while the group was made: gloo's pairs, the group's store)
and runs a thread (``start``) that, once the agent has handed over a round newer than the
one the worker runs in and ``bounded.GIVE_UP_AFTER`` s plus its last step have passed, or
at once when the agent says the round lost a member (``bounded.Watch``, the same rule as
the bounded waits), shuts those sockets down. The
collective then fails at once as when a peer closes its connection ("Connection closed by
peer"), and the worker rolls the step back and regroups in place (``elastic.train``; a
low-level script sees the same error as after any peer's death). Only that group's
sockets are touched, only its connections (a listener shut down makes gloo abort the
process), and only while the worker is still in it; ``shutdown`` needs no privilege.
Linux only (``/proc``); elsewhere nothing is noted and nothing is cut.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time

from elastic.core.workers.control_file import GENERATION_FIELD, JOINED, LOST_FIELD
from elastic.training import control
from elastic.training.bounded import Watch

POLL = 0.1  # s between the thread's looks at the control file
_FDS = "/proc/self/fd"
Sockets = frozenset[tuple[int, str]]  # (fd, "socket:[inode]")
# The group the worker is in: (the round it joined, the sockets made with the group).
_noted: list[tuple[int, Sockets]] = []
_started: list[threading.Thread] = []


def sockets() -> Sockets:
    """This process's open sockets now (none where ``/proc`` is missing)."""
    found = set()
    with contextlib.suppress(OSError):
        for name in os.listdir(_FDS):
            with contextlib.suppress(OSError, ValueError):
                target = os.readlink(os.path.join(_FDS, name))
                if target.startswith("socket:"):
                    found.add((int(name), target))
    return frozenset(found)


def note(before: Sockets) -> None:
    """The group just made holds the sockets opened since ``before``."""
    if control.available():
        _noted[:] = [(control.mine(JOINED), sockets() - before)]


def start() -> None:
    """Run the watching thread (once per process)."""
    if not _started and control.available():
        thread = threading.Thread(target=_watch, name="elastic-sever", daemon=True)
        _started.append(thread)
        thread.start()


def _watch() -> None:
    watch = Watch()
    cut_for = -1  # the newer round (handed over or lost) this thread last cut the group for
    while True:
        time.sleep(POLL)
        newest = max(control.header(GENERATION_FIELD), control.header(LOST_FIELD))
        if newest == cut_for or not watch.moved():
            continue
        noted = _noted[0] if _noted else None
        if noted is not None and noted[0] == control.mine(JOINED):  # still in that group
            # Said, so that the collective's "Connection closed by peer" that follows is
            # not read as a peer's crash.
            print(
                f"elastic: the job re-formed while this rank waited (a peer is gone): cut "
                f"{cut(noted[1])} connection(s) of its old group",
                file=sys.stderr,
                flush=True,
            )
        cut_for = newest


def cut(group: Sockets) -> int:
    """Shut down every socket of ``group`` still open under its fd; how many."""
    done = 0
    for fd, target in group:
        try:
            if os.readlink(os.path.join(_FDS, str(fd))) != target:
                continue  # closed since, and the number reused
            # A duplicate of the fd: shutting it down shuts the socket down for every fd
            # of it; closing the duplicate leaves the group's own fd to the group.
            with socket.socket(fileno=os.dup(fd)) as sock:
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue  # a listener (gloo's, the store's): gloo aborts on its error
                sock.getpeername()  # connected (OSError otherwise: nothing to cut)
                sock.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            continue
    return done
