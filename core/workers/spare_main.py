"""A warm spare's program (``spare.py``): an interpreter started while the workers run,
waiting on a pipe for lines from the agent. ``warm MODULES``: import them (what the worker
it stands in for had loaded: ``torch``). ``go {...}``: when a restart needs a worker on
its local rank, the new worker's environment, arguments and streams; this program takes
them and runs the script as ``python -u script.py`` would (``runpy``, ``__main__``,
``sys.argv``, ``sys.path[0]``), so an exception or ``sys.exit`` ends the process as it
would end a worker started afresh. A pipe closed without ``go``: the spare is not needed,
exit 0.

Run as ``python -u spare_main.py FD``; standard library only.
"""

from __future__ import annotations

import sys

del sys.path[0]  # this file's directory (core/workers): never a worker's import path

import json  # noqa: E402
import os  # noqa: E402
import runpy  # noqa: E402


def _warm(modules: str) -> None:
    """Import what the worker imported; a failure here is the worker's to meet later."""
    for name in filter(None, modules.split(",")):
        try:
            __import__(name)
        except BaseException:  # noqa: BLE001 -- the script imports it again, and says so
            pass


def _wait_for_go(fd: int) -> dict | None:
    """Warm as told until the ``go`` line; None when the pipe closed without one."""
    with os.fdopen(fd, "rb") as pipe:
        for line in pipe:
            if line.startswith(b"warm "):
                _warm(line[5:].decode().strip())
            elif line.startswith(b"go "):
                return json.loads(line[3:])
    return None


def _redirect(dest: str, fd: int) -> None:
    if not dest:
        return  # the agent's own stream, which this process inherited
    target = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _install_stack_dump(boot_sitecustomize: str) -> None:
    """Register the stack dump the agent's boot ``sitecustomize`` would have at start
    (the spare started without the file to dump into: it is the new worker's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_elastic_boot_site", boot_sitecustomize)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        module.install()
    except Exception:  # noqa: BLE001 -- a worker must start whatever happens here
        pass


def main() -> None:
    go = _wait_for_go(int(sys.argv[1]))
    if go is None:
        sys.exit(0)
    os.environ.clear()
    os.environ.update(go["env"])
    _redirect(go["stdout"], 1)
    _redirect(go["stderr"], 2)
    if go["env"].get("ELASTIC_STACK_FILE"):
        _install_stack_dump(go["boot_sitecustomize"])
    argv = go["argv"]
    if go["module"]:
        sys.argv = list(argv)
        sys.path.insert(0, os.getcwd())  # as ``python -m`` puts it
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.realpath(argv[0])))  # as ``python x.py``
        runpy.run_path(os.path.abspath(argv[0]), run_name="__main__")  # __file__ absolute


if __name__ == "__main__":
    main()
