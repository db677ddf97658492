"""Checkpointers: where ``elastic.train`` (or any script) persists and finds its state.

A checkpointer is created by a factory in the ``elastic.checkpoint`` entry-point group,
called as ``factory(arg)`` with the text after ``NAME:`` (``fs:/ckpt`` -> ``"/ckpt"``).
The launcher's ``--checkpoint NAME:ARG`` reaches workers as ``ELASTIC_CHECKPOINT``;
a worker resolves just that one name from entry-point metadata (no plugin scan).

Checkpointers move bytes, not tensors: ``save`` hands the caller a binary stream to
write into (``State.save``), ``load_latest`` hands back a stream of the newest complete
checkpoint (``State.load``). So this module, like all of core/, never imports torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import IO, Protocol, runtime_checkable

from elastic.core.plugin.named import NamedPluginGroup, PluginNotFoundError

GROUP = "elastic.checkpoint"
ENV_CHECKPOINT = "ELASTIC_CHECKPOINT"  # e.g. "fs:/shared/ckpt", set by --checkpoint

Writer = Callable[[IO[bytes]], None]
Reader = Callable[[IO[bytes]], None]


@runtime_checkable
class Checkpointer(Protocol):
    """Persists opaque checkpoints numbered by step."""

    def save(self, step: int, write: Writer) -> None:
        """Persist a checkpoint for ``step``: call ``write(stream)`` once to fill it.

        Must be atomic: a crash at any point leaves either the complete checkpoint or
        nothing behind. May do nothing on ranks that do not write (e.g. only rank 0)."""
        ...

    def load_latest(self, read: Reader) -> int | None:
        """Call ``read(stream)`` with the newest complete checkpoint and return its
        step, or return None (without calling ``read``) when there is none."""
        ...


CheckpointerFactory = Callable[[str | None], Checkpointer]


class CheckpointerNotFoundError(PluginNotFoundError):
    """No checkpointer has the requested name, two claim it, or it cannot be loaded."""


CHECKPOINTERS: NamedPluginGroup[CheckpointerFactory] = NamedPluginGroup(
    GROUP, "checkpointer", "checkpointers", CheckpointerNotFoundError, ("fs",)
)


def register_checkpointer(name: str, factory: CheckpointerFactory) -> None:
    """Register a checkpointer in-process (no entry point needed)."""
    CHECKPOINTERS.register(name, factory)


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``"fs:/ckpt"`` -> ``("fs", "/ckpt")``; only the first colon splits."""
    name, sep, arg = spec.strip().partition(":")
    return name.strip(), (arg if sep else None)


def known_checkpointers() -> list[str]:
    return CHECKPOINTERS.names()


def get_factory(name: str) -> CheckpointerFactory:
    """The factory for ``name``: in-process first, then that one entry point only."""
    return CHECKPOINTERS.load(name)


def validate_checkpoint_spec(spec: str) -> str:
    """Raise ValueError (one line) for an unknown or doubly claimed name; returns
    ``spec``. Reads metadata only, so the CLI checks ``--checkpoint`` before starting."""
    try:
        CHECKPOINTERS.check(parse_spec(spec)[0])
    except CheckpointerNotFoundError as exc:
        raise ValueError(str(exc)) from None
    return spec


def load_checkpointer(spec: str) -> Checkpointer:
    """Create the checkpointer for ``spec`` (``NAME`` or ``NAME:ARG``)."""
    name, arg = parse_spec(spec)
    return get_factory(name)(arg)


def checkpointer_from_env() -> Checkpointer | None:
    """The checkpointer named by ``ELASTIC_CHECKPOINT``, or None when it is unset."""
    spec = os.environ.get(ENV_CHECKPOINT, "").strip()
    return load_checkpointer(spec) if spec else None
