"""A real SLURM on a simulated cluster: munge, slurmctld and one slurmd per host.

``SlurmCluster(cluster, workdir)`` starts, on the hosts of a ``Cluster`` (network
namespaces with their own hostnames and 198.18 addresses):

- one ``munged`` on the first host (its socket is a file under ``workdir``, which every
  host's processes reach) with a key of its own, so it never talks to a system munge;
- ``slurmctld`` on the first host, and a ``slurmd`` on every host, in the host's network
  and UTS namespaces (``host.popen``), so each sees its own hostname and address, as
  ``NodeName=<host> NodeAddr=<its address>`` in ``slurm.conf`` says; all in the
  foreground (``-D``), every file they write (state, spool, logs, pid files) under
  ``workdir``, ``SlurmUser=root``;
- two partitions on all nodes: ``main`` (the default) and ``urgent``, whose jobs preempt
  ``main``'s (``preempt/partition_prio``, ``PreemptMode=REQUEUE``; a preempted job's tasks
  get SIGTERM and ``GRACE_TIME`` s before SIGKILL, then the job is requeued).

It returns once ``sinfo`` shows every node idle. ``slurm.run(cmd)`` runs a client command
(``srun``, ``sbatch``, ``scancel``...) on the first host with ``SLURM_CONF`` set;
``slurm.env()`` is that environment. ``close()`` (or leaving ``with``) stops the daemons
and munged; the ``Cluster`` it runs on still has to be closed (it kills whatever is left).

Process tracking is ``proctrack/linuxproc`` and ``task/none``; slurmd 22.05 still loads a
cgroup plugin at start (``cgroup/v1``, pointed at pid 1's ``/sys/fs/cgroup``: ``ip netns
exec`` mounts a sysfs without the cgroup mounts), but nothing creates cgroups. The daemons'
ports are SLURM's defaults: every host is a fresh network namespace, where they are free.
``slurm_available()`` says why it cannot run here; the ``slurm_cluster`` fixture (module
scope) and ``slurm`` (per test: cancels the test's jobs) skip with that one line, or fail
when ``CI`` is set.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from elastic.harness.cluster import Cluster, Host, require_cluster

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "squeue", "scancel")
GRACE_TIME = 20  # s a preempted job's tasks have between SIGTERM and SIGKILL
CTLD_PORT = 6817
SLURMD_PORT = 6818
CPUS = 4  # per node, as configured (SlurmdParameters=config_overrides: not checked)
SLURM_HOSTS = 3  # hosts of the ``slurm_cluster`` fixture


class SlurmError(RuntimeError):
    pass


def slurm_available() -> tuple[bool, str]:
    missing = [tool for tool in DAEMONS if shutil.which(tool) is None]
    if missing:
        return (
            False,
            f"SLURM tests need {', '.join(missing)} (apt: slurmctld slurmd slurm-client munge)",
        )
    return True, ""


def slurm_conf(cluster: Cluster, workdir: Path, munge_socket: Path) -> str:
    first = cluster.hosts[0]
    nodes = "".join(
        f"NodeName={h.name} NodeAddr={h.addr} CPUs={CPUS} RealMemory=1000 State=UNKNOWN\n"
        for h in cluster.hosts
    )
    names = ",".join(h.name for h in cluster.hosts)
    partitions = (
        f"PartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP "
        f"PriorityTier=1 GraceTime={GRACE_TIME}\n"
        f"PartitionName=urgent Nodes={names} MaxTime=INFINITE State=UP PriorityTier=2 "
        "PreemptMode=OFF\n"
    )
    return f"""\
