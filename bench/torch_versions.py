"""Each torch version in its own venv, with elastic-launch installed from a wheel of this
checkout, checked three ways:

(a) ``tests/tcpstore_differential.py``: that version's ``TCPStore`` client, every request
    type, against torch's own server and our built-in one; the outcomes must be equal;
(b) that version's torchrun flags: every option string ``torch.distributed.run``'s own
    parser defines is given to ``elastic run --dry-run``; an option ours does not know
    ("no such option") is a failure, one it knows but refuses a value for (a feature it
    does not provide, such as ``--numa-binding``) is listed as refused;
(c) a 2-worker ``elastic run --standalone`` job whose workers all_reduce over gloo.

```
python bench/torch_versions.py --versions 2.13.0,2.14.1 [--root /tmp/elastic-torch-venvs] \
    [--keep] [--json out.json]
```

torch comes from the machine's pip configuration (``pip config list``); a CUDA build takes
~5.5 GB in its venv, so the free space under ``--root`` is checked first. The venvs are
removed afterwards unless ``--keep`` (a kept one is reused by the next run). Exit status 1
when any check of any version failed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DIFFERENTIAL = REPO / "tests" / "tcpstore_differential.py"
NEEDED_GB = 8.0  # a CUDA torch venv (~5.5 GB) and pip's unpacking room

# torchrun's parser, read in the venv: each action's option strings, whether it takes a
# value, its default and its choices.
TORCHRUN_OPTIONS = """\
import json
from torch.distributed.run import get_args_parser
print(json.dumps([
    {"strings": a.option_strings, "nargs": a.nargs, "default": repr(a.default),
     "choices": list(a.choices) if a.choices else None}
    for a in get_args_parser()._actions if a.option_strings
]))
"""
# A value ours accepts, for the options whose torchrun default is none or not one.
SAMPLE_VALUES = {
    "--rdzv-endpoint": "127.0.0.1:29400",
    "--log-dir": "{tmp}/logs",
    "--master-port": "29400",
    "--local-addr": "127.0.0.1",
    "--shutdown-timeout": "30",
    "--local-ranks-filter": "0",
    "--duplicate-stdout-filters": "x",
    "--duplicate-stderr-filters": "x",
}
# Options that end torchrun at once (help, completion scripts): given alone.
ALONE = ("-h", "--help", "--print-completion", "--print_completion")

GLOO_WORKER = """\
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"sum": t.item(), "world": dist.get_world_size(), "torch": torch.__version__}, f)
dist.destroy_process_group()
"""


def clean_env() -> dict[str, str]:
    """The environment without this checkout on PYTHONPATH: the venv's install is tested."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["RES_OPTIONS"] = "timeout:1 attempts:1"  # see bench/README.md, launch.py
    return env


def run(cmd: list[str], timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=clean_env()
    )


def free_gb(path: Path) -> float:
    path.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(path).free / 1e9


def build_wheel(out: Path) -> Path:
    result = run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(out), str(REPO)],
        timeout=600,
    )
    if result.returncode != 0:
        raise SystemExit(f"torch_versions: cannot build the wheel: {result.stderr[-500:]}")
    (wheel,) = out.glob("elastic_launch-*.whl")
    return wheel


def make_venv(venv: Path, version: str, wheel: Path) -> dict[str, Any]:
    """A venv holding torch ``version`` and elastic-launch (reused when it already holds
    that torch); what it took."""
    python = venv / "bin" / "python"
    started = time.monotonic()
    have = None
    if python.exists():
        have = run([str(python), "-c", "import torch; print(torch.__version__)"], 300)
    if have is None or have.returncode != 0 or have.stdout.split("+")[0].strip() != version:
        shutil.rmtree(venv, ignore_errors=True)
        made = run([sys.executable, "-m", "venv", str(venv)], 300)
        if made.returncode != 0:
            raise RuntimeError(f"venv: {made.stderr[-500:]}")
        torch = run([str(python), "-m", "pip", "install", "-q", f"torch=={version}"], 3600)
        if torch.returncode != 0:
            raise RuntimeError(f"pip install torch=={version}: {torch.stderr[-800:]}")
    ours = run([str(python), "-m", "pip", "install", "-q", "--force-reinstall", str(wheel)], 600)
    if ours.returncode != 0:
        raise RuntimeError(f"pip install {wheel.name}: {ours.stderr[-800:]}")
    size = run(["du", "-sb", str(venv)], 120).stdout.split()[0]
    return {"seconds": round(time.monotonic() - started, 1), "bytes": int(size)}


def check_store(venv: Path, tmp: Path) -> dict[str, Any]:
    result = run([str(venv / "bin" / "python"), str(DIFFERENTIAL)], 600, cwd=tmp)
    lines = [ln for ln in result.stdout.splitlines() if ln.strip()]
    return {"ok": result.returncode == 0, "summary": lines[-1] if lines else "", "diff": lines[:-1]}


