"""Plugin discovery reads installed metadata without ``importlib.metadata``
(``elastic.core.plugin.installed``): what it finds must be what ``importlib.metadata``
finds, in this environment and in throwaway distributions installed for real, and an
install or a removal must be seen by the next lookup."""

from __future__ import annotations

import importlib.metadata as md
import shutil
from pathlib import Path

import pytest
from elastic.core.plugin import entry_points, installed
from elastic.harness.distributions import make_distribution

SINK = """
[elastic.metrics]
probe-sink = probe_sink_mod:Sink
"""


def unique_distributions() -> list[md.Distribution]:
    seen: set[str] = set()
    out = []
    for dist in md.distributions():
        name = dist._normalized_name  # type: ignore[attr-defined]
        if name not in seen:
            seen.add(name)
            out.append(dist)
    return out


def md_entry_points(groups: tuple[str, ...]) -> list[tuple[str, str, str]]:
    everything = md.entry_points()
    return [(ep.group, ep.name, ep.value) for g in groups for ep in everything.select(group=g)]


def ours(groups: tuple[str, ...]) -> list[tuple[str, str, str]]:
    found = entry_points.scan(groups)
    return [(ep.group, ep.name, ep.value) for g in groups for ep in found if ep.group == g]


def test_this_environment_reads_as_importlib_metadata_reads_it() -> None:
    dists = unique_distributions()
    assert [d.path for d in installed.distributions()] == [str(d._path) for d in dists]  # type: ignore[attr-defined]
    for dist in dists:
        fields = installed.headers(installed.MetadataFolder(str(dist._path)))  # type: ignore[attr-defined]
        assert (fields.get("name"), fields.get("version")) == (
            dist.metadata["Name"],
            dist.metadata["Version"],
        )
    groups = tuple(sorted(md.entry_points().groups))
    assert ours(groups) == md_entry_points(groups)
    assert installed.version("elastic-launch") == md.version("elastic-launch")
    assert installed.version("Elastic_Launch") == md.version("Elastic_Launch")
    assert installed.version("no-such-distribution-here") is None


def test_an_install_and_a_removal_are_seen_by_the_next_lookup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    monkeypatch.syspath_prepend(str(site))
    site.mkdir()
    assert entry_points.entry_points("elastic.metrics", "probe-sink") == []
    make_distribution(site, "probe_sink", SINK, {"probe_sink_mod": "class Sink:\n    pass\n"})
    (found,) = entry_points.entry_points("elastic.metrics", "probe-sink")
    assert entry_points.describe(found, "elastic.metrics").origin == (
        "probe_sink==0.1 (probe_sink_mod:Sink)"
    )
    assert found.load().__name__ == "Sink"
    assert ours(entry_points.GROUPS) == md_entry_points(entry_points.GROUPS)
    shutil.rmtree(site / "probe_sink-0.1.dist-info")
    assert entry_points.entry_points("elastic.metrics", "probe-sink") == []
    assert ours(entry_points.GROUPS) == md_entry_points(entry_points.GROUPS)


def test_the_first_of_one_name_on_sys_path_wins_as_with_importlib_metadata(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for folder, target in (("a", "first_mod:Sink"), ("b", "second_mod:Sink")):
        make_distribution(
            tmp_path / folder, "Probe.Sink", SINK.replace("probe_sink_mod:Sink", target), {}
        )
    monkeypatch.syspath_prepend(str(tmp_path / "b"))
    monkeypatch.syspath_prepend(str(tmp_path / "a"))
    assert [ep.value for ep in entry_points.entry_points("elastic.metrics", "probe-sink")] == [
        "first_mod:Sink"
    ]
    assert ours(entry_points.GROUPS) == md_entry_points(entry_points.GROUPS)
    assert installed.version("probe-sink") == md.version("probe-sink")


@pytest.mark.parametrize(
    "text",
    [
        "Metadata-Version: 2.1\nName: plain\nVersion: 1.0\n\nName: in the body\n",
        "Name:   spaced \t\nVersion:\t2.0 \r\nSummary: a\n  folded\n   line\n",
        "name: lower\nNAME: repeated\nVersion: 3\n",
        "Summary: x\n continued\nName: after\nnot a header line\nVersion: 9\n",
        "Version: 1\n\tName: a continuation, not a field\n",
        "",
    ],
)
def test_headers_are_read_as_the_email_parser_reads_them(tmp_path: Path, text: str) -> None:
    info = tmp_path / "x-1.dist-info"
    info.mkdir()
    (info / "METADATA").write_bytes(text.encode())
    theirs = md.PathDistribution(info).metadata
    mine = installed.headers(installed.MetadataFolder(str(info)))
    for field in ("Name", "Version", "Summary"):
        assert mine.get(field.lower()) == theirs[field], field


def test_an_egg_info_file_is_read_like_importlib_metadata_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "old_style-4.2.egg-info").write_text("Name: old-style\nVersion: 4.2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert installed.version("old-style") == md.version("old-style") == "4.2"
