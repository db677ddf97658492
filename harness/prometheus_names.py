"""Prometheus naming conventions, checked on an exposition: what the metrics and health
tests assert of every name the product exports."""

from __future__ import annotations


def convention_breaks(exposition: str) -> list[str]:
    """Names in a Prometheus exposition that break its naming conventions: ``_total`` only
    on counters (and always on them), no ``_count``/``_sum``/``_bucket`` on a gauge, a
    duration's unit as its suffix. A deprecated alias must name a family that is there."""
    from prometheus_client.parser import text_string_to_metric_families

    families = list(text_string_to_metric_families(exposition))
    names = {f.name for f in families}
    breaks = []
    for family in families:
        if family.documentation.startswith("deprecated alias of "):
            target = family.documentation.removeprefix("deprecated alias of ").split(",")[0]
            if target not in names:
                breaks.append(f"{family.name}: alias of {target}, which is missing")
            continue
        samples = {s.name for s in family.samples}
        if family.type == "counter" and not all(n.endswith("_total") for n in samples):
            breaks.append(f"{family.name}: a counter without _total")
        if family.type == "gauge" and family.name.endswith(("_total", "_count", "_sum", "_bucket")):
            breaks.append(f"{family.name}: a gauge named like a counter or a summary")
        if (
            family.type == "gauge"
            and "duration" in family.name
            and not family.name.endswith("_seconds")
        ):
            breaks.append(f"{family.name}: a duration without its unit")
    return breaks
