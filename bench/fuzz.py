"""Coverage-guided fuzzing (atheris, libFuzzer's engine) of every parser of untrusted
bytes: the targets of ``fuzz_targets.py``.

Each target runs in a process of its own (libFuzzer ends its process when done), starting
from its checked-in corpus ``tests/fuzz_corpus/<target>/`` (replayed first: every crash
ever found is one of its files) and writing the inputs it finds new coverage with to a
scratch directory. Prints one line per target: inputs tried, seconds, crashes, and where
each crash's input was saved; ``--json`` adds a JSON summary. Exit status 1 if any target
crashed. Usage::

    python bench/fuzz.py                                  # every target, 60 s each
    python bench/fuzz.py --target store-session --seconds 300
    python bench/fuzz.py --runs 500 --json                # a bounded run (the test suite's)
    python bench/fuzz.py --list
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent / "tests" / "fuzz_corpus"
MAX_CRASHES = 5  # a target that crashed is restarted this many times at most
_EXECUTED = re.compile(rb"stat::number_of_executed_units:\s*(\d+)")


@dataclass
class Result:
    target: str
    inputs: int = 0
    seconds: float = 0.0
    crashes: list[str] = field(default_factory=list)  # the saved inputs that crashed
    corpus: int = 0  # seed inputs it started from


def child(name: str, seconds: float, runs: int, artifacts: str, dirs: list[str]) -> None:
    """Run in the fuzzing process: instrument elastic, set the target up, fuzz."""
    import atheris

    sys.path.insert(0, str(HERE))
    import fuzz_targets

    with atheris.instrument_imports(include=["elastic"]):
        one = fuzz_targets.TARGETS[name].setup()
    args = [
        sys.argv[0],
        f"-artifact_prefix={artifacts}/",
        "-print_final_stats=1",
        "-timeout=20",  # one input this slow is a hang: a crash
        "-rss_limit_mb=3072",
        "-max_len=4096",
        f"-max_total_time={max(1, int(seconds))}",
        *([f"-runs={runs}"] if runs else []),
        *dirs,
    ]
    atheris.Setup(args, one)
    atheris.Fuzz()


def run_target(
    name: str, seconds: float, runs: int, keep: Path | None, corpus: Path = CORPUS
) -> Result:
    """Fuzz one target for ``seconds`` (or ``runs`` inputs), restarting after a crash."""
    result = Result(name)
    seeds = corpus / name
    result.corpus = len(list(seeds.iterdir())) if seeds.is_dir() else 0
    artifacts = Path(keep or tempfile.mkdtemp(prefix=f"fuzz-{name}-"))
    artifacts.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=f"fuzz-{name}-corpus-")
    started = time.monotonic()
    while len(result.crashes) < MAX_CRASHES:
        left = seconds - (time.monotonic() - started)
        if left < 1 and result.inputs:
            break
        cmd = [sys.executable, __file__, "--child", name, "--seconds", str(max(left, 1))]
        cmd += ["--runs", str(max(runs - result.inputs, 1) if runs else 0)]
        cmd += ["--artifacts", str(artifacts), scratch]
        cmd += [str(seeds)] if seeds.is_dir() else []
        before = set(os.listdir(artifacts))
        proc = subprocess.run(cmd, capture_output=True, timeout=seconds + 120, check=False)
        executed = _EXECUTED.findall(proc.stderr)
        result.inputs += int(executed[-1]) if executed else 0
        new = sorted(set(os.listdir(artifacts)) - before)
        if proc.returncode == 0:
            break
        if not new:  # failed before fuzzing (setup): say why, once
            tail = proc.stderr.decode(errors="replace").strip().splitlines()[-15:]
            raise RuntimeError(f"{name}: the fuzzer exited {proc.returncode}:\n" + "\n".join(tail))
        result.crashes += [str(artifacts / f) for f in new]
        sys.stderr.write(proc.stderr.decode(errors="replace")[-4000:])
        if runs and result.inputs >= runs:
            break
    result.seconds = round(time.monotonic() - started, 1)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", help="a target (repeatable); default all")
    parser.add_argument("--seconds", type=float, default=60.0, help="per target")
    parser.add_argument("--runs", type=int, default=0, help="stop after this many inputs")
    parser.add_argument("--artifacts", help="where crashing inputs are saved")
    parser.add_argument(
        "--corpus", default=str(CORPUS), help="seed directories by target (default: %(default)s)"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("dirs", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.seconds, args.runs, args.artifacts, args.dirs)
        return 0
    sys.path.insert(0, str(HERE))
    import fuzz_targets

    if args.list:
        for t in fuzz_targets.TARGETS.values():
            print(f"{t.name:16} {t.doc}")
        return 0
    names = args.target or list(fuzz_targets.TARGETS)
    unknown = [n for n in names if n not in fuzz_targets.TARGETS]
    if unknown:
        known = ", ".join(fuzz_targets.TARGETS)
        print(f"unknown target(s) {', '.join(unknown)}; known: {known}", file=sys.stderr)
        return 2
    results = []
    print(f"{'target':16} {'inputs':>8} {'seconds':>8} {'crashes':>8}  seeds")
    for name in names:
        keep = Path(args.artifacts) / name if args.artifacts else None
        result = run_target(name, args.seconds, args.runs, keep, Path(args.corpus))
        results.append(result)
        line = f"{name:16} {result.inputs:8d} {result.seconds:8.1f} {len(result.crashes):8d}"
        print(f"{line}  {result.corpus}", flush=True)
        for crash in result.crashes:
            print(f"  crash input: {crash}")
    if args.json:
        print(json.dumps([asdict(r) for r in results]))
    return 1 if any(r.crashes for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
