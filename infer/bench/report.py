"""specdec-bench's outputs: DIR/results.json, DIR/results.md and DIR/speedup.png."""
from __future__ import annotations

import json
import os
from pathlib import Path

FORMAT = "specdec-bench/1"

# Spec-Bench's published leaderboard (hemingkx/Spec-Bench, Leaderboard.md, "Leaderboard on A100",
# Vicuna-7B-v1.3, greedy, FP16, batch 1, mean of 3 runs): speedup per category, mean accepted
# tokens, overall speedup. Columns: MT-bench (multi-turn), translation, summarization, QA,
# math reasoning, RAG, tau, overall.
PUBLISHED = {
    "source": "hemingkx/Spec-Bench Leaderboard.md — A100 80GB, Vicuna-7B-v1.3, greedy, FP16, batch 1",
    "columns": ["Multi-turn", "Translation", "Summarization", "QA", "Math", "RAG", "τ", "Overall"],
    "rows": [
        ("EAGLE", "2.67x", "1.99x", "2.23x", "2.12x", "2.67x", "2.04x", "3.61", "2.29x"),
        ("Hydra", "2.45x", "1.94x", "1.79x", "2.03x", "2.49x", "1.77x", "3.24", "2.09x"),
        ("Medusa", "2.05x", "1.73x", "1.57x", "1.75x", "2.05x", "1.51x", "2.32", "1.78x"),
        ("PLD", "1.64x", "1.04x", "2.43x", "1.14x", "1.61x", "1.71x", "1.73", "1.59x"),
        ("SpS", "1.66x", "1.13x", "1.62x", "1.49x", "1.47x", "1.55x", "2.28", "1.49x"),
        ("REST", "1.63x", "1.31x", "1.36x", "1.66x", "1.21x", "1.73x", "1.82", "1.48x"),
        ("Lookahead", "1.40x", "1.14x", "1.19x", "1.24x", "1.55x", "1.09x", "1.66", "1.27x"),
    ],
}


