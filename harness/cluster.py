"""Simulated multi-host clusters on one machine, for tests of nodes leaving a real network.

For backend authors
-------------------
Request the ``cluster_factory`` fixture (in ``tests/`` it comes with ``conftest.py``;
elsewhere add ``pytest_plugins = ["elastic.harness.cluster"]``)::

    @pytest.mark.timeout(60)
    def test_job_survives_a_lost_node(cluster_factory):
        cluster = cluster_factory(3)
        a, b, c = cluster.hosts
        store = a.popen(["python", "-m", "my_backend.server"], stdout=subprocess.PIPE)
        ...                   # start agents on b and c against f"{a.name}:29400"
        cluster.cut(c)        # c's processes run on, its packets vanish (no RST)
        ...                   # assert the job re-forms with a and b
        cluster.heal(c)

Each host is a network namespace with a hostname of its own (``host.name``), one interface
``eth0`` with ``host.addr`` from 198.18.0.0/15 (a /24 per cluster, no other address), an
``/etc/hosts`` naming every host and a resolver that fails at once rather than ask the
outside world; ``localhost`` is its own loopback. The hosts hang off a bridge in a "switch"
namespace, so the machine's own network is never touched. Neighbour (ARP) entries are
static: a lost peer never fails a connect fast with "no route to host", packets vanish.

- ``host.popen(cmd, **kwargs)``, ``host.run(cmd, timeout=...)``: run on the host in a new
  session, with this environment unless ``env=`` says otherwise. ``host.processes()``
  lists what runs there, ``host.kill()`` SIGKILLs it all (also processes that left the
  session).
- ``cluster.cut(host)`` pulls the host's cable at the switch (its ``eth0`` loses carrier);
  ``cluster.heal(host)`` plugs it back. Established TCP connections survive a cut: they
  stall and resume on the next retransmission, which backoff may put seconds after heal.
- ``cluster.partition([a], [b, c])`` drops traffic between the groups, links staying up;
  ``cluster.heal()`` undoes every cut and partition.
- ``cluster.latency(host, delay_ms, jitter_ms, loss_pct)`` delays (and drops) what the host
  sends, ``cluster.clear_latency(host)`` stops it: ``tc netem`` if the kernel has it, else a
  relay process in the switch (``Cluster(n, shaper="relay")`` forces it).

A cluster removes all it made (processes, namespaces, veths, ``/etc/netns`` entries) at
fixture teardown or leaving ``with Cluster(n) as cluster:``, also after an exception. Its
namespaces are named ``elc<pid>...`` after the creating process: what a crashed run left
behind is swept by the next cluster. Needs root, iproute2 and util-linux;
``cluster_available()`` says why not, and the fixture then skips (fails if ``CI`` is set).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import pytest
from elastic.harness.netns import (  # noqa: F401  (public names of this module too)
    ETC_NETNS,
    NAME,
    NETNS_DIR,
    RELAY_FILTER,
    STATE_DIR,
    SUPERNET,
    ClusterError,
    batch,
    cluster_available,
    netem_available,
    netns_id_of,
    pids_in,
    run,
    running,
    signal_all,
    sweep_stale,
)

_clusters = itertools.count()  # names this process's clusters
RELAY_MODULE = "elastic.harness.netns"  # run in the switch: the stand-in for netem


class Host:
    """One simulated machine: a network namespace plus a UTS namespace with its hostname."""

    def __init__(self, index: int, name: str, addr: str, netns: str) -> None:
        self.index = index
        self.name = name
        self.addr = addr
        self.netns = netns
        self.mac = "02:00:" + ":".join(f"{int(o):02x}" for o in addr.split("."))
        self.uts = STATE_DIR / f"{netns}.uts"
        self.netns_id: tuple[int, int] | None = None
        self._procs: list[subprocess.Popen[Any]] = []

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.addr!r})"

    def popen(self, cmd: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` on this host in a new session (so ``kill`` can take its group)."""
        if isinstance(cmd, str):
            raise TypeError("cmd must be a list of arguments, not a string")
        popen_kwargs["start_new_session"] = True
        wrapped = ["ip", "netns", "exec", self.netns, "nsenter", f"--uts={self.uts}", "--"]
        proc = subprocess.Popen([*wrapped, *cmd], **popen_kwargs)
        self._procs.append(proc)
        return proc

    def run(
        self, cmd: Sequence[str], timeout: float = 30.0, check: bool = False, **popen_kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` to completion, capturing text output; on timeout its group is killed."""
        popen_kwargs.setdefault("stdout", subprocess.PIPE)
        popen_kwargs.setdefault("stderr", subprocess.PIPE)
        popen_kwargs.setdefault("text", True)
        proc = self.popen(cmd, **popen_kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # the group may be gone already
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        result = subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)
        if check:
            result.check_returncode()
        return result

    def processes(self) -> list[int]:
        """Live processes on this host: all in its namespace, plus any ``popen`` child not
        yet in it (between fork and ``ip netns exec``)."""
        started = {proc.pid for proc in self._procs if proc.poll() is None}
        return sorted(started | set(pids_in(self.netns_id)))

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 10.0) -> None:
        """Send ``sig`` to every process on the host; for SIGKILL, return once none is left.

        Groups are signalled only while their leader is unreaped, so a recycled process
        group id can never be hit; the namespace scan catches everything else, including
        processes that made their own session."""
        deadline = time.monotonic() + timeout
        seen: set[int] = set()
        while True:
            for proc in self._procs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:  # it left its group: the scan finds it
                        pass
            seen.update(pids := pids_in(self.netns_id))
            signal_all(pids, sig)
            # A dying process leaves its namespaces before it is done exiting: wait for all.
            if sig != signal.SIGKILL or not (self.processes() or any(map(running, seen))):
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"{self.name}: {self.processes()} survived SIGKILL")
            time.sleep(0.02)


class Cluster:
    """``n_hosts`` hosts on one bridge; a context manager, also usable without ``with``
    (then call ``close()``). ``shaper`` picks how ``latency`` works: "netem", "relay" or
    "auto" (netem when the kernel has it)."""

    def __init__(self, n_hosts: int, *, shaper: Literal["auto", "netem", "relay"] = "auto") -> None:
        if not 1 <= n_hosts <= 250:
            raise ValueError(f"n_hosts must be 1..250, got {n_hosts}")
        if shaper == "auto":
            shaper = "netem" if netem_available() else "relay"
        elif shaper == "netem" and not netem_available():
            raise ClusterError("this kernel has no tc netem (sch_netem); use shaper='relay'")
        self.shaper = shaper
        self.tag = f"elc{os.getpid()}c{next(_clusters)}"
        self.hosts: list[Host] = []
        self.switch = ""
        self._closed = False
        self._partitioned: set[int] = set()
        self._shaped: dict[int, subprocess.Popen[str] | None] = {}
        try:
            self._create(n_hosts)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def namespaces(self) -> list[str]:
        return [ns for ns in (self.switch, *(h.netns for h in self.hosts)) if ns]

    def _create(self, n_hosts: int) -> None:
        sweep_stale()
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        # The subnet index is part of the switch's name; choosing it and creating the switch
        # under one lock keeps concurrent clusters (other test processes too) on distinct /24s.
        with open(STATE_DIR / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            names = os.listdir(NETNS_DIR) if NETNS_DIR.is_dir() else []
            taken = {m["subnet"] for m in map(NAME.match, names) if m and m["subnet"]}
            index = next((i for i in range(512) if str(i) not in taken), None)
            if index is None:
                raise ClusterError("all 512 /24 subnets of 198.18.0.0/15 are in use")
            self.switch = f"{self.tag}s{index}"
            run(["ip", "netns", "add", self.switch])
        self.subnet = ipaddress.ip_network((int(SUPERNET.network_address) + 256 * index, 24))
        pid_cluster = self.tag.removeprefix("elc")
        for i, addr in zip(range(n_hosts), self.subnet.hosts(), strict=False):
            self.hosts.append(Host(i, f"node{i}-{pid_cluster}", str(addr), f"{self.tag}h{i}"))
        run(["ip", "-batch", "-"], stdin="".join(f"netns add {h.netns}\n" for h in self.hosts))
        # "addrgenmode none" (before "up", or it is too late): no IPv6 link-local address,
        # which would be an address outside 198.18.0.0/15.
        # Partitioned traffic is redirected to "drop", whose peer is down, so it vanishes.
        switch = ["link add br0 type bridge", "link set br0 addrgenmode none", "link set br0 up"]
        switch += ["link add drop type veth peer name drop-peer", "link set drop up"]
        for h in self.hosts:
            switch.append(f"link add p{h.index} type veth peer name eth0 netns {h.netns}")
            switch.append(f"link set p{h.index} addrgenmode none")
            switch.append(f"link set p{h.index} master br0 up")
        batch("ip", self.switch, switch)
        batch("tc", self.switch, [f"qdisc add dev p{h.index} ingress" for h in self.hosts])
        for host in self.hosts:
            host.netns_id = netns_id_of(host.netns)
            lines = ["link set lo up", f"link set eth0 address {host.mac} addrgenmode none"]
            lines += [f"addr add {host.addr}/24 dev eth0", "link set eth0 up"]
            lines += [
                f"neigh replace {p.addr} lladdr {p.mac} dev eth0 nud permanent"
                for p in self.hosts
                if p is not host
            ]
            batch("ip", host.netns, lines)
        hosts_file = "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n"
        hosts_file += "".join(f"{h.addr} {h.name}\n" for h in self.hosts)
        for host in self.hosts:
            etc = ETC_NETNS / host.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
            # Nothing listens on 127.0.0.1:53 in the host, so a DNS lookup fails at once.
            (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
            host.uts.touch()
            run(["unshare", f"--uts={host.uts}", "hostname", host.name])

    def cut(self, host: Host) -> None:
        batch("ip", self.switch, [f"link set p{host.index} down"])

    def heal(self, host: Host | None = None) -> None:
        """Undo ``cut(host)``; without a host, undo every cut and every partition."""
        ports = self.hosts if host is None else [host]
        batch("ip", self.switch, [f"link set p{h.index} up" for h in ports])
        if host is None and self._partitioned:
            dels = [f"filter del dev p{i} parent ffff: pref 1" for i in self._partitioned]
            batch("tc", self.switch, dels)
            self._partitioned.clear()

    def partition(self, side_a: Sequence[Host], side_b: Sequence[Host]) -> None:
        """Drop every packet between the two groups, both ways, with all links up."""
        lines = []
        for sources, targets in ((side_a, side_b), (side_b, side_a)):
            for src, dst in itertools.product(sources, targets):
                lines.append(
                    f"filter add dev p{src.index} parent ffff: protocol ip pref 1 u32"
                    f" match ip dst {dst.addr}/32 action mirred egress redirect dev drop"
                )
                self._partitioned.add(src.index)
        batch("tc", self.switch, lines)

    def latency(
        self, host: Host, delay_ms: float, jitter_ms: float = 0, loss_pct: float = 0
    ) -> None:
        """Delay what ``host`` sends by ``delay_ms`` ± ``jitter_ms`` and drop ``loss_pct``% of
        it, replacing any earlier setting."""
        self.clear_latency(host)
        if self.shaper == "netem":
            netem = f"delay {delay_ms}ms {jitter_ms}ms loss {loss_pct}%"
            batch("tc", host.netns, [f"qdisc replace dev eth0 root netem {netem}"])
            self._shaped[host.index] = None
            return
        tap, args = f"d{host.index}", [str(delay_ms), str(jitter_ms), str(loss_pct)]
        relay = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                self.switch,
                sys.executable,
                "-m",
                "elastic.harness.netns",
                tap,
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._shaped[host.index] = relay
        assert relay.stdout is not None
        started = select.select([relay.stdout], [], [], 30)[0] and relay.stdout.readline()
        if started != "ready\n":
            relay.kill()
            raise ClusterError(f"delay relay for {host.name} failed: {relay.communicate()[1]}")
        batch("ip", self.switch, [f"link set {tap} up"])
        redirect = f"u32 match u32 0 0 action mirred egress redirect dev {tap}"
        batch("tc", self.switch, [f"filter add dev p{host.index} {RELAY_FILTER} {redirect}"])

    def clear_latency(self, host: Host) -> None:
        if host.index not in self._shaped:
            return
        relay = self._shaped.pop(host.index)
        if relay is None:
            batch("tc", host.netns, ["qdisc del dev eth0 root"])
            return
        # Unhook before stopping the relay: a redirect to a vanished tap would black-hole.
        batch("tc", self.switch, [f"filter del dev p{host.index} {RELAY_FILTER}"])
        relay.kill()
        relay.communicate()

    def close(self) -> None:
        """Kill every process, delete every namespace and file; safe to call again."""
        if self._closed:
            return
        self._closed = True
        failures = []
        for host in self.hosts:
            try:
                host.kill()
            except ClusterError as exc:
                failures.append(str(exc))
            for proc in host._procs:
                for stream in (proc.stdin, proc.stdout, proc.stderr):
                    if stream is not None:
                        stream.close()
        signal_all(pids_in(netns_id_of(self.switch)), signal.SIGKILL)  # delay relays
        for relay in self._shaped.values():
            if relay is not None:
                relay.communicate()
        for netns in self.namespaces:  # taking the veths with them
            run(["ip", "netns", "del", netns], check=False)
        for host in self.hosts:
            run(["umount", "-l", str(host.uts)], check=False)
            host.uts.unlink(missing_ok=True)
            shutil.rmtree(ETC_NETNS / host.netns, ignore_errors=True)
        if failures:
            raise ClusterError("; ".join(failures))


def require_cluster() -> None:
    """Skip the calling test when clusters cannot be built here; fail it under CI."""
    ok, reason = cluster_available()
    if not ok:
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"CI must run cluster tests: {reason}", pytrace=False)
        pytest.skip(reason)


@pytest.fixture
def cluster_factory() -> Iterator[Callable[..., Cluster]]:
    """``make(n_hosts, **kwargs) -> Cluster``; every cluster made is closed at teardown."""
    require_cluster()
    made: list[Cluster] = []

    def make(n_hosts: int, **kwargs: Any) -> Cluster:
        made.append(Cluster(n_hosts, **kwargs))
        return made[-1]

    yield make
    for cluster in made:
        cluster.close()
