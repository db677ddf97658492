"""The rounds a worker's agent hands over (the round file beside the control file): wait
for one newer than the worker's, read it, and take one that came while the worker was
still starting.

A round is handed over when the job re-forms: to kept workers at a step boundary
(``regroup``), and to workers that have not created their process group yet (still
importing torch, building the model): their agent asks for a regroup when the job
re-forms and hands them the new round instead of restarting them, and
``elastic.init_process_group`` takes it here before it creates the group.
"""

from __future__ import annotations

import os
import time

from elastic.core.workers.control_file import (
    GENERATION_FIELD,
    JOINED,
    MAX_ROUND_FILE,
    REGROUP_FIELD,
    parse_round,
    round_path,
)
from elastic.training import control
from elastic.training.heartbeat import WaitBeat

# s a worker waits for its agent's next round: longer than the agent's own bound (its
# rendezvous, join_timeout: 600 s by default); the agent stops the worker before that.
ROUND_WAIT = 900.0
_POLL = 0.005


def wait_for_round(joined: int) -> tuple[int, dict[str, str]]:
    """(generation, this worker's variables) of the first round after ``joined`` that
    the agent hands over; an error after ``ROUND_WAIT`` s."""
    deadline = time.monotonic() + ROUND_WAIT
    beat = WaitBeat()
    while time.monotonic() < deadline:
        if control.header(GENERATION_FIELD) > joined:
            found = read_round(joined)
            if found is not None:
                return found
        beat()
        time.sleep(_POLL)
    raise RuntimeError(f"no new round from the agent within {ROUND_WAIT:g}s")


def read_round(joined: int) -> tuple[int, dict[str, str]] | None:
    """This worker's variables in the round file, when it holds a round after ``joined``."""
    try:
        with open(round_path(control.path()), "rb") as f:
            raw = f.read(MAX_ROUND_FILE + 1)
        return parse_round(raw, control.slot_index(), joined)
    except (OSError, ValueError):  # ValueError: the slot variable is no number
        return None


def pending() -> bool:
    """Whether the agent asked for a regroup or handed over a round since this worker
    took its last one: the round in ``os.environ`` is gone or going."""
    joined = control.mine(JOINED)
    return max(control.header(REGROUP_FIELD), control.header(GENERATION_FIELD)) > joined


def take_pending() -> bool:
    """For a worker about to create its process group: when the job re-formed since it
    took its round (it was still starting), wait for the agent's new round and take its
    variables into ``os.environ``. Whether it took one."""
    if not control.available() or not pending():
        return False
    generation, env = wait_for_round(control.mine(JOINED))
    os.environ.update(env)
    control.set_mine(JOINED, generation)  # the agent's acknowledgement: we are joining it
    return True
