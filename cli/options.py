"""torchrun's flags, defined once as reusable click decorators, and their parsers.

Every flag takes torchrun's dash and underscore spellings and can come from
``PET_<FLAG>`` in the environment (Kubeflow's PyTorchJob sets those); an explicit flag
wins. Parsers raise ``click.BadParameter`` with what is wrong and what is accepted.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click
from elastic.core.workers import devices

F = TypeVar("F", bound=Callable[..., Any])

STD_NAMES = "0 (none), 1 (stdout), 2 (stderr), 3 (both)"


def bad(option: str, message: str) -> click.BadParameter:
    """A bad value, reported under the option's name (click's one-line error)."""
    return click.BadParameter(message, param_hint=f"'{option}'")


def flag(*names: str, **kwargs: Any) -> Callable[[F], F]:
    """A torchrun flag: ``--dash-name`` plus ``--underscore_name`` plus ``PET_`` envvar."""
    long_names = [n for n in names if n.startswith("--")]
    spellings = list(names)
    for name in long_names:
        underscored = name.replace("-", "_").replace("__", "--", 1)
        if underscored not in spellings:
            spellings.append(underscored)
    dest = long_names[0][2:].replace("-", "_")
    kwargs.setdefault("envvar", f"PET_{dest.upper()}")
    kwargs.setdefault("show_envvar", False)
    return click.option(*spellings, dest, **kwargs)


def parse_nnodes(value: str) -> tuple[int, int]:
    parts = value.split(":")
    try:
        if len(parts) == 1:
            low = high = int(parts[0])
        elif len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not a node count; expected N or MIN:MAX (e.g. 2 or 1:4)"
        ) from None
    if low < 1:
        raise click.BadParameter(f"{value!r}: the node count must be at least 1")
    if low > high:
        raise click.BadParameter(f"{value!r}: MIN ({low}) must not exceed MAX ({high})")
    return low, high


def count_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


XPU_COUNT = "import torch; print(torch.xpu.device_count() if torch.xpu.is_available() else 0)"


def count_xpus() -> int:
    """Intel XPUs, counted as torchrun counts them (``torch.xpu.device_count()``) but in a
    child interpreter: the CLI never imports torch (the no-torch contract, and it costs
    seconds), so only ``--nproc-per-node xpu`` pays for that import, and only once."""
    try:
        result = subprocess.run(
            [sys.executable, "-c", XPU_COUNT], capture_output=True, text=True, timeout=300
        )
        return int(result.stdout.split()[-1]) if result.returncode == 0 else 0
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0


def parse_nproc_per_node(value: str) -> int:
    """torchrun's values: N, ``gpu``, ``xpu``, ``cpu``, ``auto`` (GPUs, NVIDIA or AMD, else
    CPUs: unlike torchrun, ``auto`` does not look for XPUs, which would import torch on
    every CPU run). GPUs are counted from the drivers (``core/workers/devices.py``)."""
    if value == "xpu":
        xpus = count_xpus()
        if xpus == 0:
            raise click.BadParameter("'xpu' was asked for but this machine has no visible XPU")
        return xpus
    if value == "gpu":
        gpus = devices.count_gpus()
        if gpus == 0:
            raise click.BadParameter("'gpu' was asked for but this machine has no visible GPU")
        return gpus
    if value == "cpu":
        return count_cpus()
    if value == "auto":
        return devices.count_gpus() or count_cpus()
    try:
        count = int(value)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not a process count; "
            "expected a positive integer, auto, cpu or gpu, or xpu for Intel GPUs"
        ) from None
    if count < 1:
        raise click.BadParameter(f"{value!r}: the process count must be a positive integer")
    return count


def parse_std(value: str, option: str) -> dict[int, int] | int:
    """``3`` (every local rank) or ``0:1,1:2`` (per local rank)."""
    if re.fullmatch(r"[0-3]", value):
        return int(value)
    if re.fullmatch(r"(\d+:[0-3],)*\d+:[0-3]", value):
        return {int(k): int(v) for k, v in (item.split(":") for item in value.split(","))}
    raise click.BadParameter(
        f"{option}={value!r}: expected one of {STD_NAMES}, or LOCAL_RANK:VALUE pairs like 0:3,1:2"
    )


def parse_rdzv_conf(value: str) -> dict[str, str]:
    """``k=v,k2=v2``; a bare item continues the previous value, so list-valued keys read
    naturally (``allow_mismatch=script_sha256,torch``)."""
    config: dict[str, str] = {}
    last: str | None = None
    for item in filter(None, (part.strip() for part in value.split(","))):
        key, sep, val = item.partition("=")
        if not sep and last is not None:
            config[last] += f",{item}"
            continue
        if not sep or not key.strip():
            raise click.BadParameter(
                f"{item!r} is not KEY=VALUE; expected --rdzv-conf KEY=VALUE[,KEY=VALUE...]"
            )
        last = key.strip()
        config[last] = val.strip()
    return config


def parse_endpoint(value: str, default_port: int | None) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]:port``; the port must be 0..65535."""
    from elastic.core.rendezvous.net import parse_endpoint as parse

    try:
        return parse(value, default_port)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def parse_local_ranks_filter(value: str) -> frozenset[int] | None:
    if not value:
        return None
    try:
        ranks = frozenset(int(r) for r in value.split(","))
    except ValueError:
        raise click.BadParameter(
            f"{value!r}: expected a comma-separated list of local ranks, e.g. 0,1"
        ) from None
    if any(r < 0 for r in ranks):
        raise click.BadParameter(f"{value!r}: local ranks are non-negative")
    return ranks


SIGNAL_NAMES = {"SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"}


def parse_signals(value: str) -> tuple[str, ...]:
    names = tuple(s.strip().upper() for s in value.split(",") if s.strip())
    unknown = [n for n in names if n not in SIGNAL_NAMES]
    if unknown:
        raise click.BadParameter(
            f"{', '.join(unknown)}: expected a comma-separated list of "
            f"{', '.join(sorted(SIGNAL_NAMES))}"
        )
    return names
