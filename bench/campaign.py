"""A randomized fault campaign: a training job on simulated hosts under a seeded schedule
of SIGTERMs, SIGKILLs, cable cuts, replacement nodes and store-host events, checked for
correctness and measured for goodput.

Each run makes a ``elastic.harness.cluster`` cluster (4 job hosts, plus 3 etcd members for
etcd-v3), runs the job undisturbed for ``--baseline`` s to measure its steps per second,
then runs it again under the schedule that ``--seed`` draws (``campaign_check.plan``), lets
it settle, stops it, and hands the workers' event log to ``campaign_check.check``. The job
is a lockstep gloo worker under ``elastic.train`` (``WORKER`` below) whose state is an
integer accumulator that any world size computes bit for bit alike, so the final state is
compared with an undisturbed run's. ``--variant in-place`` regroups in place with no
checkpoint; ``restart`` restarts the workers on a change and checkpoints every step to a
shared folder (what a torchrun job would do); ``--impls torchrun`` runs the restart
variant under torchrun.

For c10d, a SIGKILL or a cut is never aimed at the store's current host (its store dies
with it: a documented limit); a ``store`` event SIGTERMs that host (the store must move).
For etcd-v3 a ``store`` event SIGKILLs one of the three etcd members (once).

    python bench/campaign.py [--impls c10d,etcd-v3] [--seeds 1-10] [--duration 150]
        [--gap 5,10] [--variant in-place] [--baseline 20] [--json out.json] [--keep DIR]
        [--warm-restarts]

Needs root. Prints one line per run (and where its time went: ``campaign_check.time_budget``)
and a summary table, then JSON; exit 1 on a violation.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from campaign_check import Fault, check, plan, time_budget  # noqa: E402
from elastic.harness.accumulator import ACCUMULATOR_STATE  # noqa: E402
from elastic.harness.benchmarking import in_scratch_dir  # noqa: E402
from elastic.harness.cluster import Cluster, Host, cluster_available  # noqa: E402
from elastic.harness.multihost import (  # noqa: E402
    C10D_PORT,
    START_RECORD,
    FaultJob,
    etcd_endpoint,
    start_etcd,
)
from elastic.harness.preemption_job import read_events  # noqa: E402
from elastic.testing.waits import wait_until  # noqa: E402

JOB_HOSTS = 4
ETCD_HOSTS = 3
FORM_TIMEOUT = 120.0
EXIT_BOUND = 90.0

WORKER = (
    """\
import faulthandler, json, os, socket, sys, time, uuid
t0 = time.time()
faulthandler.enable()
ITEMS, MOD = 12, 2**61 - 1


def share(step, rank, world):
    return sum((step * 7919 + i * 104729) % 1000003 for i in range(ITEMS) if i % world == rank)


def advance(value, total):
    return (value * 31 + total) % MOD


if sys.argv[1] == "--reference":
    value, out = 0, {}
    for step in range(1, int(sys.argv[2]) + 1):
        value = advance(value, share(step, 0, 1))
        out[step] = value
    print(json.dumps(out))
    sys.exit(0)

import torch
import torch.distributed as dist
import elastic

"""
    + START_RECORD
    + """\
