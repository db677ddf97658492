"""``elastic run``'s training script: how the workers run it (Python, ``-m``, a program,
``runpy``), checked before anything starts, and the fingerprint fields it gives the
rendezvous (so nodes running another script or entrypoint are refused at the door)."""

from __future__ import annotations

import os
import shutil
from typing import Any

import click
from elastic.cli.options import bad
from elastic.core.launch.launcher import python_exec, run_script_path
from elastic.core.rendezvous.fingerprint import node_fingerprint


def entrypoint_for(opts: dict[str, Any]) -> tuple[Any, tuple[str, ...]]:
    script, script_args = opts["training_script"], tuple(opts["training_script_args"])
    if opts["no_python"] and opts["module"]:
        raise click.UsageError("--no-python and -m/--module cannot be used together")
    if opts["run_path"]:
        return run_script_path, (script, *script_args)
    if opts["no_python"]:
        if not (shutil.which(script) or os.access(script, os.X_OK)):
            raise bad("training_script", f"{script!r} is not an executable program (--no-python)")
        return script, script_args
    if opts["module"]:
        return python_exec(), ("-u", "-m", script, *script_args)
    return python_exec(), ("-u", script, *script_args)


def check_script(opts: dict[str, Any]) -> None:
    script = opts["training_script"]
    if script.startswith("-"):
        raise click.UsageError(f"no such option: {script} (see elastic run --help)")
    if opts["module"] or opts["no_python"]:
        return
    if not os.path.isfile(script):
        raise bad("training_script", f"{script!r} does not exist; give the path of a Python script")


def fingerprint_for(opts: dict[str, Any], nproc: int, max_restarts: int) -> dict[str, str]:
    script = opts["training_script"]
    return node_fingerprint(
        nproc_per_node=nproc,
        entrypoint=("-m " if opts["module"] else "") + script,
        script=None if opts["module"] or opts["no_python"] else script,
        max_restarts=max_restarts,
    )
