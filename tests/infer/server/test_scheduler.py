"""The scheduler's per-request accounting (infer/server/scheduler.py) against the engine's own."""
from __future__ import annotations

import asyncio

import pytest

from specdec.infer.server.metrics import ServerMetrics
from specdec.infer.server.scheduler import Scheduler


def test_usage_tau_counts_steps_as_the_engine_and_specdec_generate_do(tiny_target):
    """usage.speculation.tau is the engine's ``Request.stats`` tau (what specdec-generate prints):
    accepted drafts + 1 per verification step, the prefill's first token not a step. It counted
    that token as a step of its own, so the same decoding read lower through the server."""
    from specdec.infer.drafters import make_drafter
    from specdec.infer.engine import Engine, SamplingParams

    engine = Engine(tiny_target, make_drafter("pld", tiny_target), max_batch=2, max_len=128)
    engine_stats, step = {}, engine.step

    def recording_step(budget=None):
        outputs = step(budget)
        engine_stats.update({o.request_id: o.stats for o in outputs if o.finished})
        return outputs

    engine.step = recording_step
    scheduler = Scheduler(engine, None, ServerMetrics(), max_batch=2)

    async def serve():
        scheduler.start(asyncio.get_running_loop())
        try:
            handles = [scheduler.submit([5, 6, 7, 8] * 6, SamplingParams(max_tokens=24, ignore_eos=True)),
                       scheduler.submit([9, 10, 11], SamplingParams(max_tokens=1))]
            for handle in handles:
                async for _ in handle.deltas():
                    pass
            return handles
        finally:
            scheduler.stop()

    copying, single = asyncio.run(serve())
    for handle in (copying, single):
        spec, stats = handle.speculation(), engine_stats[handle.id]
        assert spec["decode_steps"] == stats["steps"] and spec["accepted_tokens"] == sum(stats["accepted_per_step"])
        assert spec["tau"] == pytest.approx(stats["tau"], abs=1e-4)
    assert copying.speculation()["accepted_tokens"] > 0  # the two ways of counting differ here
    assert single.speculation() == {"accepted_tokens": 0, "decode_steps": 0, "tau": 1.0, "mean_budget": 0.0}