events = os.open(os.path.join(out, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
pause, variant, ckpt = float(sys.argv[1]), sys.argv[2], sys.argv[3]
stop = os.path.join(out, "stop")
world_id = "-"


def note(event, step, **kw):
    line = dict(rec, t=time.time(), event=event, step=step, world_id=world_id,
                rank=int(os.environ["RANK"]), world=int(os.environ["WORLD_SIZE"]), **kw)
    os.write(events, (json.dumps(line) + "\\n").encode())  # one O_APPEND write per line


"""
    + ACCUMULATOR_STATE
    + """
class Accumulator(AccumulatorState):
    def sync(self, world_size, rank):
        global world_id
        every = [None] * world_size
        dist.all_gather_object(every, (self.capture_snapshot(), uuid.uuid4().hex[:12]))
        self.apply_snapshot(max((s for s, _ in every), key=lambda s: s["step"]))
        world_id = every[0][1]  # rank 0's: one id per world, known to all its ranks
        note("sync", self.step, value=self.value)


def train_step(state):
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([share(state.step + 1, rank, world)], dtype=torch.int64)
    dist.all_reduce(total)
    state.value = advance(state.value, int(total.item()))
    state.step += 1
    note("step", state.step, value=state.value)
    time.sleep(pause)
    return os.path.exists(stop)


elastic.init_process_group(backend="gloo", timeout=60)
state = Accumulator()
in_place = variant == "in-place"
last = elastic.train(train_step, state, checkpointer="" if in_place else "fs:" + ckpt,
                     checkpoint_every=1, regroup_in_place=in_place)
note("done", state.step, value=state.value)
dist.barrier()
dist.destroy_process_group()
"""
)

HOLDER_PROBE = """\
import sys
from elastic.core.tcpstore import TCPStoreClient
try:
    client = TCPStoreClient(sys.argv[1], int(sys.argv[2]), 1.0)
    (mark,) = client.multi_get(["elastic/standby"], False)  # a standby's mark; none: live
except Exception:
    mark = b"gone"
print("no" if mark else "live")
"""


class Campaign:
    """One job under one schedule on one cluster; ``run`` returns its report."""

    def __init__(
        self, impl: str, variant: str, workdir: Path, pause: float, warm: bool = False
    ) -> None:
        self.impl, self.variant, self.workdir, self.pause = impl, variant, workdir, pause
        self.warm = warm and impl != "torchrun"  # ours' --warm-restarts
        self.backend = "etcd-v3" if impl == "etcd-v3" else "c10d"
        self.rng = random.Random(0)
        self.etcd: list[subprocess.Popen[bytes]] = []

    def job(self, cluster: Cluster, name: str) -> FaultJob:
        hosts = cluster.hosts[:JOB_HOSTS]
        if self.impl == "torchrun":  # torch's c10d takes one endpoint: the first host
            endpoint = f"{hosts[0].name}:{C10D_PORT}"
        elif self.backend == "c10d":
            endpoint = ",".join(f"{h.name}:{C10D_PORT}" for h in hosts)
        else:
            endpoint = etcd_endpoint(cluster.hosts[JOB_HOSTS:])
        workdir = self.workdir / name
        workdir.mkdir(parents=True)
        script = workdir / "worker.py"
        script.write_text(WORKER)
        return FaultJob(
            cluster,
            workdir,
            self.backend,
            endpoint,
            launcher="torchrun" if self.impl == "torchrun" else "ours",
            nnodes=f"2:{JOB_HOSTS}",
            conf={"last_call_timeout": 1},
            args=["--max-restarts=100", *(["--warm-restarts"] if self.warm else [])],
            script=script,
            script_args=[str(self.pause), self.variant, str(workdir / "ckpt")],
            run_id=name,
            env={"RES_OPTIONS": "timeout:1 attempts:1", "OMP_NUM_THREADS": "1"},
        )

    def holder(self, job: FaultJob, hosts: list[Host]) -> Host | None:
        """The host whose agent serves the c10d store now (None: none answers)."""
        probe = hosts[0]
        for host in hosts:
            if job.nodes.get(host.name) and job.nodes[host.name].proc.poll() is None:
                probe = host
                break
        for host in hosts:
            cmd = [sys.executable, "-c", HOLDER_PROBE, host.name, str(C10D_PORT)]
            if probe.run(cmd, timeout=10).stdout.strip() == "live":
                return host
        return None

    def baseline(self, cluster: Cluster, seconds: float) -> float:
        """Steps per second of the job undisturbed on every host."""
        job = self.job(cluster, "baseline")
        hosts = cluster.hosts[:JOB_HOSTS]
        if not job.start_together(hosts, FORM_TIMEOUT):
            raise RuntimeError("the baseline job did not form:\n" + job.texts())
        time.sleep(seconds)
        job.finish()
        for node in job.nodes.values():
            node.wait(EXIT_BOUND)
        steps = [e for e in read_events(job.workdir) if e["event"] == "step"]
        return max(e["step"] for e in steps) / (steps[-1]["t"] - steps[0]["t"])

    def run(self, cluster: Cluster, schedule: list[Fault], settle: float) -> dict[str, Any]:
        job = self.job(cluster, "campaign")
        hosts = list(cluster.hosts[:JOB_HOSTS])
        if not job.start_together(hosts, FORM_TIMEOUT):
            return {
                "violations": ["the job did not form"],
                "faults_injected": 0,
                "steps_redone": 0,
                "logs": job.texts(),
            }
        wait_until(lambda: any(e["event"] == "step" for e in read_events(job.workdir)), 60)
        state = {h.name: "up" for h in hosts}
        applied: list[dict[str, Any]] = []
        start = time.time()
        for fault in schedule:
            time.sleep(max(0.0, start + fault.at - time.time()))
            done = self.apply(fault, job, cluster, hosts, state)
            if done is not None:
                applied.append({"t": round(time.time() - start, 2), **done})
        last_fault = time.time()
        cluster.heal()
        for name, s in state.items():
            state[name] = "up" if s == "cut" else s
        time.sleep(settle)
        resumed = any(
            e["event"] == "step" and e["t"] > last_fault for e in read_events(job.workdir)
        )
        job.finish()
        stopped = time.time()
        members = {n: job.nodes[n].proc for n, s in state.items() if s == "up"}
        wait_until(lambda: all(p.poll() is not None for p in members.values()), EXIT_BOUND)
        codes = {n: p.poll() for n, p in members.items()}
        wait_until(lambda: not any(h.processes() for h in hosts), 10)
        leftovers = {h.name: h.processes() for h in hosts}
        events = read_events(job.workdir)
        final = max((e["step"] for e in events if e["event"] == "done"), default=0)
        faults = sum(1 for a in applied if a["kind"] not in ("heal", "replace"))
        verdict = check(
            events,
            reference=reference(job, max(final, 1)),
            faults=faults,
            member_exit_codes=codes,
            leftovers=leftovers,
        )
        if not resumed:
            verdict.violations.append(f"not training {settle:g} s after the last fault")
        steps = [e for e in events if e["event"] == "step"]
        window = (stopped - steps[0]["t"]) if steps else float("nan")
        return {
            "faults": applied,
            "faults_injected": faults,
            "worlds": verdict.worlds,
            "final_step": verdict.final_step,
            "steps_redone": verdict.redone,
            "steps_per_second": round(verdict.final_step / window, 3),
            "violations": verdict.violations,
            "time": time_budget(events, job.starts()),
            "exit_codes": codes,
            "logs": job.texts(),
        }

    def apply(
        self,
        fault: Fault,
        job: FaultJob,
        cluster: Cluster,
        hosts: list[Host],
        state: dict[str, str],
    ) -> dict[str, Any] | None:
        """Carry ``fault`` out on the hosts as they are now (the plan only modelled them);
        what was done, or None when nothing could be."""
        by_name = {h.name: h for h in hosts}
        up = [h for h in hosts if state[h.name] == "up"]
        planned = hosts[fault.host]
        if fault.kind == "heal":
            if state[planned.name] != "cut":
                return None
            cluster.heal(planned)
            state[planned.name] = "up"
            return {"kind": "heal", "host": planned.name}
        if fault.kind == "replace":
            down = [h for h in hosts if state[h.name] == "down"]
            if not down:
                return None
            target = planned if planned in down else self.rng.choice(down)
            job.start(target)
            state[target.name] = "up"
            return {"kind": "replace", "host": target.name}
        if len(up) <= 2:
            return None  # the job's minimum: a fault now would end it, not test it
        if fault.kind == "store":
            if self.backend == "c10d":
                holder = self.holder(job, hosts)
                if holder is None or state[holder.name] != "up":
                    return None
                os.kill(job.nodes[holder.name].proc.pid, signal.SIGTERM)
                state[holder.name] = "down"
                return {"kind": "store-sigterm", "host": holder.name}
            if not self.etcd_killed:
                self.etcd_killed = True
                member = cluster.hosts[JOB_HOSTS]
                member.kill()
                return {"kind": "etcd-member-sigkill", "host": member.name}
            return None
        # An agent that ended by itself (its job failed: torchrun's often) takes no fault.
        eligible = [h for h in up if job.nodes[h.name].proc.poll() is None]
        if self.backend == "c10d" and fault.kind in ("sigkill", "cut"):
            holder = self.holder(job, hosts)
            eligible = [h for h in eligible if h is not holder]
        if not eligible:
            return None
        target = planned if planned in eligible else self.rng.choice(eligible)
        if fault.kind == "sigterm":
            os.kill(job.nodes[target.name].proc.pid, signal.SIGTERM)
            state[target.name] = "down"
        elif fault.kind == "sigkill":
            by_name[target.name].kill()
            state[target.name] = "down"
        else:
            cluster.cut(target)
            state[target.name] = "cut"
        return {"kind": fault.kind, "host": target.name}

    etcd_killed = False


def reference(job: FaultJob, steps: int) -> dict[int, int]:
    """The state after each of ``steps`` undisturbed steps (one process, no torch)."""
    assert job.script is not None
    proc = subprocess.run(
        [sys.executable, str(job.script), "--reference", str(steps)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return {int(k): v for k, v in json.loads(proc.stdout).items()}


def run_seed(args: argparse.Namespace, impl: str, seed: int, workdir: Path) -> dict[str, Any]:
    variant = "restart" if impl == "torchrun" else args.variant
    kinds = ["sigterm", "sigkill", "cut", "replace", "store"]
    schedule = plan(seed, JOB_HOSTS, args.duration, args.gap, kinds=kinds)
    campaign = Campaign(impl, variant, workdir, args.pause, args.warm_restarts)
    extra = ETCD_HOSTS if impl == "etcd-v3" else 0
    with Cluster(JOB_HOSTS + extra) as cluster:
        if extra:
            campaign.etcd = start_etcd(cluster.hosts[JOB_HOSTS:], workdir)
        rate = args.baseline_rate or campaign.baseline(cluster, args.baseline)
        report = campaign.run(cluster, schedule, args.settle)
    report.update(impl=impl, variant=variant, seed=seed, baseline_steps_per_second=round(rate, 3))
    report["goodput"] = round(report.get("steps_per_second", 0.0) / rate, 3)
    return report


def seeds(text: str) -> list[int]:
    if "-" in text:
        first, last = text.split("-", 1)
        return list(range(int(first), int(last) + 1))
    return [int(s) for s in text.split(",") if s]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", default="c10d,etcd-v3", help="c10d, etcd-v3, torchrun")
    parser.add_argument("--seeds", default="1", help="e.g. 1-10 or 3,7")
    parser.add_argument("--duration", type=float, default=150.0, help="s of faults")
    parser.add_argument("--gap", default="5,10", help="s between events: MIN,MAX")
    parser.add_argument("--variant", default="in-place", choices=["in-place", "restart"])
    parser.add_argument("--pause", type=float, default=0.1, help="s each step sleeps")
    parser.add_argument(
        "--warm-restarts", action="store_true", help="ours' agents run with --warm-restarts"
    )
    parser.add_argument("--baseline", type=float, default=20.0, help="s of undisturbed run")
    parser.add_argument("--baseline-rate", type=float, help="steps/s: skip the baseline run")
    parser.add_argument("--settle", type=float, default=10.0, help="s after the last fault")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--keep", help="keep every run's logs under this folder")
    args = parser.parse_args(argv)
    low, high = (float(x) for x in args.gap.split(","))
    args.gap = (low, high)
    ok, why = cluster_available()
    if not ok:
        print(f"bench/campaign.py: {why}", file=sys.stderr)
        return 2
    reports = []
    for impl in args.impls.split(","):
        for seed in seeds(args.seeds):
            report, took = in_scratch_dir(
                f"campaign-{impl}-{seed}-",
                args.keep,
                lambda w, i=impl, s=seed: run_seed(args, i, s, w),
            )
            reports.append(report)
            verdict = "ok" if not report["violations"] else "; ".join(report["violations"])
            print(
                f"# {impl} seed {seed}: {report['faults_injected']} faults, "
                f"{report['steps_redone']} steps redone, goodput {report['goodput']}: "
                f"{verdict} ({took:.0f} s)\n#   time: {report.get('time')}",
                file=sys.stderr,
                flush=True,
            )
    print(render(reports))
    quiet = [{k: v for k, v in r.items() if k != "logs"} for r in reports]
    print(json.dumps(quiet, indent=1))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(reports, indent=1))
    return 1 if any(r["violations"] for r in reports) else 0


def render(reports: list[dict[str, Any]]) -> str:
    lines = ["| impl | seeds | faults | survived | steps redone | goodput (min-max) |"]
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for impl in dict.fromkeys(r["impl"] for r in reports):
        mine = [r for r in reports if r["impl"] == impl]
        good = [r["goodput"] for r in mine]
        lines.append(
            f"| {impl} ({mine[0]['variant']}) | {len(mine)} "
            f"| {sum(r['faults_injected'] for r in mine)} "
            f"| {sum(not r['violations'] for r in mine)}/{len(mine)} "
            f"| {sum(r['steps_redone'] for r in mine)} "
            f"| {sorted(good)[len(good) // 2]:.2f} ({min(good):.2f}-{max(good):.2f}) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
