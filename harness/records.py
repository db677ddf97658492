"""JSON records that workers leave one per file (a start, a stop, a stamp), read back, and
``RANK_RECORD_WORKER``, the worker of the multi-host launch tests that leaves one per rank.

A worker writes each record whole (to a temporary name, then renamed) or at least once;
a reader polling the directory may still meet a file being written, so it skips what does
not parse and sees it on its next look.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# A gloo job's worker: one all_reduce of rank + 1 across the world, then
# ``<argv[1]>/rank<RANK>.json`` with its host, rank, world, group rank, run id and the sum.
RANK_RECORD_WORKER = """\
import datetime, json, os, socket, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
record = {
    "host": socket.gethostname(),
    "rank": int(os.environ["RANK"]),
    "world": int(os.environ["WORLD_SIZE"]),
    "group_rank": int(os.environ["GROUP_RANK"]),
    "run_id": os.environ["TORCHELASTIC_RUN_ID"],
    "sum": total.item(),
}
with open(os.path.join(sys.argv[1], f"rank{record['rank']}.json"), "w") as f:
    json.dump(record, f)
dist.destroy_process_group()
"""


def read_records(directory: Path, pattern: str) -> list[dict[str, Any]]:
    """Every record in ``directory`` whose file name matches ``pattern`` (a glob), oldest
    first by its ``"t"``; files that cannot be read or parsed yet are left out."""
    records = []
    for path in directory.glob(pattern):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(records, key=lambda r: r["t"])
