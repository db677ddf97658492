"""What a node must share with the rest of its job, and how two nodes differ.

Each join carries this node's fingerprint; the first node's becomes the job's. A node that
differs in a field the user did not allow (``--rdzv-conf allow_mismatch=FIELD,...``) is
refused at the door instead of failing minutes later inside a collective.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping

from elastic.core.plugin import installed

VERSION_FIELDS = ("elastic", "torch", "python")  # what `elastic status` shows per member
FIELDS = (
    "elastic",
    "torch",
    "python",
    "nproc_per_node",
    "entrypoint",
    "script_sha256",
    "max_restarts",
)


def installed_version(distribution: str) -> str:
    """A distribution's version from its metadata: no import, so no torch import cost."""
    return installed.version(distribution) or "not installed"


def file_sha256(path: str) -> str:
    import hashlib  # here: a standalone agent, which has no fingerprint, never loads it

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 16), b""):
            digest.update(block)
    return digest.hexdigest()


def node_fingerprint(
    *, nproc_per_node: int, entrypoint: str, script: str | None, max_restarts: int
) -> dict[str, str]:
    """``script`` is the training script's path, or None for ``-m``/``--no-python``."""
    from elastic import __version__

    return {
        "elastic": __version__,
        "torch": installed_version("torch"),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "nproc_per_node": str(nproc_per_node),
        "entrypoint": entrypoint,
        "script_sha256": file_sha256(script) if script else "",
        "max_restarts": str(max_restarts),
    }


def parse_allowed(value: str | None) -> frozenset[str]:
    """``allow_mismatch=script_sha256,torch`` -> the fields; unknown names are an error."""
    fields = frozenset(f.strip() for f in (value or "").split(",") if f.strip())
    unknown = sorted(fields - set(FIELDS))
    if unknown:
        raise ValueError(
            f"allow_mismatch names unknown field(s) {', '.join(unknown)}; "
            f"fields: {', '.join(FIELDS)}"
        )
    return fields


def differences(
    job: Mapping[str, str], mine: Mapping[str, str], allowed: Iterable[str] = ()
) -> dict[str, tuple[str, str]]:
    """Each field whose value differs and is not allowed to: name -> (job's, this node's)."""
    skip = set(allowed)
    return {
        name: (job.get(name, ""), mine.get(name, ""))
        for name in FIELDS
        if name not in skip and job.get(name, "") != mine.get(name, "")
    }


def describe_differences(diffs: Mapping[str, tuple[str, str]]) -> str:
    parts = [
        f"{name}: job has {theirs!r}, this node has {ours!r}"
        for name, (theirs, ours) in diffs.items()
    ]
    return "this node does not match the job (" + "; ".join(parts) + ")"
