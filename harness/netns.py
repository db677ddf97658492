"""The primitives under ``elastic.harness.cluster``: running ip/tc commands, finding and
signalling the processes of a network namespace, probing whether namespaces can be made
here, sweeping what a crashed run left behind, and the relay that stands in for
``tc netem`` on kernels without it (run in the switch namespace as
``python -m elastic.harness.netns TAP DELAY_MS JITTER_MS LOSS_PCT``)."""

from __future__ import annotations

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
from collections.abc import Sequence
from pathlib import Path

NETNS_DIR = Path("/run/netns")
ETC_NETNS = Path("/etc/netns")
STATE_DIR = Path("/run/elastic-cluster")
SUPERNET = ipaddress.ip_network("198.18.0.0/15")
# "elc<pid>c<n>s<subnet>" is a switch, "elc<pid>c<n>h<i>" a host, "elc<pid>probe" a probe.
NAME = re.compile(r"^elc(?P<pid>\d+)(?:c\d+(?:s(?P<subnet>\d+)|h\d+)|probe)$")
# Below the partition filters (pref 1), so partitioned traffic is dropped, not delayed.
RELAY_FILTER = "parent ffff: protocol all pref 100"


class ClusterError(RuntimeError):
    pass


def run(cmd: Sequence[str], stdin: str | None = None, check: bool = True) -> None:
    """``check=False`` is for cleanup, where what is removed may already be gone."""
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        error = " ".join(proc.stderr.split())
        raise ClusterError(f"`{' '.join(cmd[:6])}...` failed: {error}")


def batch(tool: str, netns: str, lines: list[str]) -> None:
    """Run ``ip``/``tc`` command lines in ``netns`` with one process."""
    run([tool, "-n", netns, "-batch", "-"], stdin="\n".join(lines) + "\n")


def netns_id_of(netns: str) -> tuple[int, int] | None:
    try:
        st = os.stat(NETNS_DIR / netns)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def pids_in(netns_id: tuple[int, int] | None) -> list[int]:
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


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def signal_all(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@functools.cache
def probe() -> tuple[bool, str, bool]:
    """(usable, why not, kernel has netem), found once per process by trying for real."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return False, "network-namespace clusters need root on Linux", False
    missing = [tool for tool in ("ip", "tc", "unshare", "nsenter") if not shutil.which(tool)]
    if missing:
        return False, f"network-namespace clusters need {', '.join(missing)}", False
    netns = f"elc{os.getpid()}probe"
    try:
        run(["ip", "netns", "add", netns])
        batch("ip", netns, ["link add br0 type bridge", "link add p0 type veth peer name p1"])
        netem = ["tc", "-n", netns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]
        return True, "", subprocess.run(netem, capture_output=True).returncode == 0
    except (ClusterError, OSError) as exc:
        return False, f"cannot build a network-namespace cluster: {exc}", False
    finally:
        run(["ip", "netns", "del", netns], check=False)


def cluster_available() -> tuple[bool, str]:
    ok, reason, _ = probe()
    return ok, reason


def netem_available() -> bool:
    return probe()[2]


def sweep_stale() -> list[str]:
    """Remove namespaces, hosts files and UTS mounts whose creating process is dead, killing
    what still runs in them; returns the namespace names removed."""
    removed = []
    for path in [*NETNS_DIR.glob("elc*"), *ETC_NETNS.glob("elc*"), *STATE_DIR.glob("elc*")]:
        match = NAME.match(path.name.removesuffix(".uts"))
        if not match or running(int(match["pid"])):
            continue
        if path.parent == NETNS_DIR:
            signal_all(pids_in(netns_id_of(path.name)), signal.SIGKILL)
            run(["ip", "netns", "del", path.name], check=False)
            removed.append(path.name)
        elif path.parent == ETC_NETNS:
            shutil.rmtree(path, ignore_errors=True)
        else:
            run(["umount", "-l", str(path)], check=False)
            path.unlink(missing_ok=True)
    return removed


def relay(tap: str, delay_ms: float, jitter_ms: float, loss_pct: float) -> None:
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
    relay(sys.argv[1], *map(float, sys.argv[2:5]))
