"""elastic: a plugin-based, fault-tolerant, elastic launcher for PyTorch distributed training.

Importing ``elastic`` is cheap: the names below resolve lazily so that the CLI and the
agent never pay for torch. ``elastic.record`` and the training helpers import what they
need on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> "module:attribute", resolved on first access (PEP 562).
_LAZY = {
    "record": "elastic.plugins.errors.record:record",
    "State": "elastic.training.state:State",
    "train": "elastic.training.loop:train",
    "init_process_group": "elastic.training.dist:init_process_group",
    "put_metric": "elastic.core.metrics:put_metric",
}


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'elastic' has no attribute {name!r}")
    module_name, attr = target.split(":")
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