ClusterName=elastic
SlurmctldHost={first.name}({first.addr})
SlurmctldPort={CTLD_PORT}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={workdir}/ctld-state
SlurmdSpoolDir={workdir}/spool-%n
SlurmctldPidFile={workdir}/slurmctld.pid
SlurmdPidFile={workdir}/slurmd-%n.pid
SlurmctldLogFile={workdir}/slurmctld.log
SlurmdLogFile={workdir}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=300
MessageTimeout=10
SlurmctldTimeout=30
SlurmdTimeout=60
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{nodes}{partitions}"""


class SlurmCluster:
    """munged, slurmctld on ``cluster.hosts[0]`` and a slurmd on every host."""

    def __init__(self, cluster: Cluster, workdir: Path, timeout: float = 60.0) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.conf = workdir / "slurm.conf"
        self.munge_socket = workdir / "munge" / "munge.socket"
        self._munged: subprocess.Popen[Any] | None = None
        self._daemons: list[subprocess.Popen[Any]] = []
        self._closed = False
        try:
            self._start(timeout)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def controller(self) -> Host:
        return self.cluster.hosts[0]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """This machine's environment, SLURM's variables left out, with ``SLURM_CONF``."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra or {})
        return env

    def run(
        self, cmd: Sequence[str], timeout: float = 60.0, host: Host | None = None, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run a client command to completion on ``host`` (the controller's unless told)."""
        kwargs.setdefault("env", self.env())
        return (host or self.controller).run(cmd, timeout=timeout, **kwargs)

    def popen(self, cmd: Sequence[str], host: Host | None = None, **kwargs: Any) -> Any:
        kwargs.setdefault("env", self.env())
        return (host or self.controller).popen(cmd, **kwargs)

    # --- start -----------------------------------------------------------------------------
    def _start(self, timeout: float) -> None:
        munge_dir = self.munge_socket.parent
        munge_dir.mkdir(parents=True, mode=0o700)
        for name in ("ctld-state", *(f"spool-{h.name}" for h in self.cluster.hosts)):
            (self.workdir / name).mkdir()
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf.write_text(slurm_conf(self.cluster, self.workdir, self.munge_socket))
        # ``ip netns exec`` mounts a sysfs of the namespace's own, without the cgroup
        # mounts; slurmd 22.05 insists on a cgroup plugin, and pid 1's view still has them.
        (self.workdir / "cgroup.conf").write_text(
            "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/proc/1/root/sys/fs/cgroup\n"
        )
        # On the first host too (its socket is a file every host reaches): a run killed
        # before it could clean up leaves it in a namespace the next cluster sweeps.
        self._munged = self.controller.popen(
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={munge_dir}/munged.pid",
                f"--log-file={munge_dir}/munged.log",
                f"--seed-file={munge_dir}/munged.seed",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged")
        log = open(self.workdir / "daemons.out", "w")  # noqa: SIM115  (closed with the cluster)
        self._log = log
        conf = ["-f", str(self.conf)]
        self._daemons.append(
            self.controller.popen(
                ["slurmctld", "-D", "-i", *conf], env=self.env(), stdout=log, stderr=log
            )
        )
        for host in self.cluster.hosts:
            self._daemons.append(
                host.popen(
                    ["slurmd", "-D", "-N", host.name, *conf],
                    env=self.env(),
                    stdout=log,
                    stderr=log,
                )
            )
        self._wait(self._all_idle, timeout, "every node idle in sinfo")

    def _all_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-p", "main", "-o", "%N %t"], timeout=20).stdout
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return sorted(states) == sorted(h.name for h in self.cluster.hosts) and all(
            state == "idle" for state in states.values()
        )

    def _wait(self, ready: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [p for p in [self._munged, *self._daemons] if p and p.poll() is not None]
            if dead:
                raise SlurmError(f"{dead[0].args!r} exited {dead[0].returncode}: {self.logs()}")
            with contextlib.suppress(subprocess.TimeoutExpired):
                if ready():
                    return
            time.sleep(0.2)
        raise SlurmError(f"no {what} within {timeout:g} s: {self.logs()}")

    def logs(self, tail: int = 3000) -> str:
        """The daemons' logs, each one's end, for a failure message."""
        parts = []
        for path in sorted(self.workdir.glob("*.log")) + [self.workdir / "daemons.out"]:
            if path.exists():
                parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    # --- jobs --------------------------------------------------------------------------------
    def sbatch(self, script: str, *options: str, env: dict[str, str] | None = None) -> str:
        """Submit ``script`` (its text) with ``options``; the job id. Its output goes to
        ``workdir/slurm-<job>.out`` unless ``options`` say where (never the caller's cwd)."""
        path = self.workdir / f"job-{time.monotonic_ns()}.sh"
        path.write_text(script)
        if not any(o.startswith(("-o", "--output")) for o in options):
            options = (*options, f"--output={self.workdir}/slurm-%j.out")
        done = self.run(["sbatch", "--parsable", *options, str(path)], env=self.env(env))
        if done.returncode != 0:
            raise SlurmError(f"sbatch failed: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode...); {} once gone."""
        out = self.run(["scontrol", "-o", "show", "job", job_id], timeout=20).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def queue(self) -> list[str]:
        """The ids of the jobs pending or running."""
        return self.run(["squeue", "-h", "-o", "%i"], timeout=20).stdout.split()

    def cancel_all(self, timeout: float = 60.0) -> None:
        """Cancel every job and wait until none is left and every node is idle again."""
        jobs = self.queue()
        if jobs:
            self.run(["scancel", *jobs], timeout=20)
        self._wait(lambda: not self.queue() and self._all_idle(), timeout, "empty queue")

    # --- stop --------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the daemons (slurmd first, so no step is left half-started) and munged."""
        if self._closed:
            return
        self._closed = True
        for proc in reversed(self._daemons):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self._daemons):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self._munged is not None:
            self._munged.terminate()
            try:
                self._munged.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._munged.kill()
                self._munged.wait()
        if hasattr(self, "_log"):
            self._log.close()


def cannot_run(reason: str) -> None:
    """Skip the calling test for ``reason`` (one line); fail it under CI."""
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"CI must run the SLURM tests: {reason}", pytrace=False)
    pytest.skip(reason)


def require_slurm() -> None:
    """Skip the calling test when SLURM's daemons are not installed; fail it under CI."""
    require_cluster()
    ok, reason = slurm_available()
    if not ok:
        cannot_run(reason)


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A real SLURM of ``SLURM_HOSTS`` hosts, shared by a module's tests (starting one takes
    about a second; the tests' jobs take the time). Each test cancels its jobs at its end
    (``slurm_jobs``), so the next one finds every node idle."""
    require_slurm()
    with Cluster(SLURM_HOSTS) as cluster:
        try:
            slurm = SlurmCluster(cluster, tmp_path_factory.mktemp("slurm"))
        except SlurmError as exc:
            first = str(exc).splitlines()[0]
            cannot_run(f"cannot start SLURM here: {first}")
        with slurm:
            yield slurm


@pytest.fixture(name="slurm")
def slurm_fixture(slurm_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The module's SLURM, every job cancelled and gone when the test ends."""
    yield slurm_cluster
    slurm_cluster.cancel_all()
