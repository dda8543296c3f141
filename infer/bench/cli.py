"""``specdec-bench``: speed and exactness of decoding methods on Spec-Bench.

    specdec-bench --target NAME_OR_PATH --methods plain,pld,eagle3=HEAD_PATH,... \\
        [--questions FILE] [--categories a,b] [--limit N] [--max-new-tokens N] [--dtype D] \\
        [--runs R] --out DIR

writes DIR/results.json, DIR/results.md and DIR/speedup.png (see ``specbench`` for the method).
``specdec-bench --serve ...`` is the server load generator (``serve_load``), a separate mode.
"""
from __future__ import annotations

import argparse
import sys

from specdec.infer.dtypes import AUTO_DECODING_HELP, DTYPE_CHOICES, dtype_name

EPILOG = """\
methods: plain, hf (HF transformers generate(); always run as the reference), head methods with
their folder (medusa=DIR, hydra=DIR, eagle=DIR, eagle3=DIR, mlp=DIR, sps=DIR, redrafter=DIR),
training-free pld, lookahead, rest (rest=DATASTORE_DIR for a datastore built by
`specdec-data datastore`), hybrid (hybrid=HEAD_DIR: an EAGLE-3 head merged with PLD + REST).
plain and hf are always added: every speedup is relative to them.

--limit N keeps N questions in all, taken round-robin over the chosen categories (the first of
each category, then the second of each, ...), so a small N still covers every category.
The methods take turns question by question (each on its own engine), so a machine that slows
down or speeds up during the run does not bias their ratios.

examples:
  specdec-bench --target smollm2-135m --methods plain,pld,lookahead,rest --limit 26 --out runs/bench
  # the τ a head would reach with the GPU's tree, measured on a CPU (τ does not depend on speed)
  specdec-bench --methods eagle3=HEAD --budget 60,7,10 --opt min_frontier_mass=0 --out runs/gpu-tree
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specdec-bench", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Spec-Bench's method: batch 1, greedy, chat template, multi-turn; per category "
                    "and overall τ, tokens/s, speedup vs plain decoding and vs HF generate(), and "
                    "whether every output equals plain greedy. (`specdec-bench --serve --help`: "
                    "the server load generator.)")
    p.add_argument("--target", default="smollm2-135m", help="target name or path (default: %(default)s)")
    p.add_argument("--methods", default="plain,pld",
                   help="comma-separated methods, NAME or NAME=VALUE (default: %(default)s)")
    p.add_argument("--questions", default=None,
                   help="Spec-Bench question.jsonl (default: the shipped Spec-Bench questions)")
    p.add_argument("--categories", default=None, help="comma-separated categories (default: all)")
    p.add_argument("--limit", type=int, default=None,
                   help="N questions in all, round-robin over the categories (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per turn (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES,
                   help=f"target dtype for every method, HF included; {AUTO_DECODING_HELP} "
                        "(default: %(default)s)")
    p.add_argument("--runs", type=int, default=1, help="timed passes; >1 adds *_std fields (default: 1)")
    p.add_argument("--budget", default=None, metavar="NODES,DEPTH,TOPK",
                   help="draft tree budget of every speculative method (default: each drafter's own, "
                        "tuned for the device: e.g. 4,4,3 on a CPU with native bf16, 60,7,10 on a GPU)")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="drafter option for every speculative method (repeatable; a method that does not "
                        "take it says so), e.g. --opt min_frontier_mass=0 to grow a head's tree as on a GPU")
    p.add_argument("--device", default="auto", help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results of an earlier run in --out (default: refuse)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--serve" in argv:  # the load generator is its own module with its own flags
        from specdec.infer.bench import serve_load
        return serve_load.main([a for a in argv if a != "--serve"])
    args = build_parser().parse_args(argv)
    from specdec.infer.bench.specbench import BenchError
    from specdec.infer.datastore import DatastoreError
    from specdec.infer.drafters import DrafterError
    from specdec.infer.target import TargetError

    try:
        paths = run(args)
    except (BenchError, DatastoreError, DrafterError, TargetError, FileNotFoundError) as err:
        print(f"specdec-bench: error: {err}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def run(args):
    from dataclasses import asdict

    from specdec.infer.bench import report, specbench
    from specdec.infer.generate import parse_budget, parse_opts
    from specdec.infer.target import load_target, resolve_device

    if args.max_new_tokens < 1:
        raise specbench.BenchError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.runs < 1:  # said before the target loads, not after
        raise specbench.BenchError(f"--runs must be >= 1, got {args.runs}")
    device = resolve_device(args.device)
    methods = specbench.parse_methods(args.methods)
    cats = None
    if args.categories is not None:
        cats = [c.strip() for c in args.categories.split(",") if c.strip()]
        if not cats:  # an empty selection is not "all": that would run the whole benchmark
            raise specbench.BenchError(f"--categories {args.categories!r} names no category; leave it "
                                       "out for all of them")
    questions = specbench.load_questions(args.questions, cats, args.limit)
    budget = parse_budget(args.budget, prog="specdec-bench")
    drafter_opts = parse_opts(args.opt, prog="specdec-bench")
    report.prepare_out(args.out, args.overwrite)  # before the (long) run: an unusable --out must not cost the results
    args.dtype = dtype_name(args.dtype, device, decoding=True)  # results.json records the dtype that ran
    target = load_target(args.target, dtype=args.dtype, device=device)
    answers = specbench.run_benchmark(target, methods, questions, args.max_new_tokens, args.runs,
                                      device, progress=False if args.no_progress else None,
                                      budget=budget, drafter_opts=drafter_opts)
    settings = {
        "questions": str(args.questions or specbench.DEFAULT_QUESTIONS),
        "categories": list(dict.fromkeys(str(q.get("category", "default")) for q in questions)),
        "limit": args.limit, "n_questions": len(questions),
        "question_ids": [q["question_id"] for q in questions],
        "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "runs": args.runs,
        "methods": {s.label: {"name": s.name, "value": s.value} for s in methods},
        "budget": None if budget is None else asdict(budget), "drafter_opts": drafter_opts,
        "batch_size": 1, "temperature": 0.0, "warmup": "first question once, untimed, per method",
        "order": "methods interleaved question by question, rotating",
    }
    results = specbench.results_for(answers)
    return report.write_results(args.out, specbench.machine_info(device),
                                {**target.identity(), "path": str(target.path)}, settings, results)


if __name__ == "__main__":
    sys.exit(main())
