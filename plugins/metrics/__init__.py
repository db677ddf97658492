"""Built-in metrics sinks (entry points in ``elastic.metrics``) and, in ``events``, the
hook plugin that turns the agent's lifecycle into metrics.

The sinks are looked up on first use, so loading the ``metrics`` hook plugin (every
agent does) does not import them. ``PrometheusSink`` needs the ``prometheus`` extra, whose
absence then fails that sink's load (one line naming the extra), not the others'.

Owns ``sinks`` (``console``, ``jsonl``, ``prometheus``) and ``events`` (the ``metrics``
hook plugin). Imports core's ``metrics``, ``plugin`` and ``interfaces``, and
prometheus-client on first use; may import core's public rooms only (contract
``plugins-public-core``), no torch.
"""

from typing import TYPE_CHECKING, Any

from elastic.core.plugin.extras import needs_extra

if TYPE_CHECKING:
    from elastic.plugins.metrics.sinks import ConsoleSink, JsonlSink, PrometheusSink

__all__ = ["ConsoleSink", "JsonlSink", "PrometheusSink"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name == "PrometheusSink":
        with needs_extra("the prometheus metrics sink"):
            import prometheus_client  # noqa: F401
    from elastic.plugins.metrics import sinks

    return getattr(sinks, name)
