"""Checkpointers: the fs checkpointer (atomic, checksummed, keeps last K, never loads a
partial file even when killed mid-save) and loading by name through entry points."""

from __future__ import annotations

import io
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from elastic.core import checkpoint as ckpt
from elastic.harness.distributions import make_distribution as make_dist
from elastic.plugins.checkpoint_fs.directory import HEADER, FsCheckpointer


def payload_for(step: int, size: int = 4096) -> bytes:
    return (f"step={step};".encode() * (size // 8 + 1))[:size]


def saver(data: bytes):  # noqa: ANN201
    return lambda stream: stream.write(data)


def load(c: ckpt.Checkpointer) -> tuple[int | None, bytes]:
    box = io.BytesIO()
    step = c.load_latest(lambda stream: box.write(stream.read()))
    return step, box.getvalue()


def test_roundtrip_and_keeps_last_k(tmp_path: Path) -> None:
    c = FsCheckpointer(tmp_path / "ck", keep=2, rank=0)
    assert load(c) == (None, b"")
    for step in (1, 2, 3, 10):
        c.save(step, saver(payload_for(step)))
    assert c.steps() == [10, 3]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "ckpt-000000000003.elastic",
        "ckpt-000000000010.elastic",
    ]
    assert load(c) == (10, payload_for(10))


def test_only_rank_zero_writes(tmp_path: Path) -> None:
    FsCheckpointer(tmp_path, rank=1).save(1, saver(b"x"))
    assert list(tmp_path.iterdir()) == []
    FsCheckpointer(tmp_path, rank=0).save(1, saver(b"x"))
    assert load(FsCheckpointer(tmp_path, rank=1)) == (1, b"x")  # every rank can load


def test_corrupt_or_truncated_newest_is_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    c = FsCheckpointer(tmp_path, keep=5, rank=0)
    for step in (1, 2, 3):
        c.save(step, saver(payload_for(step)))
    data = c.path_for(3).read_bytes()
    c.path_for(3).write_bytes(data[:-10])  # truncated
    raw = bytearray(c.path_for(2).read_bytes())
    raw[HEADER.size + 5] ^= 0xFF  # one flipped byte
    c.path_for(2).write_bytes(bytes(raw))
    (tmp_path / ".ckpt-4.12345.tmp").write_bytes(b"partial")  # a writer's leftover
    assert load(c) == (1, payload_for(1))
    assert capsys.readouterr().err.count("incomplete or corrupt") == 2


def test_writer_that_raises_leaves_nothing(tmp_path: Path) -> None:
    c = FsCheckpointer(tmp_path, rank=0)

    def bad(stream: io.RawIOBase) -> None:
        stream.write(b"half")
        raise RuntimeError("serialization failed")

    with pytest.raises(RuntimeError):
        c.save(1, bad)
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_of_dead_writer_is_cleaned(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".ckpt-7.{dead.pid}.tmp"
    stale.write_bytes(b"partial")
    FsCheckpointer(tmp_path, rank=0).save(8, saver(b"ok"))
    assert not stale.exists()


KILLED_WRITER = """
import sys, time
from elastic.plugins.checkpoint_fs.directory import FsCheckpointer

directory, size = sys.argv[1], int(sys.argv[2])
c = FsCheckpointer(directory, keep=3, rank=0)

def writer(step):
    chunk = (f"step={step};".encode() * 8192)
    def write(stream):
        left = size
        while left > 0:  # many small writes, slow enough to be killed in the middle
            piece = chunk[: min(left, len(chunk))]
            stream.write(piece)
            left -= len(piece)
    return write

step = int(sys.argv[3])
print("ready", flush=True)
while True:
    c.save(step, writer(step))
    step += 1
"""


def expected_payload(step: int, size: int) -> bytes:
    chunk = f"step={step};".encode() * 8192
    out = bytearray()
    while len(out) < size:
        out += chunk[: min(size - len(out), len(chunk))]
    return bytes(out)


def test_kill_during_save_never_loads_a_partial_file(tmp_path: Path) -> None:
    """SIGKILL a process that saves checkpoints back to back, at random moments: every
    checkpoint found afterwards is complete and exactly what was written for its step."""
    size = 3 * 1024 * 1024
    rng = random.Random(1234)
    directory = tmp_path / "ck"
    start_step = 1
    temps_seen = 0
    for _ in range(6):
        proc = subprocess.Popen(
            [sys.executable, "-c", KILLED_WRITER, str(directory), str(size), str(start_step)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        temps_seen += any(p.name.endswith(".tmp") for p in directory.iterdir())
        c = FsCheckpointer(directory, keep=3, rank=0)
        steps = c.steps()
        # keep=3, plus one when the kill fell between the rename and the pruning.
        assert len(steps) <= 4
        for step in steps:  # every final file is whole (not just the newest)
            assert c.read_payload(step) == expected_payload(step, size)
        step, data = load(c)
        if step is not None:
            assert data == expected_payload(step, size)
            start_step = step + 1
    # The kills did land mid-save at least once (a temp file was left behind), and the
    # next writer cleaned such leftovers up.
    assert temps_seen >= 1
    assert sum(p.name.endswith(".tmp") for p in directory.iterdir()) <= 1


def test_load_fs_by_name_and_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = ckpt.load_checkpointer(f"fs:{tmp_path}")
    assert isinstance(c, FsCheckpointer) and c.directory == tmp_path
    monkeypatch.delenv("ELASTIC_CHECKPOINT", raising=False)
    assert ckpt.checkpointer_from_env() is None
    monkeypatch.setenv("ELASTIC_CHECKPOINT", f"fs:{tmp_path / 'env'}")
    monkeypatch.setenv("ELASTIC_CHECKPOINT_KEEP", "7")
    env_c = ckpt.checkpointer_from_env()
    assert isinstance(env_c, FsCheckpointer)
    assert env_c.directory == tmp_path / "env" and env_c.keep == 7
    with pytest.raises(ValueError, match="needs a directory"):
        ckpt.load_checkpointer("fs")


def test_unknown_checkpointer() -> None:
    with pytest.raises(ckpt.CheckpointerNotFoundError, match=r"unknown checkpointer 's3'; known"):
        ckpt.load_checkpointer("s3:bucket")
    with pytest.raises(ValueError, match=r"known checkpointers: .*fs"):
        ckpt.validate_checkpoint_spec("s3:bucket")
    ckpt.validate_checkpoint_spec("fs:/tmp/x")


THIRD_PARTY = """
import io

STORE = {}

class MemoryCheckpointer:
    def __init__(self, arg):
        self.name = arg

    def save(self, step, write):
        buf = io.BytesIO()
        write(buf)
        STORE[(self.name, step)] = buf.getvalue()

    def load_latest(self, read):
        steps = [s for (n, s) in STORE if n == self.name]
        if not steps:
            return None
        read(io.BytesIO(STORE[(self.name, max(steps))]))
        return max(steps)
"""


def test_third_party_checkpointer_through_entry_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    make_dist(
        site,
        "acme_ckpt",
        "[elastic.checkpoint]\nmem = acme_ckpt:MemoryCheckpointer\n",
        {"acme_ckpt": THIRD_PARTY},
    )
    make_dist(
        site,
        "acme_ckpt_broken",
        "[elastic.checkpoint]\nbroken = acme_ckpt_broken:create\n",
        {"acme_ckpt_broken": "raise ImportError('needs boto')\n"},
    )
    monkeypatch.syspath_prepend(str(site))
    assert {"fs", "mem", "broken"} <= set(ckpt.known_checkpointers())
    c = ckpt.load_checkpointer("mem:job1")
    assert isinstance(c, ckpt.Checkpointer)
    c.save(5, saver(b"five"))
    assert load(c) == (5, b"five")
    with pytest.raises(ckpt.CheckpointerNotFoundError, match="failed to load: ImportError"):
        ckpt.load_checkpointer("broken")


def test_name_claimed_twice_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    for dist in ("one_ckpt", "two_ckpt"):
        make_dist(site, dist, f"[elastic.checkpoint]\ndup = {dist}:C\n", {dist: "C = None\n"})
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(
        ckpt.CheckpointerNotFoundError,
        match=r"claimed by one_ckpt==0.1 \(one_ckpt:C\) and two_ckpt",
    ):
        ckpt.load_checkpointer("dup")
