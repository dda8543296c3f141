"""Summaries of ``specdec-serve --step-log`` files, per batch-size bucket.

A policy's throughput at a concurrency level is one number; its step log says where it came
from: how often it speculated at each batch size, how many tokens a step added, what a step
cost inside the engine and around it (the scheduler's bookkeeping, the controller's plan). Two
servers' summaries side by side (``specdec-bench --serve --step-logs``) tell a policy that loses
in its choices from one that loses in overhead.
"""
from __future__ import annotations

import json
from pathlib import Path

AROUND = ("gap_ms", "plan_ms", "after_ms")  # a step's time outside the engine


def bucket(batch: int) -> str:
    """1 | 2-3 | 4-7 | 8-15 | ... (the goodput policy's own batch-size buckets)."""
    lo = 1 << (batch.bit_length() - 1)
    return str(lo) if lo == 1 else f"{lo}-{2 * lo - 1}"


def summarize(path: str | Path) -> list[dict]:
    """One row per batch-size bucket of the decode steps (batch > 0) in a step log, smallest first."""
    groups: dict[int, list[dict]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                step = json.loads(line)
                if step["batch"] > 0:
                    groups.setdefault(step["batch"].bit_length(), []).append(step)
    rows = []
    for key in sorted(groups):
        steps = groups[key]
        n = len(steps)
        tokens = sum(s["batch"] + s["accepted"] for s in steps)
        engine = sum(s["engine_ms"] for s in steps)
        around = sum(s[k] for s in steps for k in AROUND)
        rows.append({
            "batch": bucket(steps[0]["batch"]), "steps": n,
            "speculating": sum(1 for s in steps if s["nodes"] > 0) / n,
            "with_prefill": sum(1 for s in steps if s["prefill_tokens"] > 0) / n,
            "tokens_per_step": tokens / n, "engine_ms": engine / n, "around_ms": around / n,
            "tokens_per_s": 1e3 * tokens / max(engine + around, 1e-9)})
    return rows


def markdown(summaries: dict[str, list[dict]]) -> list[str]:
    """The Markdown table of every policy's summary (policy -> ``summarize`` rows)."""
    lines = ["## Where the step time went (`--step-logs`)", "",
             "Decode steps by batch size: the share that speculated or also prefilled a prompt chunk, tokens "
             "added a step, ms a step inside the engine and around it (scheduler and controller), and the "
             "tokens/s that makes.", "",
             "| policy | batch | steps | speculating | with prefill | tokens/step | engine ms | around ms | tok/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for policy, rows in summaries.items():
        for r in rows:
            lines.append(f"| {policy} | {r['batch']} | {r['steps']} | {100 * r['speculating']:.0f}% | "
                         f"{100 * r['with_prefill']:.0f}% | {r['tokens_per_step']:.2f} | {r['engine_ms']:.2f} | "
                         f"{r['around_ms']:.2f} | {r['tokens_per_s']:.1f} |")
    return lines
