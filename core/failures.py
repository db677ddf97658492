"""Failure records: one per failed worker, published job-wide so every node agrees on
the root cause. Plain data and JSON; rendering belongs to the errors plugin."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class FailureRecord:
    """One worker's failure as its agent saw it.

    ``timestamp`` is unix time with sub-second precision: the time the worker's error
    file says it failed, else the time its agent saw it exit.
    """

    role: str
    rank: int
    local_rank: int
    host: str
    pid: int | None
    exit_code: int
    timestamp: float
    node_id: str = ""
    group_rank: int | None = None
    attempt: int = 0
    signal: str | None = None  # e.g. "SIGKILL" when the worker died by a signal
    message: str = ""
    traceback: str = ""
    error_file: str | None = None
    stdout_path: str | None = None
    stderr_path: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> FailureRecord:
        data = json.loads(text)
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class FailureSummary:
    """A failed run: the job-wide root cause first, then every other failure."""

    run_id: str
    root_cause: FailureRecord
    others: list[FailureRecord] = field(default_factory=list)
    exit_code: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "exit_code": self.exit_code,
            "root_cause": asdict(self.root_cause),
            "others": [asdict(r) for r in self.others],
        }
