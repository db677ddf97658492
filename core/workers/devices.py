"""This node's GPUs, found without importing torch: NVIDIA through its driver's
``/proc/driver/nvidia/gpus``, AMD through the ROCm kernel driver's KFD topology
(``/sys/class/kfd/kfd/topology/nodes/*/properties``: a node with ``simd_count > 0`` is a
GPU, the others are CPUs). What the workers may see follows the variables their runtime
reads: ``CUDA_VISIBLE_DEVICES`` (CUDA, and HIP too), ``ROCR_VISIBLE_DEVICES`` (ROCm's
runtime, first) and then ``HIP_VISIBLE_DEVICES`` (HIP, indexes into what ROCr left).

``ELASTIC_SYSFS_ROOT`` (default ``/sys``) and ``ELASTIC_PROCFS_ROOT`` (default ``/proc``)
move the roots, for a node's topology copied elsewhere (and the tests').
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

ENV_SYSFS_ROOT = "ELASTIC_SYSFS_ROOT"
ENV_PROCFS_ROOT = "ELASTIC_PROCFS_ROOT"


class Gpu(NamedTuple):  # a named tuple: see AttemptEnd in core/agent/outcome.py
    vendor: str  # "nvidia" or "amd"
    pci: str  # "0000:3b:00.0", where the PCI device's numa_node is


# Paths are strings joined with os.path: every agent imports this module, and pathlib
# (with the urllib.parse and ipaddress it imports) would be a cost of every start.
def sys_root(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get(ENV_SYSFS_ROOT) or "/sys"


def _proc_root(environ: Mapping[str, str]) -> str:
    return environ.get(ENV_PROCFS_ROOT) or "/proc"


def read_text(path: str) -> str:
    """A sysfs or procfs file's text (``numa`` reads its topology files with it too)."""
    with open(path) as f:
        return f.read()


def _read(path: str) -> str | None:
    try:
        return read_text(path)
    except (OSError, UnicodeDecodeError):
        return None


def _nvidia(environ: Mapping[str, str]) -> list[Gpu]:
    try:
        names = os.listdir(os.path.join(_proc_root(environ), "driver", "nvidia", "gpus"))
    except OSError:
        return []
    return [Gpu("nvidia", name.lower()) for name in sorted(names)]  # PCI bus order


def _kfd_properties(text: str) -> dict[str, int]:
    values = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        try:
            values[key] = int(value.strip())
        except ValueError:
            continue
    return values


def _amd(environ: Mapping[str, str]) -> list[Gpu]:
    nodes = os.path.join(sys_root(environ), "class", "kfd", "kfd", "topology", "nodes")
    try:
        ids = sorted(int(n) for n in os.listdir(nodes) if n.isdigit())
    except OSError:
        return []
    gpus = []
    for node in ids:  # KFD's node order is ROCm's device order
        props = _kfd_properties(_read(os.path.join(nodes, str(node), "properties")) or "")
        if props.get("simd_count", 0) <= 0:
            continue  # a CPU node
        loc = props.get("location_id", 0)  # bus << 8 | device << 3 | function
        pci = f"{props.get('domain', 0):04x}:{loc >> 8:02x}:{(loc >> 3) & 0x1F:02x}.{loc & 7}"
        gpus.append(Gpu("amd", pci))
    return gpus


def _select(gpus: list[Gpu], value: str | None) -> list[Gpu]:
    """The devices a ``*_VISIBLE_DEVICES`` list leaves, in its order. An index picks by
    position; the list ends at an empty or out-of-range entry (``-1``: none), as the
    runtimes read it; a UUID counts as a visible device with no known PCI slot."""
    if value is None:
        return gpus
    picked = []
    for entry in value.split(","):
        entry = entry.strip()
        if not entry:
            break
        if entry.lstrip("-").isdigit():
            index = int(entry)
            if not 0 <= index < len(gpus):
                break  # the runtimes ignore the rest of the list
            picked.append(gpus[index])
        else:  # a UUID (GPU-..., or ROCm's hex id): visible, but not matched to a PCI slot
            picked.append(Gpu(gpus[0].vendor if gpus else "unknown", ""))
    return picked


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[Gpu]:
    """The GPUs this node's workers see, in the order they number them."""
    env = os.environ if environ is None else environ
    nvidia = _nvidia(env)
    if nvidia:
        return _select(nvidia, env.get("CUDA_VISIBLE_DEVICES"))
    amd = _amd(env)
    if amd:
        amd = _select(amd, env.get("ROCR_VISIBLE_DEVICES"))
        hip = env.get("HIP_VISIBLE_DEVICES", env.get("CUDA_VISIBLE_DEVICES"))
        return _select(amd, hip)
    return []


def count_gpus(environ: Mapping[str, str] | None = None) -> int:
    """How many GPUs the workers see. ``CUDA_VISIBLE_DEVICES`` with no driver to read
    (a container that hides ``/proc/driver/nvidia``) counts its entries, as before."""
    env = os.environ if environ is None else environ
    found = visible_gpus(env)
    if found:
        return len(found)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return 0
