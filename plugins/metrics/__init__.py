"""Built-in metrics sinks (entry points in ``elastic.metrics``) and, in ``events``, the
hook plugin that turns the agent's lifecycle into metrics."""

from elastic.plugins.metrics.sinks import ConsoleSink, JsonlSink, PrometheusSink

__all__ = ["ConsoleSink", "JsonlSink", "PrometheusSink"]
