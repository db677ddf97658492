"""An interpreter that has this checkout installed as a user installs it, for benches.

The development environment installs the project editable (``pip install -e .``):
setuptools then adds a ``.pth`` file whose import hook every interpreter of that
environment loads at start-up (``pathlib``, ``re``, ``urllib.parse`` and more), agents
and workers alike, ours and torchrun's. A user's ``pip install elastic-launch`` has no
such hook. ``installed_python`` makes a virtual environment (once per state of the
source tree, under the temp folder) with the checkout installed from a wheel and
everything else (torch, click, pluggy) taken from this environment through a plain path
entry, whose own ``.pth`` files, the hook among them, are not run; and a ``torchrun``
script of its own, as torch's wheel would have made there.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import site
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elastic.harness.commands import REPO

STALE = 86400.0  # s since its last use after which another tree's copy is removed
TORCHRUN = """import sys
from torch.distributed.run import main
sys.exit(main())
"""


def _tracked(source: Path) -> list[str]:
    """The files git tracks in ``source``, as paths relative to it."""
    listed = subprocess.run(
        ["git", "-C", str(source), "ls-files", "-z"], capture_output=True, check=True
    ).stdout
    return sorted(os.fsdecode(name) for name in listed.split(b"\0") if name)


def _copy_key(source: Path) -> str:
    """What the copy is made of: every file git tracks, as it is now, and the environment
    its dependencies come from (another checkout's environment, on the same machine,
    makes a copy of its own: the temp folder is shared)."""
    digest = hashlib.sha256(sys.version.encode())
    digest.update("\0".join([sys.executable, *site.getsitepackages()]).encode())
    for name in _tracked(source):
        path = source / name
        digest.update(os.fsencode(name))
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def copy_tracked(source: Path, dest: Path) -> Path:
    """A copy of the files git tracks in ``source`` (as they are now), to build a wheel
    from: a build in the checkout leaves its ``build/`` and ``*.egg-info`` there, and an
    egg-info in the working directory is a distribution to every interpreter started in
    it, with the entry points of the day it was built. Returns ``dest``."""
    for name in _tracked(source):
        if (source / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / name, dest / name)
    return dest


def without_checkout(env: dict[str, str]) -> dict[str, str]:
    """``env`` for the installed copy's interpreter: no ``PYTHONPATH``, where a checkout
    would shadow the installed package."""
    return {k: v for k, v in env.items() if k != "PYTHONPATH"}


def installed_python(source: Path = REPO) -> Path:
    """The interpreter of an environment with ``source`` installed from a wheel (made
    now, or kept from an earlier call for the same tree)."""
    home = Path(tempfile.gettempdir()) / f"elastic-bench-install-{_copy_key(source)}"
    # One maker at a time (two pytest workers, a bench beside a test): the others wait
    # and take what it made.
    with open(f"{home}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _made(source, home)


def _made(source: Path, home: Path) -> Path:
    python = home / "bin" / "python"
    if (home / "ready").exists():
        os.utime(home / "ready")  # in use: kept
        return python
    for old in home.parent.glob("elastic-bench-install-*"):
        if old.suffix == ".lock":
            continue
        used = old / "ready" if (old / "ready").exists() else old  # or still being made
        with contextlib.suppress(OSError):
            if time.time() - used.stat().st_mtime > STALE:
                shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(home, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home)], check=True)
    (target,) = Path(home, "lib").glob("python*/site-packages")
    # Torch and the other dependencies, from this environment: a path, not a site folder.
    (target / "deps-from-dev.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    tree = copy_tracked(source, home / "source")
    subprocess.run(
        [
            str(python),
            *("-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"),
            str(tree),
        ],
        check=True,
        env=without_checkout(dict(os.environ)),
    )
    shutil.rmtree(tree)
    script = home / "bin" / "torchrun"
    script.write_text(f"#!{python}\n{TORCHRUN}")
    script.chmod(0o755)
    (home / "ready").write_text("")
    return python
