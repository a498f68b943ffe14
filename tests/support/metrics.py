"""Values read from a metrics text (Prometheus' text format)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of the one sample of ``name`` (or ``name_total``) whose labels include
    ``labels``."""
    found = [
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name in (name, f"{name}_total") and labels.items() <= s.labels.items()
    ]
    assert len(found) == 1, (name, labels, found)
    return float(found[0])
