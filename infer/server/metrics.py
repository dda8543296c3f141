"""Prometheus metrics of one server (its own registry, so tests can run several apps).

Names follow vLLM's where one exists (``*_time_to_first_token_seconds``,
``*_time_per_output_token_seconds``, ``*_e2e_request_latency_seconds``).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics

disable_created_metrics()  # the *_created series only clutter a scrape

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128)
_NODES = (0, 1, 2, 4, 8, 16, 32, 64, 128)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = r = CollectorRegistry()
        p = "specdec_"
        self.requests = Counter(p + "requests", "Requests finished, by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed", registry=r)
        self.cached_tokens = Counter(p + "prefix_cache_hit_tokens",
                                     "Prompt tokens whose K/V came from the prefix cache", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.accepted_tokens = Counter(p + "spec_accepted_tokens", "Draft tokens accepted", registry=r)
        self.decode_steps = Counter(p + "decode_steps", "Per-request decoding steps (tokens added per step = tau)",
                                    registry=r)
        self.tokens_per_s = Gauge(p + "tokens_per_second", "Generated tokens/s, moving average over steps",
                                  registry=r)
        self.tau = Gauge(p + "spec_tau", "Mean tokens added per decoding step, moving average", registry=r)
        self.acceptance = Gauge(p + "spec_acceptance_rate",
                                "Estimated P(draft position accepted | previous accepted)", ["position"],
                                registry=r)
        self.batch_size = Histogram(p + "batch_size", "Sequences per engine step", buckets=_BATCH, registry=r)
        self.budget = Histogram(p + "spec_budget_nodes", "Draft tree nodes chosen per request per step",
                                buckets=_NODES, registry=r)
        self.budget_mean = Gauge(p + "spec_budget_nodes_mean", "Mean draft nodes chosen in the last step",
                                 registry=r)
        self.cost_coef = Gauge(p + "cost_model_seconds", "Fitted step-cost coefficients (a, b·batch, c·tokens, "
                               "d·tokens²)", ["term"], registry=r)
        self.queue_length = Gauge(p + "queue_length", "Requests waiting for a slot", registry=r)
        self.running = Gauge(p + "running_requests", "Requests holding a slot", registry=r)
        self.step_seconds = Histogram(p + "step_seconds", "Engine step wall time", buckets=_LATENCY, registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token", buckets=_LATENCY,
                              registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Time per output token after the first",
                              buckets=_TOKEN_LATENCY, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Request latency", buckets=_LATENCY, registry=r)
        self._ema_tps = self._ema_tau = None

    @staticmethod
    def _ema(old, new, alpha=0.1):
        return new if old is None else (1 - alpha) * old + alpha * new

    def on_step(self, batch: int, seconds: float, new_tokens: int, decode_rows: int, accepted: int,
                budgets: list[int], acceptance_rates=None, cost: dict | None = None) -> None:
        """One engine step: ``decode_rows`` sequences added ``new_tokens`` (incl. ``accepted`` drafts)."""
        if batch:  # prefill-only steps have no decode batch
            self.batch_size.observe(batch)
        self.step_seconds.observe(seconds)
        self.accepted_tokens.inc(accepted)
        self.decode_steps.inc(decode_rows)
        if seconds > 0 and new_tokens:
            self._ema_tps = self._ema(self._ema_tps, new_tokens / seconds)
            self.tokens_per_s.set(self._ema_tps)
        if decode_rows:
            self._ema_tau = self._ema(self._ema_tau, (accepted + decode_rows) / decode_rows)
            self.tau.set(self._ema_tau)
        for n in budgets:
            self.budget.observe(n)
        self.budget_mean.set(sum(budgets) / len(budgets) if budgets else 0)
        if acceptance_rates is not None:
            for i, a in enumerate(acceptance_rates):
                self.acceptance.labels(position=str(i + 1)).set(float(a))
        for term, v in (cost or {}).items():
            self.cost_coef.labels(term=term).set(v)

    def on_queue(self, waiting: int, running: int) -> None:
        self.queue_length.set(waiting)
        self.running.set(running)
        if not waiting and not running:  # idle: no steps move the average, which kept its last rate
            self._ema_tps = None
            self.tokens_per_s.set(0)

    def on_finish(self, endpoint: str, outcome: str, prompt_tokens: int, completion_tokens: int,
                  latency: float, ttft: float | None, cached_tokens: int = 0) -> None:
        self.requests.labels(endpoint=endpoint, outcome=outcome).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.e2e.observe(latency)
        if ttft is not None:
            self.ttft.observe(ttft)
            if completion_tokens > 1:
                self.tpot.observe((latency - ttft) / (completion_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
