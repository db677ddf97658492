"""The network-namespace cluster harness, on real namespaces: names, addresses, reachability,
cuts, partitions, latency, killing and teardown."""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
from collections.abc import Callable

import pytest
from elastic.harness.cluster import (
    ETC_NETNS,
    SUPERNET,
    Cluster,
    ClusterError,
    Host,
    netem_available,
    sweep_stale,
)
from elastic.harness.processes import pid_alive
from elastic.testing.waits import wait_until

Make = Callable[..., Cluster]
PORT = 7000

ECHO_SERVER = """
import socket, sys, threading
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
def echo(conn):
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)
while True:
    threading.Thread(target=echo, args=(server.accept()[0],), daemon=True).start()
"""

# Connects, then echoes a few bytes `rounds` times; prints "ok <peer address> <median rtt ms>"
# or the way the connect failed ("timeout", "ConnectionRefusedError", ...).
PROBE = """
import socket, statistics, sys, time
target, port, timeout, rounds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
try:
    sock = socket.create_connection((target, port), timeout=timeout)
except TimeoutError:
    print("timeout")
    sys.exit()
except OSError as exc:
    print(type(exc).__name__)
    sys.exit()
sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(rounds):
    start = time.monotonic()
    sock.sendall(b"ping")
    assert sock.recv(4) == b"ping"
    rtts.append((time.monotonic() - start) * 1000)
print("ok", sock.getpeername()[0], statistics.median(rtts))
"""

# A connection made before a cut: echoes once, then on each stdin line sends a byte and
# prints whether its echo came back within the timeout given on that line.
HELD = """
import socket, sys
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
sock.sendall(b"a")
assert sock.recv(1) == b"a"
print("connected", flush=True)
pending = 0
for line in sys.stdin:
    sock.settimeout(float(line))
    if not pending:
        sock.sendall(b"b")
        pending = 1
    try:
        pending -= len(sock.recv(1))
        print("echoed", flush=True)
    except TimeoutError:
        print("stalled", flush=True)
"""


