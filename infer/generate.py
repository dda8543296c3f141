"""``specdec-generate``: generate from the command line, streaming text as it is produced.

    specdec-generate --prompt "Write a haiku about the sea."
    specdec-generate --method eagle3 --head runs/smollm2-135m/eagle3/final --prompt "Hi" --json

The text streams to stdout; τ (mean tokens per target step) and tokens/s go to stderr at the end.
With ``--json`` nothing streams: one JSON object per prompt is printed, one per line.
"""
from __future__ import annotations

import argparse
import json
import sys

from specdec.heads.tree import TreeBudget
from specdec.infer.dtypes import AUTO_DECODING_HELP, DTYPE_CHOICES
from specdec.infer.drafters import available_methods, default_target


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec-generate", description=__doc__.split("\n")[0])
    p.add_argument("--target", default=None,
                   help="target name, HF folder or .gguf (default: the --head's own target, else smollm2-135m)")
    p.add_argument("--method", default=None, help=f"drafting method: {', '.join(available_methods())} "
                                                  "(default: the --head's own, else plain)")
    p.add_argument("--head", default=None, help="trained head folder (head methods)")
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES,
                   help=f"target dtype; {AUTO_DECODING_HELP} (default: %(default)s)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: %(default)s, cuda if available)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate per prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy, identical to plain decoding; > 0: sampled, lossless rejection sampling "
                        "(default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, 1: off (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens, 0: off (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed: the same seed, method and prompts give the same text")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap each prompt in the target's chat template (default on)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of streaming")
    p.add_argument("--max-len", type=int, default=None,
                   help="KV cache length per sequence (default: 2048, or the target's max_position_embeddings "
                        "if fewer; more than that is refused)")
    p.add_argument("--budget", default=None, metavar="NODES,DEPTH,TOPK",
                   help="draft tree budget (default: the drafter's own)")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="drafter option (repeatable), e.g. --opt ngram=3")
    return p


def usage_error(message: str):
    """Say a bad flag value and exit 2, as argparse does for its own usage errors."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def parse_opts(pairs: list[str], prog: str = "specdec-generate") -> dict:
    """``--opt KEY=VALUE`` pairs -> drafter options (shared with ``specdec-bench``)."""
    opts = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            usage_error(f"{prog}: --opt expects KEY=VALUE, got {pair!r}")
        try:
            opts[key] = json.loads(value)  # numbers, booleans, lists; anything else stays a string
        except json.JSONDecodeError:
            opts[key] = value
    return opts


def parse_budget(text: str | None, prog: str = "specdec-generate") -> TreeBudget | None:
    """``--budget NODES,DEPTH,TOPK`` -> a TreeBudget (None: the drafter's own)."""
    if text is None:
        return None
    try:
        nodes, depth, topk = (int(x) for x in text.split(","))
        return TreeBudget(nodes, depth, topk)
    except ValueError as err:  # not three whole numbers, or a TreeBudget that cannot be
        usage_error(f"{prog}: --budget expects NODES,DEPTH,TOPK (whole numbers), got {text!r}: {err}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import inspect

    from specdec.infer.api import LLM, SamplingParams

    budget = parse_budget(args.budget)  # usage errors before the model loads
    opts = parse_opts(args.opt)
    clash = sorted(set(opts) & set(inspect.signature(LLM).parameters))
    if clash:  # LLM(**opts) would take them as its own settings
        print(f"specdec-generate: --opt {', '.join(clash)}: not a drafter option; use the command's own "
              f"flag (--{clash[0].replace('_', '-')})", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=args.stop)
        llm = LLM(target=default_target(args.target, args.head), method=args.method, head=args.head, dtype=args.dtype,
                  device=args.device, max_batch=max(1, len(args.prompt)) if args.json else 1,
                  max_len=args.max_len, **opts)
        return _generate(llm, args, params, budget)
    except (ValueError, OSError, RuntimeError) as err:  # CacheFullError: a prompt past --max-len
        print(f"specdec-generate: {err}", file=sys.stderr)
        return 2


def _generate(llm, args, params, budget) -> int:
    if args.json:  # all prompts in one batch, one JSON line each
        for out in llm.generate(args.prompt, params, chat=args.chat, budget=budget):
            s = out.stats
            print(json.dumps({"text": out.text, "token_ids": out.token_ids, "tau": s["tau"],
                              "tokens_per_s": s["tokens_per_s"], "new_tokens": s["new_tokens"],
                              "steps": s["steps"], "seconds": s["seconds"],
                              "finish_reason": out.finish_reason}))
        return 0
    for i, prompt in enumerate(args.prompt):  # one at a time so the streams do not interleave
        if len(args.prompt) > 1:
            print(f"--- prompt {i + 1}: {prompt}", file=sys.stderr)

        def stream(out):
            sys.stdout.write(out.new_text)
            sys.stdout.flush()

        out = llm.generate(prompt, params, chat=args.chat, budget=budget, on_output=stream)[0]
        s = out.stats
        print(flush=True)
        print(f"[{llm.method}] τ = {s['tau']:.2f} tokens/step, {s['tokens_per_s']:.1f} tokens/s "
              f"({s['new_tokens']} tokens in {s['seconds']:.2f} s, {out.finish_reason})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
