"""A node's fingerprint and how mismatches are named."""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import sys
from pathlib import Path

import pytest
from elastic.core.rendezvous.fingerprint import (
    FIELDS,
    describe_differences,
    differences,
    node_fingerprint,
    parse_allowed,
)


def fingerprint_of(script: Path, nproc: int = 2) -> dict[str, str]:
    return node_fingerprint(
        nproc_per_node=nproc, entrypoint=str(script), script=str(script), max_restarts=3
    )


def test_fingerprint_reads_versions_without_importing_torch(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    fp = fingerprint_of(script)
    assert set(fp) == set(FIELDS)
    assert fp["torch"] == md.version("torch")
    assert fp["python"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert fp["script_sha256"] == hashlib.sha256(b"print(1)\n").hexdigest()
    assert fp["nproc_per_node"] == "2"
    assert fp["max_restarts"] == "3"


def test_differences_name_each_field_with_both_values(tmp_path: Path) -> None:
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("x = 2\n")
    job, mine = fingerprint_of(a, nproc=2), fingerprint_of(b, nproc=3)
    mine["entrypoint"] = job["entrypoint"]
    diffs = differences(job, mine)
    assert set(diffs) == {"nproc_per_node", "script_sha256"}
    assert diffs["nproc_per_node"] == ("2", "3")
    message = describe_differences(diffs)
    assert "nproc_per_node: job has '2', this node has '3'" in message
    assert differences(job, mine, allowed={"nproc_per_node", "script_sha256"}) == {}


def test_allow_mismatch_rejects_unknown_fields() -> None:
    assert parse_allowed("script_sha256, torch") == {"script_sha256", "torch"}
    assert parse_allowed(None) == frozenset()
    with pytest.raises(ValueError, match="unknown field"):
        parse_allowed("scrpt")
