"""``elastic run`` under ``srun``: one job across the step's nodes, from SLURM's environment.

``srun -N4 --ntasks-per-node=1 elastic run --nproc-per-node=8 train.py`` starts one agent
per node with nothing but SLURM's task variables. Read here, they fill the rendezvous
options the user did not give (on the command line or as ``PET_*``: those always win):

- ``--nnodes``: the step's node count (``SLURM_STEP_NUM_NODES``, ``SLURM_NNODES``,
  ``SLURM_JOB_NUM_NODES``, the first set);
- ``--node-rank``: ``SLURM_NODEID`` (a rank hint for c10d, so ranks follow SLURM's order);
- ``--rdzv-backend``: ``c10d``, whose store the agent on the step's first host serves
  (why not ``static``: README, "Under SLURM");
- ``--rdzv-endpoint``: the first host of ``SLURM_STEP_NODELIST`` (else
  ``SLURM_JOB_NODELIST``), expanded here in pure Python (no ``scontrol``), and a port
  derived from the job id as PyTorch Lightning does, unless ``--master-port`` gives one;
  with an explicit ``--rdzv-backend=static``, ``--master-addr``/``--master-port`` instead;
- ``--rdzv-id``: ``<SLURM_JOB_ID>.<SLURM_STEP_ID>``, and ``.r<SLURM_RESTART_COUNT>`` once
  the job was requeued: each step and each run of a requeued job is a job of its own, so
  a requeued job starts with a fresh restart budget and a backend that keeps state
  (etcd) never meets the id of a run that ended (the checkpoint, a path of the user's,
  is what carries the work over).

Only an ``srun`` step counts: an ``salloc`` shell or a batch script has ``SLURM_JOB_ID``
but no step's task variables (``SLURM_STEP_ID`` and ``SLURM_PROCID``), and one agent there
would wait for nodes that never come: ``--nnodes`` of more than one there, with no
``--rdzv-endpoint`` saying where the other agents come from, is refused with the srun line
to use instead (``outside_step``). So is the shell of an interactive step (``srun --pty``,
a terminal on the step's first node only) of several nodes. A one-node job asked for
explicitly (``--standalone``, ``--nnodes=1``) ignores SLURM. One agent per node is the
model (it starts the workers itself), so several tasks per node are refused.
"""

from __future__ import annotations

import itertools
import math
import re
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import click
from click.core import ParameterSource

# The options SLURM may fill, by click dest, in the order they are reported.
FILLED = (
    "nnodes",
    "node_rank",
    "rdzv_backend",
    "rdzv_endpoint",
    "master_addr",
    "master_port",
    "rdzv_id",
)


class SlurmError(ValueError):
    """SLURM's environment cannot make one job: the message is one line for the user."""


