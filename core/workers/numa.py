"""``--numa-binding``: torchrun 2.13's modes (``torch/numa/binding.py``), computed from
sysfs in the agent and applied in each worker before it runs (``sched_setaffinity`` in
the child, which is what torch's ``numactl --physcpubind=...`` does; no numactl needed).
The agent itself is never bound.

Worker ``local_rank`` belongs to GPU ``local_rank`` (torch's rule) and so to that GPU's
NUMA node (its PCI device's ``numa_node``; -1, a one-node machine, is node 0):

- ``node``: every allowed CPU of that node;
- ``socket``: every allowed CPU of the nodes on that node's socket;
- ``exclusive``: the node's physical cores split evenly among the GPUs on it (the lower
  GPU indices get one more when it does not divide), all hyperthreads of each core;
- ``core-complex``: one group of CPUs sharing the last-level cache per GPU, the largest
  first, round robin.

Where torch needs CUDA (it asks ``torch.cuda`` where each GPU is), this reads NVIDIA and
AMD GPUs from sysfs (``devices.py``). On a node without GPUs, local rank ``r`` is placed
on the ``r mod N``-th of the N NUMA nodes that have allowed CPUs, and the ranks placed on
one node share it in ``exclusive`` and ``core-complex`` as GPUs would (torch refuses to
bind without a GPU).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping

from elastic.core.workers.devices import read_text, sys_root, visible_gpus

MODES = ("node", "socket", "exclusive", "core-complex")


class NumaBindingError(ValueError):
    """The binding cannot be computed on this node (one line, names what is missing)."""


def parse_cpu_list(text: str) -> set[int]:
    """``"0-2,4"`` -> ``{0, 1, 2, 4}`` (sysfs's list format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


class Topology:
    """The node's NUMA nodes, sockets, cores and caches, read from ``root`` (``/sys``)."""

    def __init__(self, root: str, allowed: set[int]) -> None:
        self.root = root
        self.allowed = allowed

    def _path(self, relative: str) -> str:
        return os.path.join(self.root, relative)

    def _list(self, path: str) -> set[int]:
        try:
            return parse_cpu_list(read_text(path))
        except (OSError, ValueError):
            raise NumaBindingError(f"cannot read {path}") from None

    def nodes(self) -> list[int]:
        possible = self._list(self._path("devices/system/node/possible"))
        return sorted(n for n in possible if self.node_cpus(n, missing_ok=True))

    def node_cpus(self, node: int, missing_ok: bool = False) -> set[int]:
        path = self._path(f"devices/system/node/node{node}/cpulist")
        if missing_ok and not os.path.exists(path):
            return set()
        return self._list(path) & self.allowed

    def socket(self, cpu: int) -> int:
        path = self._path(f"devices/system/cpu/cpu{cpu}/topology/physical_package_id")
        try:
            return int(read_text(path))
        except (OSError, ValueError):
            raise NumaBindingError(f"cannot read {path}") from None

    def core(self, cpu: int) -> int:
        """A physical core, named by its lowest hyperthread."""
        return min(
            self._list(self._path(f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"))
        )

    def last_level_cache(self, cpu: int) -> int:
        """The CPUs sharing ``cpu``'s highest-level data cache, named by the lowest."""
        base = self._path(f"devices/system/cpu/cpu{cpu}/cache")
        best, shared = -1, {cpu}
        for entry in sorted(os.listdir(base)) if os.path.isdir(base) else []:
            if not entry.startswith("index"):
                continue
            try:
                kind = read_text(os.path.join(base, entry, "type")).strip()
                level = int(read_text(os.path.join(base, entry, "level")))
            except (OSError, ValueError):
                continue
            if kind in ("Unified", "Data") and level > best:
                best, shared = level, self._list(os.path.join(base, entry, "shared_cpu_list"))
        return min(shared)

    def gpu_node(self, pci: str) -> int:
        path = self._path(f"bus/pci/devices/{pci}/numa_node")
        try:
            return max(int(read_text(path)), 0)
        except (OSError, ValueError):
            raise NumaBindingError(f"cannot read {path} (the NUMA node of GPU {pci})") from None


def _placement(topo: Topology, nproc: int, environ: Mapping[str, str]) -> list[int]:
    """The NUMA node of each local rank."""
    gpus = visible_gpus(environ)
    if not gpus:
        nodes = topo.nodes()
        if not nodes:
            raise NumaBindingError("no NUMA node with CPUs this agent may use")
        return [nodes[rank % len(nodes)] for rank in range(nproc)]
    if nproc > len(gpus):
        raise NumaBindingError(
            f"{nproc} workers but {len(gpus)} visible GPUs: each worker binds near GPU LOCAL_RANK"
        )
    if any(not gpu.pci for gpu in gpus):
        raise NumaBindingError("GPUs named by UUID in *_VISIBLE_DEVICES cannot be placed")
    return [topo.gpu_node(gpus[rank].pci) for rank in range(nproc)]


def _share(groups: list[set[int]], index: int, count: int, node: int) -> set[int]:
    """``index``'s share of ``groups`` among ``count`` users, as torch splits cores."""
    per, extra = divmod(len(groups), count)
    if per < 1:
        raise NumaBindingError(
            f"NUMA node {node} has {len(groups)} physical cores for {count} workers"
        )
    start = index * per + min(index, extra)
    end = start + per + (1 if index < extra else 0)
    return set().union(*groups[start:end])


def plan(mode: str, nproc: int, environ: Mapping[str, str] | None = None) -> list[set[int]]:
    """The CPUs of each local rank under ``mode``; ``NumaBindingError`` if it cannot be."""
    env = os.environ if environ is None else environ
    if mode not in MODES:
        raise NumaBindingError(f"{mode!r} is not a mode; expected one of {', '.join(MODES)}")
    topo = Topology(sys_root(env), os.sched_getaffinity(0))
    nodes = _placement(topo, nproc, env)
    # A GPU's neighbours on its node: all the node's GPUs (torch), or the ranks placed there.
    gpus = visible_gpus(env)
    owners = [topo.gpu_node(g.pci) for g in gpus] if gpus else nodes
    plans = []
    for rank, node in enumerate(nodes):
        cpus = topo.node_cpus(node)
        if mode == "socket":
            sock = topo.socket(min(cpus)) if cpus else -1
            for other in topo.nodes():
                if topo.socket(min(topo.node_cpus(other))) == sock:
                    cpus |= topo.node_cpus(other)
        elif mode in ("exclusive", "core-complex"):
            peers = [i for i, n in enumerate(owners) if n == node]
            index = peers.index(rank)
            by: dict[int, set[int]] = defaultdict(set)
            key = topo.core if mode == "exclusive" else topo.last_level_cache
            for cpu in cpus:
                by[key(cpu)].add(cpu)
            if mode == "exclusive":
                cpus = _share([by[k] for k in sorted(by)], index, len(peers), node)
            else:
                groups = sorted(by.items(), key=lambda item: (-len(item[1]), item[0]))
                cpus = groups[index % len(groups)][1] if groups else set()
        if not cpus:
            raise NumaBindingError(f"no CPU this agent may use on NUMA node {node}")
        plans.append(cpus)
    return plans
