"""What is installed: the ``elastic.*`` groups' entry points and distributions' versions,
read from metadata once and kept on disk between starts.

Every agent's start asks which entry points the groups hold (to load the hook plugins
and pick a backend) and which torch is installed (its fingerprint). Reading that through
``importlib.metadata`` costs ~25 ms of CPU: the module and the email parser it brings, a
scan of every distribution, torch's METADATA parsed whole. That is a tenth of an agent's
start, paid by each of the hundreds of agents a large job starts at once. So the answers
are kept in one small JSON file per interpreter under the user's cache folder
(``$XDG_CACHE_HOME/elastic``, else ``~/.cache/elastic``), good while its key holds: the
interpreter, and in each ``sys.path`` folder that has any, every ``*.dist-info`` and
``*.egg-info`` with its mtime and its ``entry_points.txt``'s (installing, removing or editing a
distribution changes one of them; stevedore keys its cache much the same way). A file
that is missing, too large, unreadable, for another key or malformed is read again from
metadata and rewritten (a file per writer, renamed into place: no reader ever sees half
of one); a cache folder that cannot be written costs time, never an error.

Nothing in the file is executed: an entry point is loaded by importing the module its
value names, as ``importlib.metadata.EntryPoint.load`` does.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import re
import sys
import zlib
from typing import Any

GROUPS = ("elastic.rendezvous", "elastic.plugins", "elastic.metrics", "elastic.checkpoint")
MAX_BYTES = 1 << 20  # a cache file larger than this is not ours: read metadata instead
_FORMAT = 1
# importlib.metadata.EntryPoint.pattern: "module[:attr.attr] [extras]"
_VALUE = re.compile(r"(?P<module>[\w.]+)\s*(:\s*(?P<attr>[\w.]+)\s*)?((?P<extras>\[.*\])\s*)?$")


class InstalledEntryPoint:
    """One entry point with the name and version of the distribution that declares it."""

    __slots__ = ("name", "value", "group", "distribution", "version")

    def __init__(self, name: str, value: str, group: str, distribution: str, version: str):
        self.name, self.value, self.group = name, value, group
        self.distribution, self.version = distribution, version

    def load(self) -> Any:
        """Import the module the value names and return the attribute it names."""
        match = _VALUE.match(self.value)
        if match is None:
            raise ValueError(f"entry point {self.name!r} has a malformed value {self.value!r}")
        module = importlib.import_module(match.group("module"))
        attrs = (match.group("attr") or "").split(".")
        return functools.reduce(getattr, filter(None, attrs), module)

    def __repr__(self) -> str:
        return f"InstalledEntryPoint({self.name!r}, {self.value!r}, {self.group!r})"


class Installed:
    """The groups' entry points, sorted by (name, value), and the versions read so far."""

    def __init__(self, groups: dict[str, list[InstalledEntryPoint]], versions: dict[str, str]):
        self.groups = groups
        self.versions = versions


# (sys.path, each entry's mtime) at the last read -> what it found, for this process
_read: dict[tuple[tuple[str, int], ...], Installed] = {}


def installed() -> Installed:
    """What is installed, from this process's last read while ``sys.path`` and its
    folders stay as they were, else from the cache file, else from metadata."""
    quick = tuple((p, _mtime(p)) for p in sys.path)
    found = _read.get(quick)
    if found is None:
        key = _key()
        found = _load(key)
        if found is None:
            found = _from_metadata()
            _save(key, found)
        _read.clear()
        _read[quick] = found
    return found


def version(distribution: str) -> str | None:
    """An installed distribution's version, None when it is not installed; read from
    metadata once, then kept with the entry points."""
    found = installed()
    if distribution not in found.versions:
        import importlib.metadata as md

        try:
            found.versions[distribution] = md.version(distribution)
        except md.PackageNotFoundError:
            found.versions[distribution] = ""
        _save(_key(), found)
    return found.versions[distribution] or None


