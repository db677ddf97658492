"""The randomized fault campaign's schedule and checker (``bench/campaign.py`` runs them).

``plan(seed, ...)`` draws a fault schedule from a seed: what happens when, to which host,
following a model of the job's hosts (``up``: its agent runs and its cable is in, ``cut``:
its agent runs cut off, ``down``: no agent) so that a fault never takes the job below its
minimum of nodes and a replacement is started only where no agent runs.

``check(events, ...)`` reads what the workers logged (one JSON line per event, see the
worker in ``campaign.py``) and names every violation:

- two worlds trained at the same time (every ``sync`` makes a world with an id that all
  its ranks share; the step intervals of two worlds may not overlap);
- the final state differs from an undisturbed run's (the reference value of that many
  steps), or ranks finished with different states;
- more steps redone than faults injected (a step is redone when a later world computes it
  again, or lost when the job had reached it and finished without it);
- an agent that was still a member at the end exited with a code that is not the job's
  outcome (0 when the job finished, non-zero when it failed: a failed job is a violation
  of its own, "no worker finished the job");
- a process was left behind on a host once every agent had exited.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# How far the step intervals of two worlds may overlap before it counts as two trainings:
# a leaving rank may log its last step a scheduler tick after the others moved on.
OVERLAP_TOLERANCE = 0.25

KINDS = ("sigterm", "sigkill", "cut", "replace", "store")


@dataclass(frozen=True)
class Fault:
    """One planned event: ``at`` s after the campaign starts. ``kind`` is a fault, a
    ``replace`` (the job's command started again on ``host``) or a ``heal`` (its cable
    plugged back). For a ``store`` fault ``host`` is only the model's guess: the run hits
    whichever host holds the store then."""

    at: float
    kind: str
    host: int

    @property
    def is_fault(self) -> bool:
        return self.kind not in ("heal", "replace")


def plan(
    seed: int,
    hosts: int,
    duration: float,
    gap: tuple[float, float],
    *,
    min_up: int = 2,
    kinds: Sequence[str] = KINDS,
) -> list[Fault]:
    """A schedule for ``duration`` s, one event every ``gap`` s (uniform), drawn from
    ``seed``; every fault picks among the hosts the model says it can hit."""
    rng = random.Random(seed)
    state = ["up"] * hosts
    heals: list[tuple[float, int]] = []
    out: list[Fault] = []
    t = rng.uniform(*gap)
    while t < duration:
        for at, h in [x for x in heals if x[0] <= t]:
            heals.remove((at, h))
            state[h] = "up"
            out.append(Fault(at, "heal", h))
        up = [h for h in range(hosts) if state[h] == "up"]
        down = [h for h in range(hosts) if state[h] == "down"]
        choices = [k for k in kinds if k != "replace"] if len(up) > min_up else []
        if down and "replace" in kinds:
            choices.append("replace")
        if choices:
            kind = rng.choice(choices)
            if kind == "replace":
                host = rng.choice(down)
                state[host] = "up"
            else:
                host = rng.choice(up)
                state[host] = "cut" if kind == "cut" else "down"
                if kind == "cut":
                    heals.append((t + rng.uniform(3.0, 8.0), host))
            out.append(Fault(round(t, 2), kind, host))
        t += rng.uniform(*gap)
    out.extend(Fault(round(at, 2), "heal", h) for at, h in heals)
    return sorted(out, key=lambda f: f.at)


@dataclass
class Verdict:
    violations: list[str] = field(default_factory=list)
    worlds: int = 0
    final_step: int = 0
    steps_done: int = 0
    redone: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations


def check(
    events: list[dict[str, Any]],
    *,
    reference: dict[int, int],
    faults: int,
    member_exit_codes: dict[str, int | None],
    leftovers: dict[str, list[int]],
) -> Verdict:
    """Every violation in one campaign run. ``reference[n]``: the state after ``n``
    undisturbed steps (must hold the final step); ``member_exit_codes``: the agents that
    were members at the end (None: still running); ``leftovers``: processes still on each
    host after every agent exited."""
    verdict = Verdict()
    steps = [e for e in events if e["event"] == "step"]
    spans: dict[str, list[float]] = {}
    computed: dict[str, set[int]] = {}
    for e in steps:
        span = spans.setdefault(e["world_id"], [e["t"], e["t"]])
        span[0], span[1] = min(span[0], e["t"]), max(span[1], e["t"])
        computed.setdefault(e["world_id"], set()).add(e["step"])
    verdict.worlds = len(spans)
    ordered = sorted(spans.items(), key=lambda kv: kv[1][0])
    for i, (a, (a0, a1)) in enumerate(ordered):
        for b, (b0, b1) in ordered[i + 1 :]:
            overlap = min(a1, b1) - max(a0, b0)
            if overlap > OVERLAP_TOLERANCE:
                verdict.violations.append(
                    f"two worlds trained at the same time: {a} and {b} overlap {overlap:.2f} s"
                )
    done = [e for e in events if e["event"] == "done"]
    if not done:
        verdict.violations.append("no worker finished the job")
    else:
        finals = {(e["step"], e["value"]) for e in done}
        if len(finals) > 1:
            verdict.violations.append(f"ranks finished with different states: {sorted(finals)}")
        step, value = max(finals)
        verdict.final_step = step
        if reference.get(step) != value:
            verdict.violations.append(
                f"final state after {step} steps is {value}, an undisturbed run's is "
                f"{reference.get(step)}"
            )
    verdict.steps_done = sum(len(s) for s in computed.values())
    distinct = len(set().union(*computed.values())) if computed else 0
    # Steps computed again by a later world, plus steps the job had reached but finished
    # without (its state went back and it stopped before computing them again).
    reached = max((e["step"] for e in steps), default=0)
    verdict.redone = verdict.steps_done - distinct + max(0, reached - verdict.final_step)
    if verdict.redone > faults:
        verdict.violations.append(f"{verdict.redone} steps redone for {faults} faults")
    finished = bool(done)
    for host, code in sorted(member_exit_codes.items()):
        if code is None or (code == 0) != finished:
            said = "still running" if code is None else f"exit {code}"
            outcome = "finished: 0" if finished else "failed: non-zero"
            verdict.violations.append(
                f"{host}'s agent ({said}) is not the job's outcome ({outcome})"
            )
    for host, pids in sorted(leftovers.items()):
        if pids:
            verdict.violations.append(f"processes left behind on {host}: {pids}")
    return verdict


# A pause between two worlds shorter than this is an in-place regroup; longer, a stall.
REGROUP_PAUSE = 2.0


def time_budget(events: list[dict[str, Any]], starts: list[dict[str, Any]]) -> dict[str, Any]:
    """Where a run's time went, from the workers' events and start records: seconds
    training (from each world's first step to its last), in in-place regroups (pauses
    between worlds under ``REGROUP_PAUSE``) and in stalls (longer pauses: fresh workers
    starting, rounds, waits); how often the state went back to step 1 after the first
    world; and how long workers started during the run took from their start (before
    ``import torch``) to their first sync, or that they never got there."""
    spans: dict[str, list[float]] = {}
    first_step: dict[str, int] = {}
    for e in events:
        if e["event"] == "step":
            span = spans.setdefault(e["world_id"], [e["t"], e["t"]])
            span[0], span[1] = min(span[0], e["t"]), max(span[1], e["t"])
            first_step[e["world_id"]] = min(first_step.get(e["world_id"], e["step"]), e["step"])
    if not spans:
        return {}
    worlds = sorted(spans.items(), key=lambda kv: kv[1][0])
    pauses = [b[1][0] - a[1][1] for a, b in zip(worlds, worlds[1:], strict=False)]
    synced: dict[int, float] = {}
    for e in events:
        if e["event"] == "sync":
            synced.setdefault(e["pid"], e["t"])
    began = worlds[0][1][0]
    fresh = [r for r in starts if r["t"] > began]
    startup = sorted(synced[r["pid"]] - r["t"] for r in fresh if r["pid"] in synced)
    return {
        "training_s": round(sum(b - a for _, (a, b) in worlds), 1),
        "regroups": [round(p, 2) for p in pauses if p < REGROUP_PAUSE],
        "stalls": [round(p, 1) for p in pauses if p >= REGROUP_PAUSE],
        "state_lost": sum(1 for w, _ in worlds[1:] if first_step[w] <= 1),
        "fresh_startup_s": [round(s, 1) for s in startup],
        "fresh_never_synced": len(fresh) - len(startup),
    }
