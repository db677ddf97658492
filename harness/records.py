"""JSON records that workers leave one per file (a start, a stop, a stamp), read back.

A worker writes each record whole (to a temporary name, then renamed) or at least once;
a reader polling the directory may still meet a file being written, so it skips what does
not parse and sees it on its next look.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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