def flag_line(option: dict[str, Any], string: str, tmp: Path) -> list[str]:
    """``string`` (and a value for it) as one command-line word or two."""
    if option["nargs"] == 0:
        return [string]
    dash = "--" + string.lstrip("-").replace("_", "-")
    value = SAMPLE_VALUES.get(dash)
    if value is None and option["choices"]:
        value = option["choices"][0]
    if value is None:
        default = option["default"]
        value = "" if default in ("None", "''", "[]") else default.strip("'")
    return [string, value.format(tmp=tmp)]


def check_flags(venv: Path, tmp: Path) -> dict[str, Any]:
    listed = run([str(venv / "bin" / "python"), "-c", TORCHRUN_OPTIONS], 300)
    if listed.returncode != 0:
        return {"ok": False, "error": listed.stderr[-500:]}
    script = tmp / "noop.py"  # a script, and an executable for --no-python
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    accepted, refused, unknown = [], {}, []
    for option in json.loads(listed.stdout.splitlines()[-1]):
        for string in option["strings"]:
            words = flag_line(option, string, tmp)
            if string in ALONE:
                cmd = [str(venv / "bin" / "elastic"), "run", *words]
            else:
                cmd = [str(venv / "bin" / "elastic"), "run", "--dry-run", *words, str(script)]
            result = run(cmd, 120, cwd=tmp)
            if result.returncode == 0:
                accepted.append(string)
            elif "no such option" in result.stderr:
                unknown.append(string)
            else:
                refused[string] = result.stderr.strip().splitlines()[-1][:160]
    return {
        "ok": not unknown,
        "accepted": len(accepted),
        "refused": refused,
        "unknown": unknown,
    }


def check_job(venv: Path, tmp: Path) -> dict[str, Any]:
    worker, out = tmp / "gloo_worker.py", tmp / "out"
    worker.write_text(GLOO_WORKER)
    out.mkdir(exist_ok=True)
    started = time.monotonic()
    result = run(
        [str(venv / "bin" / "elastic"), "run", "--standalone", "--nproc-per-node=2"]
        + [str(worker), str(out)],
        600,
        cwd=tmp,
    )
    seconds = round(time.monotonic() - started, 2)
    records = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    ok = result.returncode == 0 and [r["sum"] for r in records] == [3.0, 3.0]
    report = {"ok": ok, "seconds": seconds, "exit": result.returncode, "workers": records}
    if not ok:
        report["stderr"] = result.stderr[-1500:]
    return report


def check_version(version: str, root: Path, wheel: Path, keep: bool) -> dict[str, Any]:
    venv = root / f"torch-{version}"
    report: dict[str, Any] = {"version": version, "venv": str(venv)}
    try:
        report["venv_made"] = make_venv(venv, version, wheel)
        with tempfile.TemporaryDirectory(prefix="torch-versions-") as tmp:
            report["store"] = check_store(venv, Path(tmp))
            report["flags"] = check_flags(venv, Path(tmp))
            report["job"] = check_job(venv, Path(tmp))
        report["ok"] = all(report[k]["ok"] for k in ("store", "flags", "job"))
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        report["ok"], report["error"] = False, str(exc)
    finally:
        if not keep:
            shutil.rmtree(venv, ignore_errors=True)
    return report


def print_report(report: dict[str, Any]) -> None:
    print(f"torch {report['version']}: {'ok' if report['ok'] else 'FAILED'}")
    if "error" in report:
        print(f"  error: {report['error']}")
        return
    made = report["venv_made"]
    print(f"  venv:   {made['bytes'] / 1e9:.1f} GB, ready in {made['seconds']} s")
    store = report["store"]
    print(f"  store:  {store['summary']}")
    for line in store["diff"]:
        print(f"          {line}")
    flags = report["flags"]
    if "error" in flags:
        print(f"  flags:  cannot read torchrun's parser: {flags['error']}")
    else:
        print(
            f"  flags:  {flags['accepted']} option strings accepted, "
            f"{len(flags['refused'])} known but refused, {len(flags['unknown'])} unknown"
        )
        for string, why in flags["refused"].items():
            print(f"          refused {string}: {why}")
        for string in flags["unknown"]:
            print(f"          UNKNOWN {string}")
    job = report["job"]
    torch_seen = {w["torch"] for w in job["workers"]}
    print(
        f"  job:    exit {job['exit']} in {job['seconds']} s, all_reduce sums "
        f"{[w['sum'] for w in job['workers']]}, workers' torch {sorted(torch_seen)}"
    )
    if "stderr" in job:
        print(job["stderr"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", default="2.13.0,2.14.1")
    parser.add_argument("--root", type=Path, default=Path("/tmp/elastic-torch-venvs"))
    parser.add_argument("--keep", action="store_true", help="keep the venvs (reused next time)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    free = free_gb(args.root)
    print(f"{args.root}: {free:.1f} GB free")
    if free < NEEDED_GB:
        print(f"torch_versions: a venv needs up to {NEEDED_GB:g} GB; free some space first")
        return 2
    reports = []
    with tempfile.TemporaryDirectory(prefix="torch-versions-wheel-") as wheels:
        wheel = build_wheel(Path(wheels))
        for version in args.versions.split(","):
            report = check_version(version.strip(), args.root, wheel, args.keep)
            print_report(report)
            reports.append(report)
    if args.json:
        args.json.write_text(json.dumps(reports, indent=2))
    return 0 if all(r["ok"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