@dataclass(frozen=True)
class SlurmStep:
    """What an ``srun`` step tells one of its tasks, and where each value was read."""

    job_id: str
    step_id: str
    nnodes: int
    node_id: int
    first_host: str
    ntasks: int | None
    ntasks_per_node: int | None
    nnodes_var: str
    nodelist_var: str
    restart_count: int = 0
    interactive: bool = False  # the shell of ``srun --pty``: one task, on the first node

    @property
    def port(self) -> int:
        return port_for_job(self.job_id)

    @property
    def run_id(self) -> str:
        """``<job>.<step>`` as SLURM names a step, ``.r<n>`` added on the job's n-th requeue."""
        requeued = f".r{self.restart_count}" if self.restart_count else ""
        return f"{self.job_id}.{self.step_id}{requeued}"

    @property
    def run_id_source(self) -> str:
        restarts = " and SLURM_RESTART_COUNT" if self.restart_count else ""
        return f"SLURM_JOB_ID, SLURM_STEP_ID{restarts}"

    def tasks_per_node(self) -> int:
        """More than 1 when the step runs several tasks on a node."""
        by_total = -(-self.ntasks // self.nnodes) if self.ntasks else 1
        return max(self.ntasks_per_node or 1, by_total)


def port_for_job(job_id: str) -> int:
    """The rendezvous port of a SLURM job, the same on every node without talking.

    PyTorch Lightning's ``SLURMEnvironment.main_port`` takes the job id's last four digits
    plus 15000 (15000-24999: below Linux's ephemeral range, so no outgoing connection
    holds it). We do the same, so the rule is one people already know; two jobs whose ids
    end alike and share a first node need ``--master-port``.
    """
    return 15000 + int(job_id[-4:])


HOSTLIST_ITEM = re.compile(r"[^,\[\]]*(?:\[[^\[\]]*\][^,\[\]]*)*")
RANGE = re.compile(r"([0-9]{1,18})(?:-([0-9]{1,18}))?")  # ASCII digits, as SLURM writes
# More hosts than a SLURM cluster has (its node names fit in a 16-bit count): a hostlist
# beyond this is not one SLURM wrote, and expanding it would take the memory of the node.
MAX_HOSTS = 65536


def expand_hostlist(hostlist: str) -> list[str]:
    """Every host of a SLURM hostlist, in SLURM's order.

    ``gpu[01-04,07],cpu3`` -> gpu01 gpu02 gpu03 gpu04 gpu07 cpu3: items are separated by
    commas outside brackets; a bracket holds numbers and ranges, zero-padded to the width
    of a range's first number (``[08-10]`` -> 08 09 10); text may follow a bracket
    (``node[1-3]-ib``) and several brackets make every combination, the first outermost
    (``a[01-02]b[1-2]`` -> a01b1 a01b2 a02b1 a02b2), as ``scontrol show hostnames`` does.
    Raises ``SlurmError`` naming what is wrong.
    """
    text = hostlist.strip()
    hosts: list[str] = []
    pos = 0
    while pos <= len(text):
        match = HOSTLIST_ITEM.match(text, pos)
        item = match.group() if match else ""
        end = pos + len(item)
        if not item or (end < len(text) and text[end] != ","):
            raise SlurmError(
                f"{hostlist!r} is not a SLURM hostlist (at {text[pos:] or 'its end'!r}); "
                "expected names like gpu[01-04,07],cpu3"
            )
        hosts.extend(expand_item(item, hostlist, MAX_HOSTS - len(hosts)))
        pos = end + 1
    return hosts


def expand_item(item: str, hostlist: str, room: int = MAX_HOSTS) -> list[str]:
    """One hostlist item (no top-level comma): its text parts and bracket choices; at most
    ``room`` hosts (``SlurmError`` beyond)."""
    parts = re.split(r"\[([^\]]*)\]", item)  # text, bracket, text, bracket, ..., text
    choices = [
        [part] if i % 2 == 0 else bracket_numbers(part, hostlist) for i, part in enumerate(parts)
    ]
    if math.prod(len(c) for c in choices) > room:
        raise SlurmError(f"{hostlist[:80]!r} names more than {MAX_HOSTS} hosts")
    return ["".join(combo) for combo in itertools.product(*choices)]


def bracket_numbers(inside: str, hostlist: str) -> list[str]:
    numbers: list[str] = []
    for piece in inside.split(","):
        match = RANGE.fullmatch(piece.strip())
        if not match:
            raise SlurmError(
                f"{hostlist!r}: [{inside}] is not a list of numbers and ranges; "
                "expected e.g. [01-04,07]"
            )
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise SlurmError(f"{hostlist!r}: range {piece} runs backwards; expected LOW-HIGH")
        if int(high) - int(low) + len(numbers) >= MAX_HOSTS:
            raise SlurmError(f"{hostlist[:80]!r} names more than {MAX_HOSTS} hosts")
        numbers += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return numbers


def first_set(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of ``names`` set (non-empty) in ``env``, and its value."""
    return next(((n, env[n]) for n in names if env.get(n, "").strip()), None)


def number(env: Mapping[str, str], *names: str) -> tuple[str, int] | None:
    found = first_set(env, *names)
    if found is None:
        return None
    name, value = found
    try:
        return name, int(value)
    except ValueError:
        raise SlurmError(f"{name}={value!r} is not a number; is this a SLURM task?") from None


def detect(env: Mapping[str, str], stdin_tty: bool = False) -> SlurmStep | None:
    """The ``srun`` step this process is a task of, or None outside one.

    ``SLURM_JOB_ID`` plus a step's task variables (``SLURM_STEP_ID`` and ``SLURM_PROCID``):
    an ``salloc`` shell or a batch script lacks a step id, so it is not a step. An
    interactive step's shell has ``SLURM_PTY_PORT`` and a terminal on stdin (the steps
    started from it inherit the variable, not the terminal)."""
    job = first_set(env, "SLURM_JOB_ID", "SLURM_JOBID")
    step = first_set(env, "SLURM_STEP_ID", "SLURM_STEPID")
    if job is None or step is None or first_set(env, "SLURM_PROCID") is None:
        return None
    job_id = job[1].strip()
    if not (job_id.isascii() and job_id.isdigit()):
        raise SlurmError(f"{job[0]}={job_id!r} is not a SLURM job id; expected a number")
    nnodes = number(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    node_id = number(env, "SLURM_NODEID")
    nodelist = first_set(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    missing = [
        what
        for what, value in (
            ("SLURM_NNODES", nnodes),
            ("SLURM_NODEID", node_id),
            ("SLURM_STEP_NODELIST", nodelist),
        )
        if value is None
    ]
    if nnodes is None or node_id is None or nodelist is None:
        raise SlurmError(
            f"an srun step without {', '.join(missing)}; give --nnodes, --node-rank and the "
            "rendezvous flags yourself"
        )
    if not 0 <= node_id[1] < nnodes[1] or nnodes[1] < 1:
        raise SlurmError(
            f"SLURM_NODEID={node_id[1]} is not a node of {nnodes[0]}={nnodes[1]}; "
            "expected 0 to the node count - 1"
        )
    tasks = number(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    per_node = number(env, "SLURM_NTASKS_PER_NODE")
    restarts = number(env, "SLURM_RESTART_COUNT")
    return SlurmStep(
        job_id=job_id,
        step_id=step[1].strip(),
        nnodes=nnodes[1],
        node_id=node_id[1],
        first_host=expand_hostlist(nodelist[1])[0],
        ntasks=tasks[1] if tasks else None,
        ntasks_per_node=per_node[1] if per_node else None,
        nnodes_var=nnodes[0],
        nodelist_var=nodelist[0],
        restart_count=restarts[1] if restarts else 0,
        interactive=stdin_tty and first_set(env, "SLURM_PTY_PORT") is not None,
    )


def min_nodes(nnodes: object) -> int:
    """The least node count of ``--nnodes`` (``N`` or ``MIN:MAX``); 1 if not a number (the
    option's own check says what is wrong with it)."""
    try:
        return int(str(nnodes).split(":")[0])
    except ValueError:
        return 1


def outside_step(env: Mapping[str, str], opts: Mapping[str, Any], given: Collection[str]) -> None:
    """Refuse a job of several nodes started in a SLURM job but not by ``srun`` (a batch
    script, an ``salloc`` shell): this one agent would wait forever for the others, as no
    ``--rdzv-endpoint`` says they are started some other way. Raises ``SlurmError``."""
    job = first_set(env, "SLURM_JOB_ID", "SLURM_JOBID")
    wanted = min_nodes(opts.get("nnodes"))
    if job is None or wanted <= 1 or {"rdzv_endpoint", "master_addr", "standalone"} & set(given):
        return
    raise SlurmError(
        f"elastic run --nnodes={opts['nnodes']} in SLURM job {job[1]} but not in an srun step "
        f"(a batch script or salloc shell) is one agent on one node and would wait forever "
        f"for {wanted - 1} more; start one agent per node instead: srun -N{wanted} "
        "--ntasks-per-node=1 elastic run ... (SLURM fills --nnodes and the rendezvous)"
    )


@dataclass(frozen=True)
class Taken:
    """A value SLURM gave an option, and where it came from (for ``--dry-run`` and the
    first progress line)."""

    value: Any
    source: str


def slurm_values(
    step: SlurmStep, opts: Mapping[str, Any], given: Collection[str]
) -> dict[str, Taken]:
    """The option values SLURM fills: each of ``FILLED`` not in ``given`` (the dests set
    on the command line or by ``PET_*``), by dest. Empty when the user asked for one node.
    Raises ``SlurmError`` when values would be taken from a step of several tasks a node.
    """
    if "standalone" in given and opts.get("standalone"):
        return {}
    if "nnodes" in given and str(opts["nnodes"]).split(":")[-1].strip() == "1":
        return {}
    backend = opts["rdzv_backend"] if "rdzv_backend" in given else "c10d"
    port = opts["master_port"] if "master_port" in given else step.port
    port_source = "port from --master-port" if "master_port" in given else "port from SLURM_JOB_ID"
    where = f"{step.first_host}:{port}"
    offer: dict[str, Taken] = {
        "nnodes": Taken(str(step.nnodes), step.nnodes_var),
        "node_rank": Taken(step.node_id, "SLURM_NODEID"),
        "rdzv_backend": Taken("c10d", "SLURM: its first host serves the store"),
        "rdzv_id": Taken(step.run_id, step.run_id_source),
    }
    if backend == "c10d":
        offer["rdzv_endpoint"] = Taken(where, f"{step.nodelist_var}'s first host, {port_source}")
    elif backend == "static" and "rdzv_endpoint" not in given:
        offer["master_addr"] = Taken(step.first_host, f"{step.nodelist_var}'s first host")
        offer["master_port"] = Taken(port, "port from SLURM_JOB_ID")
    taken = {dest: offer[dest] for dest in FILLED if dest in offer and dest not in given}
    if taken and step.interactive and step.nnodes > 1:
        raise SlurmError(
            f"this is the shell of an interactive step (srun --pty) of {step.nnodes} nodes, "
            f"one process on its first node: an agent here would wait forever for the other "
            f"{step.nnodes - 1}; from this shell run srun --overlap --ntasks-per-node=1 "
            "elastic run ..., or give --standalone to use this node alone"
        )
    if taken and step.tasks_per_node() > 1:
        raise SlurmError(
            f"srun runs {step.tasks_per_node()} tasks per node, but elastic run is one agent "
            "per node that starts --nproc-per-node workers itself; use srun --ntasks-per-node=1"
        )
    return taken


def took_line(step: SlurmStep, taken: Mapping[str, Taken]) -> str:
    """The agent's first progress line under SLURM: what it took, as the flags to give."""
    flags = " ".join(f"--{dest.replace('_', '-')}={t.value}" for dest, t in taken.items())
    return f"elastic: from SLURM job {step.job_id} step {step.step_id}: {flags}"


def fill_from_slurm(
    ctx: click.Context, opts: dict[str, Any], env: Mapping[str, str], stdin_tty: bool | None = None
) -> tuple[SlurmStep, dict[str, Taken]] | None:
    """Fill ``opts`` (click's values by dest) from the ``srun`` step in ``env``; the step
    and what was taken, or None when nothing was. A value set on the command line or by
    ``PET_*`` is never replaced (click's parameter source tells those from defaults).
    Bad SLURM input, or a launch SLURM cannot complete, is click's usage error: one line,
    exit 2. ``stdin_tty``: whether stdin is a terminal (default: ask sys.stdin)."""
    explicit = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    given = {dest for dest in opts if ctx.get_parameter_source(dest) in explicit}
    if stdin_tty is None:
        stdin_tty = sys.stdin is not None and sys.stdin.isatty()
    try:
        step = detect(env, stdin_tty)
        if step is None:
            outside_step(env, opts, given)
        taken = slurm_values(step, opts, given) if step is not None else {}
    except SlurmError as exc:
        raise click.UsageError(str(exc)) from None
    if step is None or not taken:
        return None
    opts.update({dest: t.value for dest, t in taken.items()})
    return step, taken
