"""Runs at the start of every worker interpreter (the agent puts this directory first on
the workers' ``PYTHONPATH``) when ``--stall-timeout`` or the FileTimer server is on, and
from ``elastic.training.regroup.opt_in`` in a worker that can regroup in place.

It registers a faulthandler-style dump of every thread's Python stack on ``SIGURG`` into
the file the agent named in ``ELASTIC_STACK_FILE``: the agent sends the signal before it
kills a hung worker, no ptrace needed. ``SIGURG``'s default action is to ignore it, so a
process that never registered (not Python, ``python -I``) is unharmed by it, and only
out-of-band socket data raises it otherwise. Then it runs the ``sitecustomize`` module
this one shadows, if there is one further down ``sys.path``.

Standard library only and never raises: it also runs under interpreters that do not have
elastic installed (``PYTHON_EXEC``).
"""

import os
import sys

ENV_FILE = "ELASTIC_STACK_FILE"
ENV_SIGNAL = "ELASTIC_STACK_SIGNAL"
_REGISTERED = "_elastic_stack_dump"
_file = None


def install(default: str = "") -> None:
    """Register the dump on the agent's signal, into the agent's file (once per process).
    ``default``: the file when the agent named none (a worker that can regroup in place
    registers as it says so, ``elastic.training.regroup.opt_in``)."""
    global _file
    path = os.environ.get(ENV_FILE) or default
    if not path or _file is not None or _REGISTERED in sys.modules:
        return
    try:
        import faulthandler
        import signal
        import threading

        signum = int(os.environ.get(ENV_SIGNAL) or signal.SIGURG)
        if callable(signal.getsignal(signum)):
            return  # the script's own handler (registered later than start-up): keep it
        f = open(path, "a", encoding="utf-8")  # noqa: SIM115 -- kept open for the handler
        main = threading.main_thread().ident or 0
        f.write(f"# elastic: pid {os.getpid()} main thread 0x{main:016x}\n")
        f.flush()
        # chain=False: faulthandler then installs with SA_RESTART (interrupted system
        # calls resume), and there is no previous handler to chain to at start-up.
        faulthandler.register(signum, file=f, all_threads=True, chain=False)
        _file = f
        # Run as the interpreter's sitecustomize and imported as elastic's, this file is
        # two modules: the mark says the process registered, whichever did.
        sys.modules[_REGISTERED] = sys.modules[__name__]
    except Exception:  # a worker must start whatever happens here
        pass


def _chain() -> None:
    """Run the next ``sitecustomize`` on ``sys.path`` (the one this module shadows)."""
    try:
        import importlib.machinery
        import importlib.util

        here = os.path.dirname(os.path.abspath(__file__))
        rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    except Exception:
        return
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)  # its errors are its own, as without us


if __name__ == "sitecustomize":
    install()
    _chain()
