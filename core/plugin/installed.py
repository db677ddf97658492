"""Installed distributions read straight from their metadata folders, as
``importlib.metadata`` finds them, without importing it.

Importing ``importlib.metadata`` pulls in ``email`` (with ``socket``, ``calendar``,
``quopri``...) and parsing one distribution's ``METADATA`` with it costs more than reading
the file: together ~20 ms of every agent's start, for two header lines (``Name``,
``Version``) and the few ``entry_points.txt`` that mention ``elastic.``. This module
repeats ``importlib.metadata``'s path search (Python 3.11's ``MetadataPathFinder``):
every ``sys.path`` entry is listed as it is now, in order; each ``*.dist-info`` and
``*.egg-info`` child is a distribution; the first of a normalized name wins. Nothing is
cached across calls, so an install or removal is seen by the next call.

Where that search is not the whole story (a ``sys.meta_path`` finder other than the
standard one that answers ``find_distributions``, or a zip file on ``sys.path``),
``importlib.metadata`` itself is asked instead (``exotic``).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from importlib.machinery import PathFinder
from typing import Protocol

# A header line's field name: printable ASCII but the colon (``email.feedparser``'s rule).
_HEADER_NAME = re.compile(r"([\x21-\x39\x3b-\x7e]+):")


class Metadata(Protocol):
    """What is read of a distribution: ``importlib.metadata.Distribution`` has it too."""

    def read_text(self, filename: str) -> str | None: ...


class MetadataFolder:
    """One ``*.dist-info`` / ``*.egg-info`` (a folder, or an egg-info file) on ``sys.path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fields: dict[str, str] | None = None  # its headers, once read

    def read_text(self, filename: str) -> str | None:
        """The file's text, or None when it is absent or unreadable (``read_text`` of
        ``importlib.metadata``'s ``PathDistribution``: "" names the path itself)."""
        target = os.path.join(self.path, filename) if filename else self.path
        try:
            with open(target, encoding="utf-8") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError):
            return None

    def __repr__(self) -> str:
        return f"MetadataFolder({self.path!r})"


def normalize(name: str) -> str:
    """PEP 503 normalization with dashes as underscores (``importlib.metadata``'s
    ``re.sub(r"[-_.]+", "-", name).lower().replace("-", "_")``, without a regex: it runs
    once per installed distribution)."""
    name = name.lower().replace("-", "_").replace(".", "_")
    while "__" in name:
        name = name.replace("__", "_")
    return name


def exotic() -> bool:
    """Whether distributions may come from somewhere this module does not search."""
    for finder in sys.meta_path:
        if finder is not PathFinder and getattr(finder, "find_distributions", None):
            return True
    return any(os.path.isfile(entry) for entry in sys.path if entry)


def _folders(entry: str) -> Iterator[tuple[str, str]]:
    """(normalized name, path) of each metadata folder under one ``sys.path`` entry, in
    ``importlib.metadata``'s order: dist-info and egg-info children grouped by name in
    listing order, then an ``.egg``'s own ``EGG-INFO``."""
    try:
        children = os.listdir(entry or ".")
    except OSError:
        return
    by_name: dict[str, list[str]] = {}
    eggs: list[str] = []
    base = os.path.basename(entry).lower()
    for child in children:
        low = child.lower()
        if low.endswith((".dist-info", ".egg-info")):
            name = normalize(low.rpartition(".")[0].partition("-")[0])
            by_name.setdefault(name, []).append(os.path.join(entry, child))
        elif base.endswith(".egg") and low == "egg-info":
            eggs.append(os.path.join(entry, child))
    for name, paths in by_name.items():
        for path in paths:
            yield name, path
    egg_name = normalize(base.rpartition(".")[0].partition("-")[0])
    for path in eggs:
        yield egg_name, path


def distributions() -> Iterator[MetadataFolder]:
    """Every installed distribution once: the first on ``sys.path`` of each name."""
    seen: set[str] = set()
    for entry in list(sys.path):
        for name, path in _folders(entry):
            if name not in seen:
                seen.add(name)
                yield MetadataFolder(path)


def find(name: str) -> Metadata | None:
    """The distribution ``importlib.metadata.distribution(name)`` would give, or None."""
    if exotic():
        import importlib.metadata as md

        try:
            return md.distribution(name)
        except md.PackageNotFoundError:
            return None
    wanted = normalize(name)
    for entry in list(sys.path):
        for found, path in _folders(entry):
            if found == wanted:
                return MetadataFolder(path)
    return None


def headers(dist: Metadata) -> dict[str, str]:
    """The metadata's header fields (lower-cased names, the first of each kept), read as
    ``email``'s compat32 parser reads ``METADATA``, ``PKG-INFO`` or an egg-info file:
    up to the first line that is no header (a blank one ends them), a continuation line
    (leading blank) joined to its field. A ``MetadataFolder`` keeps what was read."""
    if isinstance(dist, MetadataFolder) and dist.fields is not None:
        return dist.fields
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or dist.read_text("") or ""
    raw: dict[str, str] = {}
    current: str | None = None  # the field a continuation line extends (None: a repeat)
    for line in text.splitlines(keepends=True):
        if line[:1] in (" ", "\t"):
            if current is not None:
                raw[current] += line
            continue
        match = _HEADER_NAME.match(line)
        if match is None:
            break
        name = match.group(1).lower()
        current = None if name in raw else name
        if current is not None:
            raw[current] = line[match.end() :].lstrip(" \t")
    fields = {name: _redent(value.rstrip("\r\n")) for name, value in raw.items()}
    if isinstance(dist, MetadataFolder):
        dist.fields = fields
    return fields


def _redent(value: str) -> str:
    """A folded value as ``importlib.metadata`` gives it (its ``Message._repair_headers``)."""
    if "\n" not in value:
        return value
    import textwrap

    return textwrap.dedent(" " * 8 + value)


def version(name: str) -> str | None:
    """The installed version of the distribution ``name`` ("" if its metadata has none);
    None when it is not installed."""
    dist = find(name)
    return None if dist is None else headers(dist).get("version", "")
