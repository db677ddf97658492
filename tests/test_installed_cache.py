"""What is installed, kept on disk between starts (``core/plugin/installed.py``): a start
that finds the file reads no metadata, and whatever changes what is installed is seen."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from elastic.harness.distributions import make_distribution

pytestmark = pytest.mark.timeout(120)

# What one start sees: the rendezvous names, the hook plugins' (name, distribution,
# version), torch's version, and whether importlib.metadata was imported to learn it.
PROBE = """
import json, sys
from elastic.core.plugin.entry_points import describe, entry_points
from elastic.core.rendezvous.fingerprint import installed_version
print(json.dumps({
    "rendezvous": [ep.name for ep in entry_points("elastic.rendezvous")],
    "hooks": [describe(ep, "elastic.plugins").origin for ep in entry_points("elastic.plugins")],
    "torch": installed_version("torch"),
    "read_metadata": "importlib.metadata" in sys.modules,
}))
"""


def start(cache: Path, *path: Path, script_in: Path | None = None) -> dict[str, object]:
    """One start; ``script_in``: run the probe as a script in that folder, which puts the
    folder first on ``sys.path`` (as ``elastic run`` does its console script's)."""
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, path), env.get("PYTHONPATH", "")])
    argv = [sys.executable, "-c", PROBE]
    if script_in is not None:
        (script_in / "probe.py").write_text(PROBE)
        argv = [sys.executable, str(script_in / "probe.py")]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def cache_file(cache: Path) -> Path:
    (found,) = (cache / "elastic").glob("installed-*.json")
    return found


def test_a_start_after_the_first_reads_no_metadata_and_sees_the_same(tmp_path: Path) -> None:
    import importlib.metadata as md

    first = start(tmp_path / "cache")
    assert first["read_metadata"] is True
    again = start(tmp_path / "cache")
    assert again["read_metadata"] is False
    assert again == {**first, "read_metadata": False}
    assert {"c10d", "etcd-v2", "etcd-v3", "static"} <= set(again["rendezvous"])  # type: ignore[arg-type]
    assert again["torch"] == md.version("torch")


def test_starts_from_other_folders_share_the_file(tmp_path: Path) -> None:
    """The script's folder (or the working directory, for ``-m``) is first on
    ``sys.path`` and changes with every file a job writes there: a folder without
    distributions is not part of the key."""
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    assert start(tmp_path / "cache", script_in=here)["read_metadata"] is True
    (here / "train.log").write_text("a job writes here\n")
    assert start(tmp_path / "cache", script_in=here)["read_metadata"] is False
    assert start(tmp_path / "cache", script_in=there)["read_metadata"] is False


def test_a_distribution_installed_or_edited_after_the_file_was_written_is_seen(
    tmp_path: Path,
) -> None:
    cache, site = tmp_path / "cache", tmp_path / "site"
    site.mkdir()
    before = start(cache, site)
    assert before["read_metadata"] is True
    make_distribution(site, "acme_rdzv", "[elastic.rendezvous]\nacme = acme_rdzv:make\n", {})
    installed = start(cache, site)
    assert installed["read_metadata"] is True
    assert "acme" in installed["rendezvous"]  # type: ignore[operator]
    # its entry points edited in place: the folder's listing is the same
    txt = site / "acme_rdzv-0.1.dist-info" / "entry_points.txt"
    txt.write_text("[elastic.rendezvous]\nacme2 = acme_rdzv:make\n")
    os.utime(txt, ns=(txt.stat().st_atime_ns, txt.stat().st_mtime_ns + 10**9))
    edited = start(cache, site)
    assert "acme2" in edited["rendezvous"] and "acme" not in edited["rendezvous"]  # type: ignore[operator]
    # and removed
    (site / "acme_rdzv-0.1.dist-info" / "entry_points.txt").unlink()
    (site / "acme_rdzv-0.1.dist-info" / "METADATA").unlink()
    (site / "acme_rdzv-0.1.dist-info").rmdir()
    assert start(cache, site)["rendezvous"] == before["rendezvous"]


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b'{"key": 1, "groups": {}, "versions": {}}',
        b"[]",
        b" " * (2 << 20),
        "forged",
        "forged-string",
    ],
    ids=["malformed", "another-key", "not-an-object", "oversized", "forged-rows", "forged-string"],
)
def test_a_bad_cache_file_is_read_again_from_metadata_and_rewritten(
    tmp_path: Path, content: bytes | str
) -> None:
    cache = tmp_path / "cache"
    good = start(cache)
    path = cache_file(cache)
    if content == "forged":  # this key's file, with a row that is not four strings
        data = json.loads(path.read_text())
        data["groups"]["elastic.rendezvous"][0] = [1, {"x": 2}]
        path.write_text(json.dumps(data))
    elif content == "forged-string":  # a row that unpacks into four strings
        data = json.loads(path.read_text())
        data["groups"]["elastic.rendezvous"][0] = "abcd"
        path.write_text(json.dumps(data))
    else:
        path.write_bytes(content)  # type: ignore[arg-type]
    again = start(cache)
    assert again == good  # read from metadata again
    assert start(cache) == {**good, "read_metadata": False}  # and rewritten


def test_a_cache_folder_that_cannot_be_written_costs_time_only(tmp_path: Path) -> None:
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the folder would be\n")
    first, second = start(blocked), start(blocked)
    assert first["read_metadata"] is True and second == first
    assert not list(tmp_path.glob("**/installed-*.json"))
