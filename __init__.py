"""elastic: a plugin-based, fault-tolerant, elastic launcher for PyTorch distributed training.

Importing ``elastic`` is cheap: the names below resolve lazily so that the CLI and the
agent never pay for torch. ``elastic.record`` and the training helpers import what they
need on first use; nothing else here imports torch at all.

torch's programmatic API is here under torch's names: ``LaunchConfig``,
``elastic_launch``, ``launch_agent``, ``ChildFailedError``, ``WorkerSpec``,
``LocalElasticAgent``, ``RendezvousParameters``, ``register_rendezvous_handler``,
``get_rendezvous_handler``.

The package holds ``__main__`` (``python -m elastic``), ``cli`` (the ``elastic``
command), ``api`` (torch's programmatic API), ``core`` (the launcher itself: the agent,
the rendezvous, the workers, the plugin host), ``plugins`` (the built-in plugins),
``training`` (what worker processes import), ``testing`` (the plugin authors' kit) and
``harness`` (the suite's own harness, not in the wheel). Their order is contract
``product`` in ``pyproject.toml``: ``__main__`` and ``harness`` above ``cli``, then
``testing``, ``api``, ``plugins`` beside ``training``, and ``core`` at the bottom. This
module imports only the standard library; each name above resolves to its home on first
access.
"""

from __future__ import annotations

import importlib
from typing import Any

# The one source of the version: pyproject.toml reads it (``[tool.setuptools.dynamic]``)
# without importing the package, so ``elastic --version`` is right from a source tree.
__version__ = "0.1.0"

# name -> "module:attribute", resolved on first access (PEP 562). Type checkers read
# __init__.pyi beside this file instead, which imports each of these from its home (a
# TYPE_CHECKING block here would be read by import-linter as the facade importing torch
# and every room, closing circles through ``elastic``); tests/test_packaging.py keeps
# the two lists equal.
_LAZY = {
    "record": "elastic.plugins.errors.record:record",
    "State": "elastic.training.state:State",
    "train": "elastic.training.loop:train",
    "init_process_group": "elastic.training.dist:init_process_group",
    "put_metric": "elastic.core.metrics:put_metric",
    "heartbeat": "elastic.training.heartbeat:heartbeat",
    "checkpoint_requested": "elastic.training.preemption:checkpoint_requested",
    "checkpoint_saved": "elastic.training.preemption:checkpoint_saved",
    "membership_changed": "elastic.training.regroup:membership_changed",
    "regroup": "elastic.training.regroup:regroup",
    "tenured_rank": "elastic.training.tenure:tenured_rank",
    # torch's programmatic API (torch.distributed.launcher.api and .elastic)
    "LaunchConfig": "elastic.core.launch.config:LaunchConfig",
    "elastic_launch": "elastic.api:elastic_launch",
    "launch_agent": "elastic.api:launch_agent",
    "ChildFailedError": "elastic.api:ChildFailedError",
    "WorkerSpec": "elastic.core.interfaces.spec:WorkerSpec",
    "LocalElasticAgent": "elastic.core.agent.loop:LocalElasticAgent",
    "RunResult": "elastic.core.interfaces.spec:RunResult",
    "WorkerState": "elastic.core.interfaces.spec:WorkerState",
    "RendezvousParameters": "elastic.core.interfaces.rendezvous:RendezvousParameters",
    "RendezvousHandler": "elastic.core.interfaces.rendezvous:RendezvousHandler",
    "RendezvousError": "elastic.core.interfaces.rendezvous:RendezvousError",
    "register_rendezvous_handler": "elastic.core.rendezvous.registry:register_rendezvous_handler",
    "get_rendezvous_handler": "elastic.core.rendezvous.registry:get_rendezvous_handler",
    # for plugins
    "hookimpl": "elastic.core.plugin.hookspecs:hookimpl",
    "ElasticConfig": "elastic.core.plugin.config:ElasticConfig",
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