def prepare_out(out_dir, overwrite: bool = False) -> Path:
    """Create the output folder and check that it takes files, or raise BenchError saying why;
    an earlier run's results there are kept unless ``overwrite``."""
    from .specbench import BenchError

    out = Path(out_dir)
    if not overwrite and (out / "results.json").is_file():
        raise BenchError(f"--out {out} already holds the results of an earlier run; choose another "
                         "--out, or pass --overwrite to replace them")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise BenchError(f"--out {out}: cannot be a folder ({err.strerror})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise BenchError(f"--out {out}: not writable")
    return out


def write_results(out_dir, machine: dict, target: dict, settings: dict, methods: dict) -> list[Path]:
    """Write the three report files; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {"format": FORMAT, "machine": machine, "target": target, "settings": settings,
            "methods": methods}
    paths = [out / "results.json", out / "results.md", out / "speedup.png"]
    paths[0].write_text(json.dumps(data, indent=2) + "\n")
    paths[1].write_text(markdown(data))
    plot(data, paths[2])
    return paths


# ---------------------------------------------------------------------------- Markdown


def _fmt(m: dict, key: str, digits: int = 2, suffix: str = "") -> str:
    value = m[key]
    text = f"{value:.{digits}f}{suffix}"
    if f"{key}_std" in m:
        text += f" ± {m[f'{key}_std']:.{digits}f}"
    return text


def _tree_settings(s: dict) -> list[str]:
    """The header line for ``--budget`` / ``--opt`` (none when every drafter ran its own)."""
    parts = []
    if s.get("budget"):
        b = s["budget"]
        parts.append(f"tree budget {b['max_nodes']} nodes, depth {b['max_depth']}, top-{b['topk']}")
    if s.get("drafter_opts"):
        parts.append("drafter options " + ", ".join(f"{k}={v}" for k, v in s["drafter_opts"].items()))
    return [f"- every speculative method: {'; '.join(parts)}"] if parts else []


def markdown(data: dict) -> str:
    s, methods = data["settings"], data["methods"]
    cats = list(next(iter(methods.values()))["categories"])
    mach, tgt = data["machine"], data["target"]
    lines = [
        "# specdec-bench: Spec-Bench method",
        "",
        f"- target: `{tgt.get('name')}` ({tgt.get('model_type')}, dtype {s['dtype']})",
        f"- machine: {mach.get('cpu')}, {mach.get('cores')} cores"
        + (f", {mach['cpu_capability']}, native bf16 {'yes' if mach.get('cpu_native_bf16') else 'no'}"
           if mach.get("cpu_capability") else "")
        + f", torch {mach.get('torch')}, device {mach.get('device')}"
        + (f" ({mach['gpu']})" if mach.get("gpu") else ""),
        f"- questions: {s['n_questions']} from `{s['questions']}` "
        f"({', '.join(cats)}); max_new_tokens {s['max_new_tokens']}; runs {s['runs']}; "
        "batch 1, greedy, warm-up on the first question",
        *_tree_settings(s),
        "- speedup = mean per-question speed (new tokens / wall time, prefill included) over that "
        "of plain decoding in this runtime; vs HF = over HF transformers `generate()`; τ = mean "
        "tokens added per decoding step; identical = outputs equal to plain greedy",
        "",
        "## Speedup per category (vs plain decoding in this runtime)",
        "",
        "| method | " + " | ".join(cats) + " | τ | overall |",
        "|---|" + "---:|" * (len(cats) + 2),
    ]
    for name, m in methods.items():
        row = [f"{m['categories'][c]['speedup']:.2f}x" for c in cats]
        lines.append(f"| {name} | " + " | ".join(row) + f" | {m['overall']['tau']:.2f} | "
                     f"{_fmt(m['overall'], 'speedup', suffix='x')} |")
    lines += [
        "",
        "## Overall",
        "",
        "| method | τ | tokens/s | speedup | speedup vs HF | identical | questions | new tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in methods.items():
        o = m["overall"]
        lines.append(f"| {name} | {_fmt(o, 'tau')} | {_fmt(o, 'tokens_per_s', 1)} | "
                     f"{_fmt(o, 'speedup', suffix='x')} | {_fmt(o, 'speedup_vs_hf', suffix='x')} | "
                     f"{o['identical_rate']:.0%} | {o['n_questions']} | {o['new_tokens']:.0f} |")
    lines += ["", "## Acceptance (share of steps that accepted the k-th drafted token)", "",
              "| method | steps | " + " | ".join(f"k={k}" for k in range(1, 9)) + " |",
              "|---|---:|" + "---:|" * 8]
    for name, m in methods.items():
        rates = m["overall"]["accept_rate_by_position"][:8]
        cells = [f"{r:.2f}" for r in rates] + ["–"] * (8 - len(rates))
        lines.append(f"| {name} | {m['overall']['steps']} | " + " | ".join(cells) + " |")
    lines += ["", "## Reference: Spec-Bench's published figures (a different model and GPU)", "",
              f"Published by Spec-Bench ({PUBLISHED['source']}); speedups there are over "
              "HF-style vanilla decoding of Vicuna-7B on an A100 and are **not comparable** "
              "number-for-number with the table above (different target, hardware and runtime).",
              "", "| method | " + " | ".join(PUBLISHED["columns"]) + " |",
              "|---|" + "---:|" * len(PUBLISHED["columns"])]
    for row in PUBLISHED["rows"]:
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- plot


def plot(data: dict, path: Path) -> None:
    """Left: speedup per category per method (grouped bars). Right: acceptance-length histogram
    (share of steps adding k tokens) per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    methods = data["methods"]
    names = list(methods)
    cats = list(next(iter(methods.values()))["categories"]) + ["overall"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(10, 1.2 * len(cats) + 6), 4.8))
    width = 0.8 / max(len(names), 1)
    x = np.arange(len(cats))
    for i, name in enumerate(names):
        m = methods[name]
        vals = [m["categories"][c]["speedup"] for c in cats[:-1]] + [m["overall"]["speedup"]]
        ax1.bar(x + (i - (len(names) - 1) / 2) * width, vals, width, label=name)
    ax1.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax1.set_xticks(x, cats, rotation=35, ha="right")
    ax1.set_ylabel("speedup vs plain decoding")
    ax1.set_title(f"Spec-Bench speedup — {data['target'].get('name')}")
    ax1.legend(fontsize=8)
    # hf and plain add one token per step by construction: leave them out unless alone.
    drafted = [n for n in names if n not in ("hf", "plain")] or names
    longest = max(len(methods[n]["overall"]["accept_length_hist"]) for n in drafted)
    ks = np.arange(1, max(longest, 2))
    width = 0.8 / len(drafted)
    for i, name in enumerate(drafted):
        hist = np.array(methods[name]["overall"]["accept_length_hist"], dtype=float)
        share = np.zeros(len(ks))
        n = min(len(hist) - 1, len(ks))
        share[:n] = hist[1:n + 1] / max(hist.sum(), 1.0)
        ax2.bar(ks + (i - (len(drafted) - 1) / 2) * width, share, width, label=name)
    ax2.set_xticks(ks)
    ax2.set_xlabel("tokens added per step (accepted drafts + 1)")
    ax2.set_ylabel("share of steps")
    ax2.set_title("acceptance length")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
