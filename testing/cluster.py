"""Simulated multi-host clusters on one machine, for tests of nodes leaving a real network.

For backend authors
-------------------
Request the ``cluster_factory`` fixture (in ``tests/`` it comes with ``conftest.py``;
elsewhere add ``pytest_plugins = ["elastic.testing.cluster"]``)::

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
import functools
import heapq
import ipaddress
import itertools
import os
import random
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import pytest

NETNS_DIR = Path("/run/netns")
ETC_NETNS = Path("/etc/netns")
STATE_DIR = Path("/run/elastic-cluster")
SUPERNET = ipaddress.ip_network("198.18.0.0/15")
# "elc<pid>c<n>s<subnet>" is a switch, "elc<pid>c<n>h<i>" a host, "elc<pid>probe" a probe.
_NAME = re.compile(r"^elc(?P<pid>\d+)(?:c\d+(?:s(?P<subnet>\d+)|h\d+)|probe)$")
_clusters = itertools.count()
# Below the partition filters (pref 1), so partitioned traffic is dropped, not delayed.
_RELAY_FILTER = "parent ffff: protocol all pref 100"


class ClusterError(RuntimeError):
    pass


def _run(cmd: Sequence[str], stdin: str | None = None, check: bool = True) -> None:
    """``check=False`` is for cleanup, where what is removed may already be gone."""
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        error = " ".join(proc.stderr.split())
        raise ClusterError(f"`{' '.join(cmd[:6])}...` failed: {error}")


def _batch(tool: str, netns: str, lines: list[str]) -> None:
    """Run ``ip``/``tc`` command lines in ``netns`` with one process."""
    _run([tool, "-n", netns, "-batch", "-"], stdin="\n".join(lines) + "\n")


def _netns_id(netns: str) -> tuple[int, int] | None:
    try:
        st = os.stat(NETNS_DIR / netns)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _pids_in(netns_id: tuple[int, int] | None) -> list[int]:
    """Processes whose network namespace is ``netns_id`` (zombies have none, so are left out)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                st = os.stat(f"/proc/{entry}/ns/net")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == netns_id:
                pids.append(int(entry))
    return pids


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _signal(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@functools.cache
def _probe() -> tuple[bool, str, bool]:
    """(usable, why not, kernel has netem), found once per process by trying for real."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return False, "network-namespace clusters need root on Linux", False
    missing = [tool for tool in ("ip", "tc", "unshare", "nsenter") if not shutil.which(tool)]
    if missing:
        return False, f"network-namespace clusters need {', '.join(missing)}", False
    netns = f"elc{os.getpid()}probe"
    try:
        _run(["ip", "netns", "add", netns])
        _batch("ip", netns, ["link add br0 type bridge", "link add p0 type veth peer name p1"])
        netem = ["tc", "-n", netns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]
        return True, "", subprocess.run(netem, capture_output=True).returncode == 0
    except (ClusterError, OSError) as exc:
        return False, f"cannot build a network-namespace cluster: {exc}", False
    finally:
        _run(["ip", "netns", "del", netns], check=False)


def cluster_available() -> tuple[bool, str]:
    ok, reason, _ = _probe()
    return ok, reason


def netem_available() -> bool:
    return _probe()[2]


def sweep_stale() -> list[str]:
    """Remove namespaces, hosts files and UTS mounts whose creating process is dead, killing
    what still runs in them; returns the namespace names removed."""
    removed = []
    for path in [*NETNS_DIR.glob("elc*"), *ETC_NETNS.glob("elc*"), *STATE_DIR.glob("elc*")]:
        match = _NAME.match(path.name.removesuffix(".uts"))
        if not match or _running(int(match["pid"])):
            continue
        if path.parent == NETNS_DIR:
            _signal(_pids_in(_netns_id(path.name)), signal.SIGKILL)
            _run(["ip", "netns", "del", path.name], check=False)
            removed.append(path.name)
        elif path.parent == ETC_NETNS:
            shutil.rmtree(path, ignore_errors=True)
        else:
            _run(["umount", "-l", str(path)], check=False)
            path.unlink(missing_ok=True)
    return removed


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
        return sorted(started | set(_pids_in(self.netns_id)))

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
            seen.update(pids := _pids_in(self.netns_id))
            _signal(pids, sig)
            # A dying process leaves its namespaces before it is done exiting: wait for all.
            if sig != signal.SIGKILL or not (self.processes() or any(map(_running, seen))):
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
            taken = {m["subnet"] for m in map(_NAME.match, names) if m and m["subnet"]}
            index = next((i for i in range(512) if str(i) not in taken), None)
            if index is None:
                raise ClusterError("all 512 /24 subnets of 198.18.0.0/15 are in use")
            self.switch = f"{self.tag}s{index}"
            _run(["ip", "netns", "add", self.switch])
        self.subnet = ipaddress.ip_network((int(SUPERNET.network_address) + 256 * index, 24))
        pid_cluster = self.tag.removeprefix("elc")
        for i, addr in zip(range(n_hosts), self.subnet.hosts(), strict=False):
            self.hosts.append(Host(i, f"node{i}-{pid_cluster}", str(addr), f"{self.tag}h{i}"))
        _run(["ip", "-batch", "-"], stdin="".join(f"netns add {h.netns}\n" for h in self.hosts))
        # "addrgenmode none" (before "up", or it is too late): no IPv6 link-local address,
        # which would be an address outside 198.18.0.0/15.
        # Partitioned traffic is redirected to "drop", whose peer is down, so it vanishes.
        switch = ["link add br0 type bridge", "link set br0 addrgenmode none", "link set br0 up"]
        switch += ["link add drop type veth peer name drop-peer", "link set drop up"]
        for h in self.hosts:
            switch.append(f"link add p{h.index} type veth peer name eth0 netns {h.netns}")
            switch.append(f"link set p{h.index} addrgenmode none")
            switch.append(f"link set p{h.index} master br0 up")
        _batch("ip", self.switch, switch)
        _batch("tc", self.switch, [f"qdisc add dev p{h.index} ingress" for h in self.hosts])
        for host in self.hosts:
            host.netns_id = _netns_id(host.netns)
            lines = ["link set lo up", f"link set eth0 address {host.mac} addrgenmode none"]
            lines += [f"addr add {host.addr}/24 dev eth0", "link set eth0 up"]
            lines += [
                f"neigh replace {p.addr} lladdr {p.mac} dev eth0 nud permanent"
                for p in self.hosts
                if p is not host
            ]
            _batch("ip", host.netns, lines)
        hosts_file = "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n"
        hosts_file += "".join(f"{h.addr} {h.name}\n" for h in self.hosts)
        for host in self.hosts:
            etc = ETC_NETNS / host.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
            # Nothing listens on 127.0.0.1:53 in the host, so a DNS lookup fails at once.
            (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
            host.uts.touch()
            _run(["unshare", f"--uts={host.uts}", "hostname", host.name])

    def cut(self, host: Host) -> None:
        _batch("ip", self.switch, [f"link set p{host.index} down"])

    def heal(self, host: Host | None = None) -> None:
        """Undo ``cut(host)``; without a host, undo every cut and every partition."""
        ports = self.hosts if host is None else [host]
        _batch("ip", self.switch, [f"link set p{h.index} up" for h in ports])
        if host is None and self._partitioned:
            dels = [f"filter del dev p{i} parent ffff: pref 1" for i in self._partitioned]
            _batch("tc", self.switch, dels)
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
        _batch("tc", self.switch, lines)

    def latency(
        self, host: Host, delay_ms: float, jitter_ms: float = 0, loss_pct: float = 0
    ) -> None:
        """Delay what ``host`` sends by ``delay_ms`` ± ``jitter_ms`` and drop ``loss_pct``% of
        it, replacing any earlier setting."""
        self.clear_latency(host)
        if self.shaper == "netem":
            netem = f"delay {delay_ms}ms {jitter_ms}ms loss {loss_pct}%"
            _batch("tc", host.netns, [f"qdisc replace dev eth0 root netem {netem}"])
            self._shaped[host.index] = None
            return
        tap, args = f"d{host.index}", [str(delay_ms), str(jitter_ms), str(loss_pct)]
        relay = subprocess.Popen(
            ["ip", "netns", "exec", self.switch, sys.executable, "-m", __name__, tap, *args],
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
        _batch("ip", self.switch, [f"link set {tap} up"])
        redirect = f"u32 match u32 0 0 action mirred egress redirect dev {tap}"
        _batch("tc", self.switch, [f"filter add dev p{host.index} {_RELAY_FILTER} {redirect}"])

    def clear_latency(self, host: Host) -> None:
        if host.index not in self._shaped:
            return
        relay = self._shaped.pop(host.index)
        if relay is None:
            _batch("tc", host.netns, ["qdisc del dev eth0 root"])
            return
        # Unhook before stopping the relay: a redirect to a vanished tap would black-hole.
        _batch("tc", self.switch, [f"filter del dev p{host.index} {_RELAY_FILTER}"])
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
        _signal(_pids_in(_netns_id(self.switch)), signal.SIGKILL)  # delay relays
        for relay in self._shaped.values():
            if relay is not None:
                relay.communicate()
        for netns in self.namespaces:  # taking the veths with them
            _run(["ip", "netns", "del", netns], check=False)
        for host in self.hosts:
            _run(["umount", "-l", str(host.uts)], check=False)
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


def _relay(tap: str, delay_ms: float, jitter_ms: float, loss_pct: float) -> None:
    """Stand-in for netem, run in the switch: read the frames redirected to ``tap`` and
    send them into the bridge once their delay is up (it forwards them by MAC as before)."""
    tun = os.open("/dev/net/tun", os.O_RDWR)
    tunsetiff, iff_tap, iff_no_pi = 0x400454CA, 0x0002, 0x1000
    fcntl.ioctl(tun, tunsetiff, struct.pack("16sH", tap.encode(), iff_tap | iff_no_pi))
    sender = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    sender.bind(("br0", 0))
    print("ready", flush=True)
    queue: list[tuple[float, int, bytes]] = []
    for seq in itertools.count():
        wait = max(0.0, queue[0][0] - time.monotonic()) if queue else None
        if select.select([tun], [], [], wait)[0]:
            frame = os.read(tun, 65536)
            if random.random() * 100 >= loss_pct:
                delay = max(0.0, delay_ms + random.uniform(-jitter_ms, jitter_ms)) / 1000
                heapq.heappush(queue, (time.monotonic() + delay, seq, frame))
        while queue and queue[0][0] <= time.monotonic():
            try:
                sender.send(heapq.heappop(queue)[2])
            except OSError:  # e.g. ENOBUFS: the frame is lost, as on a congested wire
                pass


if __name__ == "__main__":
    _relay(sys.argv[1], *map(float, sys.argv[2:5]))
