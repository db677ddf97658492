"""The control file: how an agent asks its workers to checkpoint or regroup, and learns
what they did.

One file per node (kept across rounds its workers survive), mapped shared by the agent
and its workers. The header: the checkpoint request number, the regroup request number,
the generation of the last round handed over (the round file beside it), whether the
agent is stopping its workers, and the regroup request number whose round lost a member
(a collective of that round never completes: a worker waiting in one gives up at once
instead of waiting for the next round to be handed over). Then one
slot per local rank: (listening, saved, capable, joined, broken, step_us, ready, done).

- "Listening" says the script uses the checkpoint API at all
  (``elastic.checkpoint_requested()``): an agent whose workers never asked does not wait
  for a save that will not come. "Saved" is the request number it saved for.
- "Capable" says the worker can regroup in place (``elastic.train``, or a script using
  ``elastic.membership_changed()`` / ``elastic.regroup()``): on a membership change the
  agent keeps it running and hands it the new round instead of restarting it.
- "Joined" is the generation of the round the worker runs in (0: the one it started in);
  "broken" is the generation it waits for after its process group broke under it (a peer
  died mid-collective), 0 otherwise; "step_us" its last step's duration, which bounds how
  long the agent waits for it to reach a step boundary. "Ready" says a freshly started
  worker is about to join its round's group (``elastic.init_process_group``): the workers
  kept from the last round wait for that before they stop training to join it; 1 while
  it meets the round's ranks (it still takes a newer round handed over), 2 once it
  connects to them. "Done"
  says every rank agreed training is done (``elastic.train`` returns): a failure after
  that ends the job without running it again.

The agent's end is ``ControlFile``; the workers' ends are ``elastic.training.preemption``
and ``elastic.training.regroup``; the layout constants below are the one definition both
read. The round file is the agent's own data (torchrun's variables for each local rank),
written whole and renamed, so a worker never reads half of one.

An agent removes its files when it closes; one killed by SIGKILL (the OOM killer, a
test) cannot. Each agent holds an ``flock`` on its control file for its whole life, so
whoever can take that lock knows the owner is gone: every agent that ends normally
removes such leftovers from the temp folder (``sweep_leftovers``). The lock, not a pid,
says who is alive: it holds across pid namespaces that share the folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import struct
import tempfile
import time
from collections.abc import Mapping

ENV_CONTROL = "ELASTIC_CONTROL_FILE"
# The worker's slot: its local rank (LOCAL_RANK is 0 for every worker with
# --virtual-local-rank, so it cannot say which slot is whose).
ENV_CONTROL_SLOT = "ELASTIC_CONTROL_SLOT"
# The signal a listening worker defers into a checkpoint request, and for how long at most
# (``elastic.training.preemption``); set by the agent when it coordinates a save on it.
ENV_PREEMPTION_SIGNAL = "ELASTIC_PREEMPTION_SIGNAL"
ENV_PREEMPTION_GRACE = "ELASTIC_PREEMPTION_GRACE"
# (checkpoint request number, regroup request number, generation handed over, stopping,
# lost request number); 0: none. "Stopping" is set before the agent signals its workers to
# end them: a worker that defers the preemption signal (``elastic.training.preemption``)
# never defers that one. "Lost" is a regroup request made because the round lost a member.
HEADER = struct.Struct("<QQQQQ")
CHECKPOINT_FIELD, REGROUP_FIELD, GENERATION_FIELD, STOPPING_FIELD, LOST_FIELD = range(5)
# per local rank: (listening, saved request number, capable, joined, broken, step_us, ready,
# done)
SLOT = struct.Struct("<QQQQQQQQ")
LISTENING, SAVED, CAPABLE, JOINED, BROKEN, STEP_US, READY, DONE = range(8)
# "Ready" values: about to meet the round's ranks at its store (waiting there in Python, it
# can still take a newer round), then connecting to them (in gloo, where it cannot).
MEETING, CONNECTING = 1, 2
# A worker may learn of a request from its peers (the all_reduce of the flag) before its
# own agent has raised it locally: it then saves "for whatever request is pending".
SAVED_PENDING = 2**64 - 1
ROUND_SUFFIX = ".round"  # the round file: <control file>.round
STACKS_SUFFIX = ".stacks-"  # a worker's stack dumps: <control file>.stacks-<slot>
MAX_ROUND_FILE = 1 << 20  # bytes a worker reads at most
# The control file's name: ``<PREFIX><random>``, its round and stack files beside it with
# a suffix. (Earlier versions named it ``elastic-control-*`` and held no lock: theirs are
# never swept, a live one would look dead.)
PREFIX = "elastic-ctl-"
# A leftover is at least this old: a file made this instant is not locked yet.
LEFTOVER_AGE = 60.0  # s


def slot_offset(local_rank: int) -> int:
    return HEADER.size + SLOT.size * local_rank


def field_offset(field: int) -> int:
    """Byte offset of one 8-byte header field (or, added to a slot's, of a slot field)."""
    return 8 * field


def round_path(control_path: str) -> str:
    return control_path + ROUND_SUFFIX


def stack_path(control_path: str, slot: int) -> str:
    """Where a worker that can regroup dumps its Python stacks when no plugin named a file
    (``ELASTIC_STACK_FILE``): registered by the worker as it says it can
    (``elastic.training.regroup.opt_in``), read by the agent when a regroup's bound runs
    out (``core/agent/regroup.py``: stuck, or waiting in a collective?).

    The worker registers, not the agent's boot ``sitecustomize`` (which needs
    ``ELASTIC_STACK_FILE`` and the boot directory on ``PYTHONPATH``): exactly the workers a
    regroup waits for get the handler (about 0.1 ms, once), and every worker's
    environment stays torchrun's (``tests/test_agent_process.py``); a plain script, which
    takes the restart path, registers nothing. The path derives from the control file's,
    which the worker has, so no variable is added."""
    return f"{control_path}{STACKS_SUFFIX}{slot}"


def parse_round(raw: bytes, slot: int, joined: int) -> tuple[int, dict[str, str]] | None:
    """(generation, this slot's variables) from a round file's bytes, when it holds a round
    after ``joined``; None for anything else (half written, another shape). Total: any
    bytes give one of the two."""
    try:
        data = json.loads(raw[:MAX_ROUND_FILE])
        generation = data["generation"]
        env = data["ranks"][str(slot)]
    except (ValueError, KeyError, TypeError, IndexError, RecursionError):
        return None
    ok = isinstance(generation, int) and isinstance(env, dict)
    if not ok or generation <= joined:
        return None
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        return None
    return generation, env


class ControlFile:
    """The agent's end of a node's control file (created zeroed, mapped shared)."""

    def __init__(self, local_world_size: int, directory: str | None = None) -> None:
        self.size = slot_offset(local_world_size)
        self.local_world_size = local_world_size
        self.directory = directory
        fd, self.path = tempfile.mkstemp(prefix=PREFIX, dir=directory)
        # Held until close (or the process's death): the file is in use.
        self._lock_fd: int | None = fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, bytes(self.size))
            self._map: mmap.mmap | None = mmap.mmap(fd, self.size)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        self.requested = 0
        self.generation = 0
        self._stack_files: dict[int, str] = {}

    def worker_env(self, local_rank: int, stack_file: str | None = None) -> dict[str, str]:
        """The worker's variables; ``stack_file``: the dump file a plugin named for it
        (``ELASTIC_STACK_FILE``), which it then registers instead of ``stack_path``'s."""
        self._stack_files[local_rank] = stack_file or stack_path(self.path, local_rank)
        return {ENV_CONTROL: self.path, ENV_CONTROL_SLOT: str(local_rank)}

    def stack_file(self, local_rank: int) -> str:
        """The file the worker in ``local_rank`` dumps its stacks into, once registered."""
        return self._stack_files.get(local_rank) or stack_path(self.path, local_rank)

    def _set(self, field: int, value: int) -> None:
        if self._map is not None:
            struct.pack_into("<Q", self._map, field_offset(field), value)

    def request(self, number: int) -> None:
        """Ask every local worker to checkpoint (idempotent); 0 withdraws the request."""
        if self._map is not None and number != self.requested:
            self._set(CHECKPOINT_FIELD, number)
            self.requested = number

    def stopping(self) -> None:
        """Say the next signal the workers get is the agent ending them (not deferred)."""
        self._set(STOPPING_FIELD, 1)

    def request_regroup(self, *, lost: bool = False) -> None:
        """Ask every local worker to stop at its next step boundary for a new round;
        ``lost``: because the round lost a member (left, died, cut off), so a wait with
        it (a collective, a meeting) is given up at once."""
        if lost:
            self._set(LOST_FIELD, self.generation + 1)
        self._set(REGROUP_FIELD, self.generation + 1)

    def hand_over(self, envs: Mapping[int, Mapping[str, str]]) -> int:
        """Publish the next round (each local rank's variables); returns its generation."""
        generation = self.generation + 1
        path = round_path(self.path)
        payload = {"generation": generation, "ranks": {str(r): dict(e) for r, e in envs.items()}}
        tmp = f"{path}.{generation}.tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f)
        os.replace(tmp, path)
        self.generation = generation
        self._set(GENERATION_FIELD, generation)
        return generation

    def _slots(self) -> list[tuple[int, ...]]:
        if self._map is None:
            return []
        return [SLOT.unpack_from(self._map, slot_offset(r)) for r in range(self.local_world_size)]

    def listening(self) -> bool:
        """Whether any local worker asked ``checkpoint_requested()`` at least once."""
        return any(slot[LISTENING] for slot in self._slots())

    def all_saved(self, number: int) -> bool:
        slots = self._slots()
        return bool(slots) and all(slot[SAVED] in (number, SAVED_PENDING) for slot in slots)

    def all_capable(self) -> bool:
        """Every local worker said it can regroup in place."""
        slots = self._slots()
        return bool(slots) and all(slot[CAPABLE] for slot in slots)

    def all_ready(self) -> bool:
        """Every local worker is about to join its round's group."""
        slots = self._slots()
        return bool(slots) and all(slot[READY] for slot in slots)

    def none_connecting(self) -> bool:
        """No local worker has begun connecting to its round's group (``CONNECTING``) or
        said it can regroup: each is still starting (importing, building its model) or
        waiting to meet its round's ranks, and takes a newer round handed over."""
        slots = self._slots()
        return bool(slots) and not any(slot[READY] >= CONNECTING or slot[CAPABLE] for slot in slots)

    def joined(self, generation: int) -> set[int]:
        """The local ranks that took round ``generation`` (or a later one)."""
        return {r for r, slot in enumerate(self._slots()) if slot[JOINED] >= generation}

    def broken(self) -> bool:
        """A local worker's process group broke and it waits for a new round."""
        return any(slot[BROKEN] > self.generation for slot in self._slots())

    def done(self) -> set[int]:
        """The local ranks whose ranks all agreed that training is done (``elastic.train``
        returned): a failure of theirs after that is no reason to run the job again."""
        return {r for r, slot in enumerate(self._slots()) if slot[DONE]}

    def longest_step(self) -> float:
        """The longest last step of any local worker, in seconds."""
        return max((slot[STEP_US] for slot in self._slots()), default=0) / 1e6

    def close(self) -> None:
        """Remove this node's files (the agent sweeps others' as it ends: not here, which
        every restart passes through)."""
        if self._map is not None:
            self._map.close()
            self._map = None
        stacks = [stack_path(self.path, r) for r in range(self.local_world_size)]
        for path in (self.path, round_path(self.path), *stacks):
            with contextlib.suppress(OSError):
                os.unlink(path)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def sweep_leftovers(directory: str | None = None) -> list[str]:
    """Remove the control files (and their round and stack files) whose agents are gone:
    at least ``LEFTOVER_AGE`` old and not locked. Returns the control files removed.
    Never raises: a file another user owns, or one that vanished meanwhile, is skipped."""
    folder = directory or tempfile.gettempdir()
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    beside: dict[str, list[str]] = {}  # a control file's name -> its files' names
    for n in names:
        if n.startswith(PREFIX):
            beside.setdefault(n.partition(".")[0], []).append(n)
    removed = []
    for name, files in beside.items():
        if name not in files:
            continue  # its round or stack files alone: not ours to judge
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if time.time() - os.fstat(fd).st_mtime < LEFTOVER_AGE:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # locked: its agent is alive
            # Ours now (the lock held while removing): the agent is gone.
            for other in sorted(files, key=lambda n: n == name):  # the control file last
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, other))
            removed.append(path)
        finally:
            os.close(fd)
    return removed
