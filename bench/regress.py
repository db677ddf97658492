"""Regression check: the headline figures of the working tree against a git revision.

Both sides run in one process, interleaved round by round (who goes first alternates), each
with its own copy of the benches, so a bench that changed between the two is compared as
each side had it. A side is a checkout put first on ``PYTHONPATH`` under the name
``elastic``; the revision is checked out with ``git worktree`` into a temporary folder and
removed afterwards.

Figures (lower is better, all ``elastic`` only: torchrun is the same on both sides):

  launch      ``--standalone --nproc-per-node=2``: command -> every worker started (s)
  restart     a worker fails: its exit -> attempt 1's first worker (s)
  rss         the agent's peak RSS in that standalone run (MiB)
  agents8     8 c10d agents on loopback, trivial workers: start -> all exited (s)
  handlers256 256 in-process c10d round handlers, one round (s)

A figure regressed when the working tree's median is above the revision's median by more
than the noise: the larger of ``--tolerance`` and the revision's own spread
((max - min) / median over the rounds). Exit status 1 when one did, 2 on a bench failure.

    python bench/regress.py [--base origin/main] [--rounds 3] [--figures launch,agents8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH_TIMEOUT = 300.0


@dataclass(frozen=True)
class Figure:
    """One headline figure: the bench command (relative to a side's checkout) and where
    the figure sits in the JSON it writes with ``--json``."""

    name: str
    unit: str
    argv: tuple[str, ...]
    pick: Callable[[dict[str, Any]], float | None]
    # rendezvous_scale.py prints its report on stdout instead of taking --json
    json_on_stdout: bool = False


def _launch_median(scenario: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda report: report["results"][scenario]["ours"]["median"]


FIGURES: dict[str, Figure] = {
    f.name: f
    for f in (
        Figure(
            "launch",
            "s",
            ("bench/launch.py", "--impls", "ours", "--scenarios", "launch", "--repeat", "3"),
            _launch_median("launch"),
        ),
        Figure(
            "restart",
            "s",
            ("bench/launch.py", "--impls", "ours", "--scenarios", "restart", "--repeat", "3"),
            _launch_median("restart"),
        ),
        Figure(
            "rss",
            "MiB",
            ("bench/launch.py", "--impls", "ours", "--scenarios", "rss", "--repeat", "1"),
            _launch_median("rss"),
        ),
        Figure(
            "agents8",
            "s",
            ("bench/agents_c10d.py", "--agents", "8", "--impls", "ours", "--repeat", "2"),
            lambda report: report["results"]["done"]["ours"]["median"],
        ),
        Figure(
            "handlers256",
            "s",
            ("bench/rendezvous_scale.py", "--nodes", "256", "--repeat", "2", "--no-torch"),
            lambda report: report["ours"]["median"],
            json_on_stdout=True,
        ),
    )
}


class BenchFailed(RuntimeError):
    pass


@dataclass
class Side:
    """A checkout under test: ``root`` holds the code, ``path_root`` a folder whose
    ``elastic`` entry points at it (what goes on PYTHONPATH)."""

    label: str
    root: Path
    path_root: Path
    samples: dict[str, list[float]] = field(default_factory=dict)

    def run(self, figure: Figure, scratch: Path) -> float:
        out = scratch / f"{self.label}-{figure.name}.json"
        argv = [sys.executable, str(self.root / figure.argv[0]), *figure.argv[1:]]
        if not figure.json_on_stdout:
            argv += ["--json", str(out)]
        # Editable on both sides: a side's checkout is the one on PYTHONPATH (a revision
        # before the benches' --install option has no other way).
        env = dict(os.environ, PYTHONPATH=str(self.path_root), ELASTIC_BENCH_INSTALL="editable")
        proc = subprocess.run(
            argv,
            cwd=self.root,
            env=env,
            capture_output=True,
            text=True,
            timeout=BENCH_TIMEOUT,
        )
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            command = " ".join(argv[1:])
            raise BenchFailed(f"{self.label}: {command} exited {proc.returncode}: {tail}")
        text = proc.stdout[proc.stdout.index("{") :] if figure.json_on_stdout else out.read_text()
        value = figure.pick(json.loads(text))
        if value is None:
            raise BenchFailed(f"{self.label}: {figure.name} gave no figure")
        return float(value)


@dataclass(frozen=True)
class Verdict:
    figure: str
    base: float
    new: float
    noise: float

    @property
    def change(self) -> float:
        return self.new / self.base - 1.0

    @property
    def regressed(self) -> bool:
        return self.change > self.noise


def judge(name: str, base: list[float], new: list[float], tolerance: float) -> Verdict:
    """Compare two sets of rounds: the medians, against the larger of ``tolerance`` and
    the base's own relative spread (a figure that moves 20% between identical runs cannot
    show a 10% regression)."""
    base_median = statistics.median(base)
    spread = (max(base) - min(base)) / base_median if base_median else 0.0
    return Verdict(name, base_median, statistics.median(new), max(tolerance, spread))


def checkout(revision: str, into: Path) -> Path:
    """``revision`` checked out (detached) under ``into``; the caller removes it."""
    tree = into / "tree"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(tree), revision],
        check=True,
        capture_output=True,
        text=True,
    )
    return tree


def path_root(tree: Path, folder: Path) -> Path:
    folder.mkdir()
    (folder / "elastic").symlink_to(tree)
    return folder


def render(verdicts: list[Verdict], units: dict[str, str]) -> str:
    lines = [f"{'figure':<12} {'base':>9} {'new':>9} {'change':>8} {'noise':>7}  verdict"]
    for v in verdicts:
        lines.append(
            f"{v.figure:<12} {v.base:>9.4f} {v.new:>9.4f} {v.change:>+8.1%} {v.noise:>7.1%}  "
            f"{'WORSE' if v.regressed else 'ok'} ({units[v.figure]})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per side")
    parser.add_argument("--figures", default=",".join(FIGURES), help="comma list")
    parser.add_argument(
        "--tolerance", type=float, default=0.10, help="smallest relative change called worse"
    )
    parser.add_argument("--json", dest="json_path", help="also write the report here")
    args = parser.parse_args(argv)
    names = [n for n in args.figures.split(",") if n]
    unknown = sorted(set(names) - set(FIGURES))
    if unknown:
        parser.error(f"unknown figure(s) {', '.join(unknown)}: choose from {', '.join(FIGURES)}")
    if args.rounds < 2:
        parser.error(f"--rounds {args.rounds}: need at least 2 to see the noise")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="elastic-regress-") as tmp:
        scratch = Path(tmp)
        tree = checkout(args.base, scratch)
        try:
            sides = [
                Side("base", tree, path_root(tree, scratch / "base-path")),
                Side("new", REPO, path_root(REPO, scratch / "new-path")),
            ]
            for r in range(args.rounds):
                for figure in (FIGURES[n] for n in names):
                    for side in sides if r % 2 == 0 else sides[::-1]:
                        value = side.run(figure, scratch)
                        side.samples.setdefault(figure.name, []).append(value)
                        note = f"  round {r} {figure.name} {side.label}: {value:.4f}"
                        print(note, file=sys.stderr, flush=True)
        except BenchFailed as exc:
            print(f"regress: bench failed: {exc}", file=sys.stderr)
            return 2
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                capture_output=True,
            )
    base, new = sides
    verdicts = [judge(n, base.samples[n], new.samples[n], args.tolerance) for n in names]
    print(render(verdicts, {n: FIGURES[n].unit for n in names}))
    print(f"base {args.base}, {args.rounds} rounds, {time.monotonic() - started:.0f} s")
    if args.json_path:
        report = {
            "base": args.base,
            "rounds": args.rounds,
            "samples": {s.label: s.samples for s in sides},
            "verdicts": [{**v.__dict__, "regressed": v.regressed} for v in verdicts],
        }
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if any(v.regressed for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
