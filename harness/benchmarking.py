"""What only the scripts in ``bench/`` need: repeated timings and their statistics, the
JSON report and its options, a quiet machine to measure on, a scratch directory per run.

It lives in ``elastic.harness`` because the bench scripts run as ``python bench/NAME.py``
and import their harness only through the (editable) install, never from files that happen
to sit next to them on ``sys.path``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def sample_stats(samples: list[float], digits: int = 4) -> dict[str, Any]:
    """Median and spread of repeated measurements (all None when there are none)."""
    if not samples:
        return {"samples": [], "median": None, "min": None, "max": None, "stdev": None}
    return {
        "samples": [round(s, digits) for s in samples],
        "median": round(statistics.median(samples), digits),
        "min": round(min(samples), digits),
        "max": round(max(samples), digits),
        "stdev": round(statistics.stdev(samples), digits) if len(samples) > 1 else 0.0,
    }


def spread(values: list[float], fmt: str) -> str:
    """``median [min-max]`` of ``values`` in ``fmt`` (just the value when there is one)."""
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{format(med, fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def commit() -> str:
    """The checkout's short commit, for a report ("unknown" outside git)."""
    here = Path(__file__).resolve().parent
    proc = subprocess.run(
        ["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return proc.stdout.strip() or "unknown"


def command_line() -> str:
    """How this bench was started, for its report: the interpreter's name and the argv."""
    return " ".join([Path(sys.executable).name, *sys.argv])


def write_report(report: dict[str, Any], json_path: str | None) -> None:
    """Print the JSON report, and also write it to ``json_path`` when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")


def write_runs_report(
    report: dict[str, Any], runs: list[dict[str, Any]], json_path: str | None
) -> None:
    """Print ``report`` with its ``runs`` less their logs; write it to ``json_path``, when
    given, with the logs (a fault bench keeps every node's output there)."""
    quiet = [{k: v for k, v in r.items() if k != "logs"} for r in runs]
    print(json.dumps({**report, "runs": quiet}, indent=1))
    if json_path:
        Path(json_path).write_text(json.dumps({**report, "runs": runs}, indent=1))


def add_report_options(parser: argparse.ArgumentParser) -> None:
    """``--json`` and ``--keep-resolver``, the options every side-by-side bench takes."""
    parser.add_argument("--json", dest="json_path", help="also write the JSON here")
    parser.add_argument(
        "--keep-resolver",
        action="store_true",
        help="don't set RES_OPTIONS='timeout:1 attempts:1' (see docs/benchmarks.md)",
    )


def bench_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment both launchers run in. torch's TCPStore client does a reverse DNS
    query per connection and a lost query costs the resolver's 5 s timeout, so unless
    ``--keep-resolver`` both sides get a short resolver timeout."""
    env = dict(os.environ)
    if not args.keep_resolver:
        env["RES_OPTIONS"] = "timeout:1 attempts:1"
    return env


def pytest_running() -> bool:
    """Whether any process's command line mentions pytest (``pgrep -f pytest``)."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"pytest" in cmdline:
            return True
    return False


def wait_for_quiet(max_load: float, limit: float, poll: float = 30.0) -> dict[str, Any]:
    """Wait (up to ``limit`` s, checking every ``poll`` s) until the 1-min load average is
    below ``max_load`` and no pytest runs; then go on either way. Returns what was seen."""
    started = time.monotonic()
    while True:
        load = os.getloadavg()[0]
        busy = pytest_running()
        waited = time.monotonic() - started
        if (load < max_load and not busy) or waited >= limit:
            return {
                "quiet": load < max_load and not busy,
                "waited_s": round(waited, 1),
                "load1": round(load, 2),
                "pytest_running": busy,
            }
        print(
            f"  waiting for a quiet machine: load {load:.2f}, pytest running: {busy}",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(poll)


def in_scratch_dir(
    prefix: str, keep: str | None, run: Callable[[Path], dict[str, Any]]
) -> tuple[dict[str, Any], float]:
    """``run(workdir)`` in a fresh temporary directory, copied under ``keep`` (when
    given) and removed afterwards; returns its result and the seconds it took."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    started = time.monotonic()
    try:
        return run(workdir), time.monotonic() - started
    finally:
        if keep:
            shutil.copytree(workdir, Path(keep) / workdir.name)
        shutil.rmtree(workdir, ignore_errors=True)


def run_threads(calls: list[Callable[[], Any]], timeout: float) -> tuple[float | None, list[Any]]:
    """Start all calls together, each in a daemon thread; seconds until the last returns,
    or None past ``timeout``, and each call's result (or the exception it raised)."""
    results: list[Any] = [None] * len(calls)
    go, all_done = threading.Event(), threading.Event()
    pending = [len(calls)]
    lock = threading.Lock()
    end = [0.0]

    def body(i: int) -> None:
        go.wait()
        try:
            results[i] = calls[i]()
        except Exception as exc:  # reported in the JSON, not raised
            results[i] = exc
        with lock:
            pending[0] -= 1
            if not pending[0]:
                end[0] = time.perf_counter()
                all_done.set()

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    start = time.perf_counter()
    go.set()
    # One wait for the last call, not a join per thread: a thousand joins waking the
    # main thread one by one cost the timed region a tenth of its CPU.
    if not all_done.wait(timeout):
        return None, results
    return end[0] - start, results


SHUTDOWN_THREADS = 64  # handlers shut down at once by ``shut_down``


def shut_down(handlers: list[Any], last: Any = None) -> float:
    """Shut the handlers down as their agents would, all at once (as many threads as
    SHUTDOWN_THREADS), ``last`` after the others (a store's host); seconds it took. One
    by one, a thousand handlers still ticking against one store take minutes."""
    started = time.perf_counter()
    with ThreadPoolExecutor(SHUTDOWN_THREADS) as pool:
        list(pool.map(lambda h: h.shutdown(), [h for h in handlers if h is not last]))
    if last is not None:
        last.shutdown()
    return time.perf_counter() - started


@dataclass
class RendezvousTiming:
    """N handlers' ``next_rendezvous`` called at once: ``seconds`` until the last returned,
    None when one raised, the time ran out or (``check_ranks``) the ranks were not
    0..N-1; ``connect_seconds`` the time creating the handlers took (store clients
    connect then, outside the timed region)."""

    handlers: list[Any]
    connect_seconds: float
    seconds: float | None
    errors: list[str]

    def result(self) -> dict[str, Any]:
        """One run as ``rendezvous_summary`` reads it."""
        return {
            "seconds": self.seconds,
            "connect_seconds": self.connect_seconds,
            "errors": self.errors,
        }


def time_rendezvous(
    create_handlers: Callable[[], list[Any]], timeout: float, check_ranks: bool = True
) -> RendezvousTiming:
    """Create the handlers (timed apart), then time their ``next_rendezvous`` released
    together (``run_threads``), capped by ``timeout``.

    The handlers made are frozen for the garbage collector while they are timed, as every
    ``elastic run`` freezes its own once its agent is built (``cli/run.py``): otherwise
    each full collection in this one process walks N agents' objects, a cost no agent
    has (0.2-0.3 s of a 1024-handler round)."""
    t0 = time.perf_counter()
    handlers = create_handlers()
    connect = time.perf_counter() - t0
    gc.freeze()
    try:
        elapsed, results = run_threads([h.next_rendezvous for h in handlers], timeout)
    finally:
        gc.unfreeze()  # collectable again once shut down: the next run starts clean
    errors = [repr(r) for r in results if isinstance(r, Exception)]
    ok = elapsed is not None and not errors
    if check_ranks:
        ranks = sorted(r.rank for r in results if hasattr(r, "rank"))
        ok = ok and ranks == list(range(len(handlers)))
    return RendezvousTiming(handlers, connect, elapsed if ok else None, errors[:3])


def rendezvous_summary(runs: list[dict[str, Any]], timeout: float) -> dict[str, Any]:
    """The report of repeated rendezvous runs (``seconds`` None: did not finish): every
    run's time, connect and shutdown times, and the median and spread when all finished."""
    times = [r["seconds"] for r in runs if r["seconds"] is not None]
    out: dict[str, Any] = {
        "runs": [None if r["seconds"] is None else round(r["seconds"], 4) for r in runs],
        "connect_seconds": [round(r["connect_seconds"], 3) for r in runs],
        "shutdown_seconds": [
            round(r["shutdown_seconds"], 3) for r in runs if "shutdown_seconds" in r
        ],
    }
    if len(times) == len(runs):
        out["median"] = round(statistics.median(times), 4)
        out["spread"] = [round(min(times), 4), round(max(times), 4)]
    else:
        out["median"] = None
        out["result"] = f"did not finish within {timeout:g} s"
        errors = [e for r in runs for e in r["errors"]]
        if errors:
            out["errors"] = errors[:3]
    return out


def add_rendezvous_scale_options(parser: argparse.ArgumentParser) -> None:
    """The options of both rendezvous-at-scale benches, after their ``--backend``."""
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0, help="cap for ours (s)")
    parser.add_argument("--torch-timeout", type=float, default=120.0, help="cap for torch's")
    parser.add_argument("--no-torch", action="store_true", help="skip torch's handler")


def add_torch_runs(
    report: dict[str, Any],
    run: Callable[[str], dict[str, Any]],
    repeat: int,
    torch_timeout: float,
) -> None:
    """Up to ``repeat`` runs of torch's handlers (``run(run_id)``), stopping after the first
    that does not finish (one timeout says enough; repeating only burns the cap again);
    their summary as ``report["torch"]`` and torch's median over ours as
    ``report["ratio"]``, a bound when torch's handlers did not finish."""
    theirs: list[dict[str, Any]] = []
    for i in range(repeat):
        theirs.append(run(f"torch-{i}"))
        if theirs[-1]["seconds"] is None:
            break
    report["torch"] = rendezvous_summary(theirs, torch_timeout)
    a, b = report["ours"]["median"], report["torch"]["median"]
    if a and b:
        report["ratio"] = round(b / a, 1)
    elif a:
        report["ratio"] = f"> {torch_timeout / a:.0f} (torch did not finish)"