def _mtime(path: str) -> int:
    try:
        return os.stat(path or ".").st_mtime_ns
    except OSError:
        return -1


def _key() -> list[Any]:
    """The interpreter, and the distributions in each ``sys.path`` folder, in order,
    with their mtimes; a zip, its mtime. Not the folders' own mtimes, nor the folders
    without any distribution: the script's folder and the working directory are on
    ``sys.path`` too, and change with every file a job writes and every place it is
    started from."""
    folders: list[Any] = []
    for entry in sys.path:
        dists: list[Any] = []
        try:
            with os.scandir(entry or ".") as listing:
                for child in listing:
                    if child.name.endswith((".dist-info", ".egg-info")):
                        txt = os.path.join(child.path, "entry_points.txt")
                        dists.append([child.name, _mtime(child.path), _mtime(txt)])
        except NotADirectoryError:
            dists.append(_mtime(entry))
        except OSError:
            pass
        if dists:  # a folder without any says nothing (the script's, the working one)
            folders.append([entry, sorted(dists)])
    return [_FORMAT, sys.executable, sys.version, folders]


def _cache_file() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    tag = zlib.crc32(sys.executable.encode())
    return os.path.join(base, "elastic", f"installed-{tag:08x}.json")


def _load(key: list[Any]) -> Installed | None:
    try:
        with open(_cache_file(), "rb") as f:
            raw = f.read(MAX_BYTES + 1)
        if len(raw) > MAX_BYTES:
            return None
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("key") != key:
            return None
        groups = {
            group: [_entry(group, row) for row in rows] for group, rows in data["groups"].items()
        }
        versions = {str(k): str(v) for k, v in data["versions"].items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    if set(groups) != set(GROUPS):
        return None
    return Installed(groups, versions)


def _entry(group: str, row: Any) -> InstalledEntryPoint:
    if not isinstance(row, list) or len(row) != 4 or not all(isinstance(v, str) for v in row):
        raise TypeError(f"not an entry point: {row!r:.80}")
    name, value, distribution, version_ = row
    return InstalledEntryPoint(name, value, group, distribution, version_)


def _save(key: list[Any], found: Installed) -> None:
    data = {
        "key": key,
        "groups": {
            g: [[e.name, e.value, e.distribution, e.version] for e in eps]
            for g, eps in found.groups.items()
        },
        "versions": found.versions,
    }
    import tempfile  # only when writing: its imports cost a start that reads

    path = _cache_file()
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".installed-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def _from_metadata() -> Installed:
    """Every group's entry points through ``importlib.metadata``, which lists each
    distribution once however often it appears on ``sys.path`` (the first wins)."""
    import importlib.metadata as md

    everything = md.entry_points()
    described: dict[str, tuple[str, str]] = {}
    groups: dict[str, list[InstalledEntryPoint]] = {}
    for group in GROUPS:
        eps = []
        for ep in everything.select(group=group):
            distribution, version_ = _name_and_version(ep.dist, described)
            eps.append(InstalledEntryPoint(ep.name, ep.value, group, distribution, version_))
        groups[group] = sorted(eps, key=lambda e: (e.name, e.value))
    return Installed(groups, {})


def _name_and_version(dist: Any, described: dict[str, tuple[str, str]]) -> tuple[str, str]:
    """A distribution's ``Name`` and ``Version``, read once per scan. Both are header
    lines at the top of its METADATA; ``dist.metadata`` would run the whole file through
    the email parser, once per entry point."""
    if dist is None:
        return "?", "?"
    where = str(getattr(dist, "_path", id(dist)))
    known = described.get(where)
    if known is None:
        text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
        headers: dict[str, str] = {}
        for line in text.splitlines():
            if not line:
                break  # the end of the headers: the description follows
            name, sep, value = line.partition(":")
            if sep and name in ("Name", "Version") and name not in headers:
                headers[name] = value.strip()
        known = described[where] = (headers.get("Name", "?"), headers.get("Version", "?"))
    return known