def echo_server(host: Host, bind: str = "0.0.0.0", port: int = PORT) -> subprocess.Popen[str]:
    server = host.popen(
        [sys.executable, "-c", ECHO_SERVER, bind, str(port)], stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None and server.stdout.readline() == "listening\n"
    return server


def probe(
    client: Host, target: str, port: int = PORT, timeout: float = 5, rounds: int = 1
) -> list[str]:
    cmd = [sys.executable, "-c", PROBE, target, str(port), str(timeout), str(rounds)]
    result = client.run(cmd, timeout=timeout + 20)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def median_rtt(client: Host, target: Host) -> float:
    outcome = probe(client, target.name, rounds=7)
    assert outcome[0] == "ok", outcome
    return float(outcome[2])


def netns_list() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def pids_in_netns(name: str) -> list[int]:
    netns = os.stat(f"/run/netns/{name}").st_ino
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino == netns:
                pids.append(int(pid))
        except OSError:
            continue
    return pids


def root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    return {line.split(":")[1].strip() for line in out.stdout.splitlines()}


@pytest.mark.timeout(30)
def test_hosts_have_their_own_names_and_only_a_benchmark_address(cluster_factory: Make) -> None:
    links_before = root_links()
    cluster = cluster_factory(3)
    names = [host.run(["hostname"], check=True).stdout.strip() for host in cluster.hosts]
    assert names == [host.name for host in cluster.hosts]
    assert len(set(names)) == 3 and len({host.addr for host in cluster.hosts}) == 3
    assert cluster.subnet.subnet_of(SUPERNET)  # type: ignore[arg-type]
    for host in cluster.hosts:
        assert ipaddress.ip_address(host.addr) in cluster.subnet
        addrs = host.run(["ip", "-o", "addr"], check=True).stdout.split("\n")
        listed = {line.split()[3] for line in addrs if line}
        assert listed == {"127.0.0.1/8", "::1/128", f"{host.addr}/24"}
    bridge = subprocess.run(["ip", "-n", cluster.switch, "-o", "addr"], capture_output=True)
    assert bridge.returncode == 0 and bridge.stdout == b""
    assert root_links() == links_before


@pytest.mark.timeout(30)
def test_hosts_reach_each_other_by_name_and_localhost_is_their_own(cluster_factory: Make) -> None:
    a, b = cluster_factory(2).hosts
    echo_server(a)
    assert probe(b, a.name)[:2] == ["ok", a.addr]
    assert probe(a, b.name) == ["ConnectionRefusedError"]  # b reached; nothing listens there
    echo_server(a, bind="127.0.0.1", port=PORT + 1)
    assert probe(a, "localhost", port=PORT + 1)[:2] == ["ok", "127.0.0.1"]
    assert probe(b, "localhost", port=PORT + 1) == ["ConnectionRefusedError"]
    assert probe(b, "example.invalid") == ["gaierror"]


@pytest.mark.timeout(40)
def test_cut_blackholes_a_live_host_until_heal(cluster_factory: Make) -> None:
    cluster = cluster_factory(2)
    a, b = cluster.hosts
    server = echo_server(a)
    held = b.popen(
        [sys.executable, "-c", HELD, a.name, str(PORT)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert held.stdin is not None and held.stdout is not None
    assert held.stdout.readline() == "connected\n"

    cluster.cut(a)
    assert probe(b, a.name, timeout=1.5) == ["timeout"]
    held.stdin.write("1.5\n")
    held.stdin.flush()
    assert held.stdout.readline() == "stalled\n"  # no RST, no error: just silence
    assert server.poll() is None

    cluster.heal(a)
    assert probe(b, a.name)[0] == "ok"
    held.stdin.write("15\n")  # the unanswered byte goes out on the next retransmission
    held.stdin.flush()
    assert held.stdout.readline() == "echoed\n"


@pytest.mark.timeout(30)
def test_partition_drops_traffic_between_groups_only(cluster_factory: Make) -> None:
    cluster = cluster_factory(3)
    a, b, c = cluster.hosts
    for host in cluster.hosts:
        echo_server(host)
    cluster.partition([a], [b, c])
    assert probe(b, a.name, timeout=1) == ["timeout"]
    assert probe(a, c.name, timeout=1) == ["timeout"]
    assert probe(b, c.name)[0] == "ok"
    cluster.heal()
    assert probe(b, a.name)[0] == "ok" and probe(a, c.name)[0] == "ok"


@pytest.mark.timeout(40)
@pytest.mark.parametrize("shaper", ["auto", "relay"])  # auto: netem where the kernel has it
def test_latency_raises_round_trip_until_cleared(cluster_factory: Make, shaper: str) -> None:
    cluster = cluster_factory(2, shaper=shaper)
    assert cluster.shaper == ("netem" if shaper == "auto" and netem_available() else "relay")
    a, b = cluster.hosts
    echo_server(a)
    before = median_rtt(b, a)
    cluster.latency(a, 100)
    delayed = median_rtt(b, a)
    cluster.clear_latency(a)
    after = median_rtt(b, a)
    # Relative bounds, as a loaded machine inflates every round trip; none is below 100 ms
    # with the delay on.
    assert delayed >= 99 and before < delayed - 60 and after < delayed - 60


@pytest.mark.timeout(30)
def test_netem_is_used_when_asked_or_refused_in_one_line(cluster_factory: Make) -> None:
    if netem_available():
        assert cluster_factory(1, shaper="netem").shaper == "netem"
    else:
        with pytest.raises(ClusterError, match="no tc netem.*shaper='relay'"):
            cluster_factory(1, shaper="netem")


@pytest.mark.timeout(30)
def test_kill_leaves_no_process_on_the_host_and_spares_others(cluster_factory: Make) -> None:
    a, b = cluster_factory(2).hosts
    a.popen(["sleep", "600"])
    a.popen(["sh", "-c", "sleep 600 & sleep 600"])
    a.popen(["setsid", "sleep", "600"])  # leaves the group kill would signal
    bystander = b.popen(["sleep", "600"])
    assert wait_until(lambda: len(a.processes()) >= 4, timeout=10), a.processes()
    started = {pid: start_time(pid) for pid in a.processes()}

    a.kill()
    assert a.processes() == []
    # The same processes, not their numbers: the suite's other tests make threads and
    # processes fast enough to take a freed number (pid_max can be 32768) at once.
    assert not [p for p, t in started.items() if pid_alive(p) and start_time(p) == t]
    assert bystander.poll() is None


def start_time(pid: int) -> str | None:
    """When ``pid`` started (``/proc/<pid>/stat`` field 22), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[19]
    except OSError:
        return None


@pytest.mark.timeout(30)
def test_teardown_after_an_exception_leaves_nothing(cluster_factory: Make) -> None:
    with pytest.raises(RuntimeError, match="test body failed"):
        with Cluster(2) as cluster:
            started = [host.popen(["sleep", "600"]) for host in cluster.hosts]
            cluster.latency(cluster.hosts[0], 10)
            namespaces = cluster.namespaces
            assert wait_until(lambda: all(h.processes() for h in cluster.hosts), timeout=10)
            pids = [pid for host in cluster.hosts for pid in host.processes()]
            pids += pids_in_netns(cluster.switch)  # the delay relay
            assert len(pids) == 3
            raise RuntimeError("test body failed")
    assert len(namespaces) == 3 and not netns_list() & set(namespaces)
    assert not any((ETC_NETNS / ns).exists() for ns in namespaces)
    assert not any(host.uts.exists() for host in cluster.hosts)
    assert all(proc.poll() is not None for proc in started)
    assert not any(pid_alive(pid) for pid in pids)
    cluster.close()  # idempotent


@pytest.mark.timeout(30)
def test_two_clusters_at_once_do_not_collide(cluster_factory: Make) -> None:
    first, second = cluster_factory(2), cluster_factory(2)
    assert not set(first.namespaces) & set(second.namespaces)
    assert first.subnet != second.subnet
    assert not {h.name for h in first.hosts} & {h.name for h in second.hosts}
    for cluster in (first, second):
        a, b = cluster.hosts
        echo_server(a)
        assert probe(b, a.name)[:2] == ["ok", a.addr]
    assert probe(second.hosts[1], first.hosts[0].addr, timeout=1)[0] != "ok"


@pytest.mark.timeout(30)
def test_sweep_removes_leftovers_of_a_dead_creator_only(cluster_factory: Make) -> None:
    live = cluster_factory(1)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"elc{dead.pid}c0h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    (ETC_NETNS / stale).mkdir(parents=True)
    (ETC_NETNS / stale / "hosts").write_text("198.18.0.1 ghost\n")
    orphan = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "600"])
    try:
        assert wait_until(lambda: orphan.pid in pids_in_netns(stale))
        sweep_stale()  # (a concurrent cluster's own sweep may beat this one to it)
        assert orphan.wait(timeout=10) != 0
        assert stale not in netns_list() and not (ETC_NETNS / stale).exists()
        assert set(live.namespaces) <= netns_list()
        assert live.hosts[0].run(["hostname"]).stdout.strip() == live.hosts[0].name
    finally:
        orphan.kill()
        orphan.wait()
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
        shutil.rmtree(ETC_NETNS / stale, ignore_errors=True)
