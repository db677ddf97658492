"""``elastic run --dry-run``: the launch as it would be, printed instead of started.

Every option is parsed and checked as for a real run (a mistake is still one line and
exit 2), so what is printed is what the agent would use: the node count, this node's
rank, the rendezvous backend and endpoint, the run id, the workers per node and the
command, each value SLURM gave marked with where it came from (``cli/slurm.py``).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from elastic.cli.slurm import Taken
from elastic.core.launch.config import LaunchConfig

# Each printed row and the option dests that may have filled it.
ROW_SOURCES = {
    "nodes": ("nnodes",),
    "node rank": ("node_rank",),
    "backend": ("rdzv_backend",),
    "endpoint": ("rdzv_endpoint", "master_addr", "master_port"),
    "run id": ("rdzv_id",),
}


def plan_lines(
    config: LaunchConfig,
    entrypoint: Any,
    args: Sequence[str],
    taken: Mapping[str, Taken],
) -> list[str]:
    """What ``--dry-run`` prints: one row per decision, ``from ...`` where SLURM gave it."""
    nodes = str(config.min_nodes)
    if config.max_nodes != config.min_nodes:
        nodes += f":{config.max_nodes}"
    rank = "-" if config.node_rank is None else str(config.node_rank)
    if config.node_rank is None and not config.standalone:
        rank = "given by the rendezvous"
    command = entrypoint if isinstance(entrypoint, str) else getattr(entrypoint, "__name__", "")
    values = {
        "nodes": nodes,
        "node rank": "0" if config.standalone else rank,
        "backend": config.rdzv_backend,
        "endpoint": config.rdzv_endpoint or "-",
        "run id": config.run_id,
        "nproc per node": str(config.nproc_per_node),
        "command": shlex.join([command, *args]),
    }
    lines = ["elastic run --dry-run: this launch (nothing started)"]
    for row, value in values.items():
        sources = [taken[dest].source for dest in ROW_SOURCES.get(row, ()) if dest in taken]
        origin = f"  (from {'; '.join(dict.fromkeys(sources))})" if sources else ""
        lines.append(f"  {row + ':':<16}{value}{origin}")
    return lines
