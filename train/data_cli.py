"""`specdec-data`: prepare training data for draft heads.

Subcommands live in the SUBCOMMANDS table at the bottom: each is a `Subcommand(help,
description, add_arguments, run)`. Adding one (say `datastore`) is one new entry plus its
two functions; heavy imports stay inside `run` so `--help` is instant.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable

from specdec.infer.dtypes import DTYPE_CHOICES, torch_dtype

from .data import BUNDLED, FORMATS  # plain constants in a light module: --help stays instant


@dataclass(frozen=True)
class Subcommand:
    help: str                                           # one line, in `specdec-data --help`
    description: str                                    # shown by `specdec-data NAME --help`
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]


def add_target_args(p: argparse.ArgumentParser, default_dtype: str) -> None:
    p.add_argument("--target", default="smollm2-135m",
                   help="target model: embedded name (smollm2-135m, tiny-llama), HF folder, .gguf "
                        "file or hub id (default: %(default)s)")
    p.add_argument("--dtype", default=default_dtype, choices=DTYPE_CHOICES,
                   help="dtype to run the target in; auto: bfloat16 where the device computes it natively, "
                        "else float32 (default: %(default)s)")
    add_device_arg(p)


def add_device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto",
                   help="cpu, cuda, cuda:1, ... ('auto' = cuda if available; default: %(default)s)")


def add_data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", nargs="+", required=True, metavar="FILE",
                   help="JSON/JSONL files: ShareGPT, OpenAI messages, Alpaca, GSM8K or Spec-Bench records "
                        "(format detected per record), or a bundled set: " + ", ".join(BUNDLED))
    p.add_argument("--format", default="auto", dest="fmt",
                   choices=FORMATS,
                   help="force one record format instead of detecting it (default: %(default)s)")
    p.add_argument("--on-error", default="skip", choices=["skip", "fail"],
                   help="malformed record: skip it and print a count, or stop with file:line "
                        "(default: %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N records")


def _data_paths(names: list[str]) -> list[str]:
    from specdec.train.data import BUNDLED, bundled_prompts

    return [str(bundled_prompts(n)) if n in BUNDLED else n for n in names]


def _load_target(args, name: str | None = None, dtype: str | None = None):
    """The target --target / --dtype / --device name (or ``name`` / ``dtype`` in their place)."""
    from specdec.infer.target import load_target

    return load_target(name or args.target, dtype=dtype or args.dtype, device=args.device)


# ----------------------------------------------------------------------------- regenerate

def regenerate_args(p: argparse.ArgumentParser) -> None:
    add_target_args(p, default_dtype="auto")
    add_data_args(p)
    p.add_argument("--out", required=True, help="output JSONL (appended to; rerun to resume)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences decoded together (KV-cache slots; default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="reply length cap (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples at this temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling when --temperature > 0")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")


def _check_regenerate_args(args) -> None:
    """The regenerate flags' own ranges, said at once, before the target loads."""
    from specdec.train.data import DataError

    bad = [f"--{name.replace('_', '-')} must be >= 1, got {value}"
           for name in ("limit", "batch_size", "max_new_tokens")
           if (value := getattr(args, name)) is not None and value < 1]
    if not (args.temperature >= 0 and args.temperature != float("inf")):
        bad.append(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        bad.append(f"--top-p must be in (0, 1], got {args.top_p}")
    if os.path.isdir(args.out):
        bad.append(f"--out {args.out} is a folder; regenerate writes a JSONL file (say {args.out}/replies.jsonl)")
    if bad:
        raise DataError("; ".join(bad))


def regenerate_run(args) -> int:
    from specdec.train.regenerate import regenerate

    _check_regenerate_args(args)
    target = _load_target(args)
    stats = regenerate(target, _data_paths(args.data), args.out, limit=args.limit,
                       batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                       fmt=args.fmt, on_error=args.on_error)
    rate = stats["new_tokens"] / max(stats["seconds"], 1e-9)
    print(f"specdec-data: wrote {stats['written']} replies to {args.out} ({stats['already_done']} "
          f"already there), {stats['new_tokens']} new tokens in {stats['seconds']:.1f} s = {rate:.0f} tok/s")
    return 0


# ----------------------------------------------------------------------------- capture

def capture_args(p: argparse.ArgumentParser) -> None:
    add_target_args(p, default_dtype="auto")
    add_data_args(p)
    p.add_argument("--out", required=True, help="capture directory (rerun the same command to resume)")
    spec = p.add_argument_group("features (a head type's spec, or explicit; explicit flags win)")
    spec.add_argument("--head-type", default=None,
                      help="ask this head type for its feature spec (e.g. eagle3, medusa)")
    spec.add_argument("--aux-layers", default=None,
                      help="comma-separated hidden-state ids, e.g. 2,15,27 (HF output_hidden_states "
                           "indices); 'default' = EAGLE-3's low/mid/high layers")
    spec.add_argument("--hidden", action=argparse.BooleanOptionalAction, default=None,
                      help="store the final post-norm hidden state (default: yes unless a head type says no)")
    spec.add_argument("--topk-logits", type=int, default=None,
                      help="store the top-K next-token log-probabilities (default 0)")
    p.add_argument("--max-length", type=int, default=2048, help="truncate sequences to this many tokens")
    p.add_argument("--pack", action="store_true", help="pack sequences into rows of --max-length")
    p.add_argument("--split", default="train", choices=["train", "eval", "all"],
                   help="which part of the seeded train/eval split to capture (default: %(default)s)")
    p.add_argument("--eval-fraction", type=float, default=0.05, help="held-out share (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="split seed (default: %(default)s)")
    p.add_argument("--batch-tokens", type=int, default=8192,
                   help="padded tokens per forward pass (default: %(default)s)")
    p.add_argument("--shard-tokens", type=int, default=32768, help="tokens per shard (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="discard an existing capture in --out")


def _check_capture_args(args):
    """The capture flags' own ranges, said at once; returns --aux-layers parsed (or 'default')."""
    from specdec.train.capture import CaptureError

    bad = [f"--{name.replace('_', '-')} must be >= {low}, got {value}"
           for name, low in (("topk_logits", 0), ("limit", 1), ("max_length", 2), ("batch_tokens", 1),
                             ("shard_tokens", 1))
           if (value := getattr(args, name)) is not None and value < low]
    if not 0 <= args.eval_fraction < 1:
        bad.append(f"--eval-fraction must be in [0, 1), got {args.eval_fraction}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        bad.append(f"--out {args.out} is a file, not a capture directory")
    aux = args.aux_layers
    if aux not in (None, "default"):
        try:
            aux = [int(x) for x in aux.split(",") if x.strip()]
        except ValueError:
            bad.append(f"--aux-layers takes comma-separated layer ids or 'default', got {aux!r}")
    if bad:
        raise CaptureError("; ".join(bad))
    return aux


def capture_run(args) -> int:
    from datasets import concatenate_datasets

    from specdec.infer.engine import position_limit
    from specdec.train.capture import capture, resolve_features
    from specdec.train.data import prepare_dataset
    from specdec.train.features import default_aux_layers

    aux = _check_capture_args(args)  # before the target loads and --overwrite discards anything
    target = _load_target(args)
    limit = position_limit(target)
    if limit and args.max_length > limit:  # features past the trained positions would teach noise
        print(f"specdec-data capture: sequences cut at {limit} tokens, the target's positions "
              f"(--max-length {args.max_length})", file=sys.stderr)
        args.max_length = limit
    if aux == "default":
        aux = default_aux_layers(target.num_layers)
    features = resolve_features(target, args.head_type, args.hidden, aux, args.topk_logits)
    paths = _data_paths(args.data)
    splits = prepare_dataset(paths, target.tokenizer, max_length=args.max_length, pack=args.pack,
                             fmt=args.fmt, on_error=args.on_error, eval_fraction=args.eval_fraction,
                             seed=args.seed, limit=args.limit)
    ds = concatenate_datasets([splits["train"], splits["eval"]]) if args.split == "all" else splits[args.split]
    source = {"paths": paths, "split": args.split, "eval_fraction": args.eval_fraction,
              "seed": args.seed, "max_length": args.max_length, "pack": args.pack,
              "limit": args.limit}
    out = capture(target, ds, args.out, features, batch_tokens=args.batch_tokens,
                  shard_tokens=args.shard_tokens, source=source, overwrite=args.overwrite)
    print(f"specdec-data: captured {len(ds)} sequences, features {features}, into {out}")
    return 0


def evaluate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None,
                   help="where to load the captured target from, if not by the name its capture "
                        "recorded (an HF folder or .gguf of the same weights); loaded in the "
                        "capture's dtype")
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES,
                   help="dtype the heads compute in (default: %(default)s)")
    add_device_arg(p)
    p.add_argument("heads", nargs="+", metavar="HEAD_DIR", help="trained heads (<output.dir>/final)")
    p.add_argument("--features", required=True,
                   help="a `specdec-data capture` directory holding what the heads read")
    p.add_argument("--depth", type=int, default=5, help="draft depths scored (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per forward (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write every head's result here")


def missing_features(captured: dict, spec) -> list[str]:
    """What a head's FeatureSpec asks for that a capture's `features` entry lacks."""
    missing = ["hidden"] if spec.hidden and not captured["hidden"] else []
    if spec.aux_layers and list(spec.aux_layers) != captured["aux_layers"]:
        missing.append(f"aux_layers {list(spec.aux_layers)} (captured: {captured['aux_layers']})")
    if spec.topk_logits > captured["topk_logits"]:
        missing.append(f"topk_logits {spec.topk_logits} (captured: {captured['topk_logits']})")
    return missing


def evaluate_run(args) -> int:
    import json
    from pathlib import Path

    import torch

    from specdec.heads import load_head
    from specdec.train.batches import StoreSource, eval_batches
    from specdec.train.capture import CaptureError, FeatureStore, read_manifest
    from specdec.train.evaluate import evaluate, format_table

    if args.depth < 1 or args.batch_size < 1:
        raise CaptureError("--depth and --batch-size must be >= 1")
    if args.json and os.path.isdir(args.json):  # said now, not after every head is scored
        raise CaptureError(f"--json {args.json} is a folder; give a file name")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    captured = read_manifest(Path(args.features))
    # the target whose features these are, in the capture's dtype (its embeddings and LM head
    # complete each head); --dtype is what the heads compute in
    target = _load_target(args, name=args.target or captured["target"]["name"], dtype=captured["dtype"])
    store = FeatureStore(args.features, target=target)
    source = StoreSource(store, range(len(store)))
    device = next(target.model.parameters()).device
    dtype = torch_dtype(args.dtype, device)
    heads = {head_dir: load_head(head_dir, target=target) for head_dir in args.heads}
    for head_dir, head in heads.items():  # every head checked before the first is scored
        spec = head.feature_spec()
        missing = missing_features(store.features, spec)
        if missing:
            aux = f" --aux-layers {','.join(map(str, spec.aux_layers))}" if spec.aux_layers else ""
            raise CaptureError(f"{args.features} lacks what {head_dir} reads: {', '.join(missing)}; "
                               f"capture with --head-type {type(head).head_type()}{aux}")
    results = {}
    for head_dir, head in heads.items():
        head = head.to(device, dtype)
        batches = (source.batch(p, dtype, device) for p in eval_batches(len(store), args.batch_size, 1, 0))
        result = evaluate(head, batches, args.depth)
        results[head_dir] = result.to_dict()
        print(f"== {head_dir} ({type(head).head_type()}) on {args.features}\n{format_table(result)}\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


SUBCOMMANDS: dict[str, Subcommand] = {
    "regenerate": Subcommand(
        help="self-distillation: the target writes its own reply to every prompt",
        description="Keep each record's prompt (system + first user turn) and let the target "
                    "write the reply on specdec's engine (continuous batching: --batch-size sequences at "
                    "once; greedy, or sampled with --temperature). "
                    "Writes an OpenAI-messages JSONL; rerunning resumes, skipping ids already "
                    "written.\n\nexample:\n  specdec-data regenerate --target smollm2-135m "
                    "--data gsm8k --limit 400 --out runs/data/gsm8k.regen.jsonl",
        add_arguments=regenerate_args, run=regenerate_run),
    "capture": Subcommand(
        help="run the frozen target once and store the features a head trains on",
        description="Tokenise the data with the target's chat template (loss on assistant "
                    "tokens), run batched prefill and store the features (final hidden, aux "
                    "hidden states, top-k log-probs) as checksummed safetensors shards with a "
                    "manifest. Rerunning resumes after the last finished shard.\n\nexample:\n"
                    "  specdec-data capture --target smollm2-135m --data runs/data/gsm8k.regen.jsonl "
                    "--head-type eagle3 --out runs/features/gsm8k-eagle3",
        add_arguments=capture_args, run=capture_run),
    "evaluate": Subcommand(
        help="score trained heads on captured features: acceptance per depth, tau, calibration",
        description="Teacher-forced greedy chains over every captured sequence, as the trainer's "
                    "held-out eval: P(accepted length >= k), conditional acceptance, chain tau and "
                    "calibration per head. No timing involved, so heads compare exactly, on any "
                    "text you capture (say the target's own replies to your traffic or to "
                    "Spec-Bench).\n\nexample:\n"
                    "  specdec-data regenerate --data questions.jsonl --out runs/eval/replies.jsonl\n"
                    "  specdec-data capture --data runs/eval/replies.jsonl --head-type eagle3 "
                    "--split all --out runs/eval/features\n"
                    "  specdec-data evaluate runs/a/final runs/b/final --features runs/eval/features",
        add_arguments=evaluate_args, run=evaluate_run),
    "datastore": Subcommand(
        help="build the REST datastore (suffix array over a tokenised corpus) for `rest=DIR`",
        description="Tokenise conversations with the target's tokenizer and chat template and "
                    "write DIR/tokens.npy, DIR/suffix_array.npy (memory-mapped at run time) and "
                    "DIR/header.json. Without --data, all bundled prompt sets are used.\n\n"
                    "example:\n  specdec-data datastore --target smollm2-135m --out runs/rest/bundled",
        # both live in specdec.infer.datastore (REST's owner), imported on use
        add_arguments=lambda p: __import__("specdec.infer.datastore", fromlist=["x"]).add_datastore_arguments(p),
        run=lambda a: __import__("specdec.infer.datastore", fromlist=["x"]).datastore_command(a)),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdec-data",
        description="Prepare data for draft-head training: regenerate replies with the target "
                    "(self-distillation), then capture the target's features for offline training.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.description,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from specdec.heads.base import HeadShapeError
    from specdec.infer.target import TargetError
    from specdec.train.capture import CaptureError
    from specdec.train.data import DataError

    try:
        return args._run(args) or 0
    except (DataError, CaptureError, TargetError, HeadShapeError, FileNotFoundError) as err:
        print(f"specdec-data {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        resumable = args.command in ("regenerate", "capture")  # they keep what they finished
        print(f"\nspecdec-data {args.command}: interrupted"
              + ("; the same command resumes where it stopped" if resumable else ""), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
