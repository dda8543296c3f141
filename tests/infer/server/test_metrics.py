"""The server's Prometheus metrics (infer/server/metrics.py)."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from specdec.infer.server.metrics import ServerMetrics


def _value(metrics: ServerMetrics, name: str) -> float:
    text = metrics.render().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_an_idle_server_generates_zero_tokens_per_second():
    metrics = ServerMetrics()
    metrics.on_queue(0, 2)
    metrics.on_step(batch=2, seconds=0.1, new_tokens=6, decode_rows=2, accepted=4, budgets=[4, 4])
    assert _value(metrics, "specdec_tokens_per_second") == 60.0
    metrics.on_queue(0, 0)  # the last request finished; it read 60 tokens/s until the next step
    assert _value(metrics, "specdec_tokens_per_second") == 0.0
    metrics.on_step(batch=1, seconds=0.1, new_tokens=2, decode_rows=1, accepted=1, budgets=[4])
    assert _value(metrics, "specdec_tokens_per_second") == 20.0  # a new average, not 60's tail
