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

import importlib.metadata as md
import os
from collections.abc import Callable
from typing import IO, Protocol, runtime_checkable

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

_registered: dict[str, CheckpointerFactory] = {}


class CheckpointerNotFoundError(LookupError):
    """No checkpointer has the requested name, or it cannot be loaded."""


def register_checkpointer(name: str, factory: CheckpointerFactory) -> None:
    """Register a checkpointer in-process (no entry point needed)."""
    _registered[name] = factory


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``"fs:/ckpt"`` -> ``("fs", "/ckpt")``; only the first colon splits."""
    name, sep, arg = spec.strip().partition(":")
    return name.strip(), (arg if sep else None)


def known_checkpointers() -> list[str]:
    return sorted({ep.name for ep in md.entry_points(group=GROUP)} | set(_registered))


def get_factory(name: str) -> CheckpointerFactory:
    """The factory for ``name``: in-process first, then that one entry point only."""
    if name in _registered:
        return _registered[name]
    candidates = list(md.entry_points(group=GROUP, name=name))
    if not candidates:
        known = ", ".join(known_checkpointers()) or "none"
        raise CheckpointerNotFoundError(
            f"unknown checkpointer {name!r}; known checkpointers: {known}"
        )
    if len(candidates) > 1:
        # Which one wins would depend on sys.path order: refuse rather than guess.
        origins = " and ".join(
            sorted(
                f"{ep.dist.metadata['Name']}=={ep.dist.version} ({ep.value})"
                if ep.dist
                else f"? ({ep.value})"
                for ep in candidates
            )
        )
        raise CheckpointerNotFoundError(f"checkpointer {name!r} is claimed by {origins}")
    try:
        return candidates[0].load()
    except Exception as exc:
        raise CheckpointerNotFoundError(
            f"checkpointer {name!r} ({candidates[0].value}) failed to load: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def validate_checkpoint_spec(spec: str) -> None:
    """Raise ValueError for an unknown name, reading metadata only (for the CLI)."""
    name, _arg = parse_spec(spec)
    if name not in known_checkpointers():
        known = ", ".join(known_checkpointers()) or "none"
        raise ValueError(f"unknown checkpointer {name!r}; known checkpointers: {known}")


def load_checkpointer(spec: str) -> Checkpointer:
    """Create the checkpointer for ``spec`` (``NAME`` or ``NAME:ARG``)."""
    name, arg = parse_spec(spec)
    return get_factory(name)(arg)


def checkpointer_from_env() -> Checkpointer | None:
    """The checkpointer named by ``ELASTIC_CHECKPOINT``, or None when it is unset."""
    spec = os.environ.get(ENV_CHECKPOINT, "").strip()
    return load_checkpointer(spec) if spec else None
