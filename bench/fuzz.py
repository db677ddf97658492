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
    python bench/fuzz.py --module my_targets.py --target mine   # targets of a file of yours

A target is a function of bytes registered with ``fuzz_targets.target`` (see there).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import fuzz_targets  # noqa: E402  (beside this file, not a package)

CORPUS = HERE.parent / "tests" / "fuzz_corpus"
MAX_CRASHES = 5  # a target that crashed is restarted this many times at most
_EXECUTED = re.compile(rb"stat::number_of_executed_units:\s*(\d+)")
_SAVED = re.compile(rb"Test unit written to (\S+)")


@dataclass
class Result:
    target: str
    inputs: int = 0
    seconds: float = 0.0
    crashes: list[str] = field(default_factory=list)  # the saved inputs that crashed
    corpus: int = 0  # seed inputs it started from


def load_targets(modules: list[str]) -> dict[str, fuzz_targets.Target]:
    """The registry: ``fuzz_targets.py``'s targets and those ``modules`` (files) register
    with its ``@target``."""
    for path in modules:
        spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        assert spec is not None and spec.loader is not None, path
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    return fuzz_targets.TARGETS


def child(
    name: str, seconds: float, runs: int, artifacts: str, dirs: list[str], modules: list[str]
) -> None:
    """Run in the fuzzing process: instrument elastic, set the target up, fuzz."""
    import atheris

    with atheris.instrument_imports(include=["elastic"]):
        one = load_targets(modules)[name].setup()
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
    name: str,
    seconds: float,
    runs: int,
    keep: Path | None,
    corpus: Path = CORPUS,
    modules: tuple[str, ...] = (),
) -> Result:
    """Fuzz one target for ``seconds`` (or ``runs`` inputs), restarting after a crash."""
    result = Result(name)
    seeds = corpus / name
    result.corpus = len(list(seeds.iterdir())) if seeds.is_dir() else 0
    artifacts = Path(keep or tempfile.mkdtemp(prefix=f"fuzz-{name}-"))
    artifacts.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=f"fuzz-{name}-corpus-")
    # The child's own temporary files (a target's scratch files) go here too: libFuzzer
    # ends the process without Python's clean-up, so this runner removes them.
    child_tmp = os.path.join(scratch, "tmp")
    os.mkdir(child_tmp)
    corpus_dir = os.path.join(scratch, "corpus")
    os.mkdir(corpus_dir)
    started = time.monotonic()
    while len(result.crashes) < MAX_CRASHES:
        left = seconds - (time.monotonic() - started)
        if left < 1 and result.inputs:
            break
        # Unbuffered: atheris prints a crash's traceback to stdout, and libFuzzer then
        # ends the process without flushing it.
        cmd = [sys.executable, "-u", __file__, "--child", name, "--seconds", str(max(left, 1))]
        cmd += ["--runs", str(max(runs - result.inputs, 1) if runs else 0)]
        cmd += [arg for module in modules for arg in ("--module", module)]
        cmd += ["--artifacts", str(artifacts), corpus_dir]  # then the corpus directories
        cmd += [str(seeds)] if seeds.is_dir() else []
        proc = subprocess.run(
            cmd,
            env={**os.environ, "TMPDIR": child_tmp},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=seconds + 120,
            check=False,
        )
        output = proc.stdout
        executed = _EXECUTED.findall(output)
        result.inputs += int(executed[-1]) if executed else 0
        if proc.returncode == 0:
            break
        saved = [p.decode() for p in _SAVED.findall(output)]
        if not saved:  # failed before fuzzing (setup): say why, once
            tail = output.decode(errors="replace").strip().splitlines()[-15:]
            raise RuntimeError(f"{name}: the fuzzer exited {proc.returncode}:\n" + "\n".join(tail))
        sys.stderr.write(output.decode(errors="replace")[-4000:])
        if saved[-1] in result.crashes:
            break  # a seed of the corpus crashes: every restart would stop there again
        result.crashes.append(saved[-1])
        if runs and result.inputs >= runs:
            break
    result.seconds = round(time.monotonic() - started, 1)
    shutil.rmtree(scratch, ignore_errors=True)  # the inputs it found: kept only in a run
    if keep is None and not result.crashes:
        shutil.rmtree(artifacts, ignore_errors=True)
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
    parser.add_argument(
        "--module", action="append", default=[], help="a file registering more targets"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("dirs", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.seconds, args.runs, args.artifacts, args.dirs, args.module)
        return 0
    targets = load_targets(args.module)
    if args.list:
        for t in targets.values():
            print(f"{t.name:16} {t.doc}")
        return 0
    names = args.target or list(targets)
    unknown = [n for n in names if n not in targets]
    if unknown:
        known = ", ".join(targets)
        print(f"unknown target(s) {', '.join(unknown)}; known: {known}", file=sys.stderr)
        return 2
    results = []
    print(f"{'target':16} {'inputs':>8} {'seconds':>8} {'crashes':>8}  seeds")
    for name in names:
        keep = Path(args.artifacts) / name if args.artifacts else None
        modules = tuple(str(Path(m).resolve()) for m in args.module)
        result = run_target(name, args.seconds, args.runs, keep, Path(args.corpus), modules)
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
