"""``specdec-train RECIPE.yaml [key=value ...]``: train a draft head from a recipe."""
from __future__ import annotations

import argparse
import os
import sys

EPILOG = """\
recipe sections (YAML; every key is checked, with its line, before any work starts; the
meaning of each key is commented in train/config.py and recipes/smollm2-135m/eagle3.yaml):
{sections}

overrides: any number of dotted.key=value after the recipe, typed like the recipe field, e.g.
  specdec-train recipes/tiny/eagle3.yaml optim.max_steps=20 head.ttt_steps=3 output.dir=runs/x
  data.files='[bundled:gsm8k, my.jsonl]'   (values are YAML)

outputs in output.dir: recipe.resolved.yaml (every default filled in), metrics.jsonl,
checkpoints/step-N/ (DeepSpeed + data position + RNG), eval.json, final/ (the head:
config.json + model.safetensors, loadable by specdec.heads.load_head and specdec-export),
features/train/, features/eval/ (the offline capture, unless data.capture_dir is set),
wandb/ (the Weights & Biases run; offline unless logged in: `wandb sync <output.dir>/wandb/offline-run-*`).

resume: by default a run continues from the newest complete checkpoint in output.dir
(also after kill -9); --no-resume starts over, --resume insists on one.

several processes: launch with `deepspeed` (GPU cluster: --hostfile, see
recipes/gpu/llama-3.1-8b-instruct-eagle3.yaml) or `torchrun --nproc_per_node N -m
specdec.train.cli RECIPE`; the global batch is micro_batch_size x grad_accum x processes.
On CPU, DeepSpeed runs with DS_ACCELERATOR=cpu and the gloo backend (set automatically).
"""


def build_parser() -> argparse.ArgumentParser:
    from specdec.train.config import recipe_help

    p = argparse.ArgumentParser(
        prog="specdec-train", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a draft head for a frozen target LLM with DeepSpeed, from a YAML recipe "
                    "(recipes/tiny/*.yaml, recipes/smollm2-135m/*.yaml, recipes/gpu/*.yaml).",
        epilog=EPILOG.format(sections=recipe_help()))
    p.add_argument("recipe", help="recipe YAML file")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="recipe overrides, e.g. optim.lr=3e-4 output.dir=runs/try")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--resume", dest="resume", action="store_true", default=None,
                       help="continue from the newest checkpoint (error if none)")
    group.add_argument("--no-resume", dest="resume", action="store_false",
                       help="start over: delete this output.dir's checkpoints and metrics")
    p.add_argument("--check", action="store_true",
                   help="validate the recipe, print it resolved, and exit")
    # the `deepspeed` launcher appends --local_rank=N (it also sets LOCAL_RANK)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def resume_hint(output_dir: str) -> str:
    """What running the same command again will do, after an interruption."""
    from specdec.train.checkpoint import checkpoint_root, latest_checkpoint

    tag = latest_checkpoint(output_dir)
    if tag is None:
        return "no checkpoint was saved yet: the same command starts over (output.save_every sets how often)"
    return f"the same command resumes from {checkpoint_root(output_dir) / tag}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)  # --check may follow the overrides
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    from specdec.train.config import RecipeError, load_recipe

    try:
        recipe = load_recipe(args.recipe, args.overrides, check_files=True)
    except RecipeError as err:
        print(f"specdec-train: {err}", file=sys.stderr)
        return 2
    if args.check:
        import yaml

        print(yaml.safe_dump(recipe.to_dict(), sort_keys=False), end="")
        return 0
    from specdec.infer.target import TargetError
    from specdec.train.capture import CaptureError
    from specdec.train.checkpoint import ResumeError
    from specdec.train.data import DataError
    from specdec.train.pipeline import run

    try:
        final = run(recipe, resume=args.resume)
    # what only the target, the built head, the data or output.dir can tell: said in a line
    except (RecipeError, TargetError, DataError, CaptureError, ResumeError) as err:
        print(f"specdec-train: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C is the documented way to stop: a line, not two tracebacks
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"specdec-train: interrupted; {resume_hint(recipe.output.dir)}", file=sys.stderr)
        return 130
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"specdec-train: done, head in {final}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
