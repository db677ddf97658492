"""The optional dependencies of built-in features: each is an extra of elastic-launch
(``pyproject.toml``, ``[project.optional-dependencies]``), and a feature used without its
extra fails with one line naming it, not an ``ImportError`` from deep inside.

A module that needs one imports it inside ``needs_extra``; the plugin loader
(``named.py``) words the line for the plugin picked (``rendezvous backend 'etcd-v2'
needs python-etcd: pip install 'elastic-launch[etcd]'``), and ``elastic plugins list``
shows the same line as the plugin's status.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

DISTRIBUTION = "elastic-launch"

# The top-level module -> (the distribution that provides it, the extra that installs it).
EXTRAS: dict[str, tuple[str, str]] = {
    "etcd": ("python-etcd", "etcd"),
    "urllib3": ("urllib3", "etcd"),
    "prometheus_client": ("prometheus-client", "prometheus"),
}


class MissingExtraError(ImportError):
    """``feature`` needs ``distribution``, which ``pip install 'elastic-launch[extra]'``
    installs; the message is the one line to show."""

    def __init__(self, feature: str, distribution: str, extra: str) -> None:
        self.distribution, self.extra = distribution, extra
        super().__init__(self.line(feature))

    def line(self, feature: str) -> str:
        return f"{feature} needs {self.distribution}: pip install '{DISTRIBUTION}[{self.extra}]'"


@contextlib.contextmanager
def needs_extra(feature: str) -> Iterator[None]:
    """Turn a missing optional dependency (one of ``EXTRAS``) imported in the block into
    ``MissingExtraError`` naming ``feature`` and the extra; any other import error is
    left as it is (a bug of ours, or a broken install, is not a missing extra)."""
    try:
        yield
    except ModuleNotFoundError as exc:
        top = (exc.name or "").partition(".")[0]
        if top not in EXTRAS:
            raise
        raise MissingExtraError(feature, *EXTRAS[top]) from None
