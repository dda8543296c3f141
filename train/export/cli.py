"""``specdec-export HEAD_DIR --format vllm|sglang|tgi|speculators|trtllm --out DIR``."""
from __future__ import annotations

import argparse
import os
import sys

EPILOG = """\
formats (the folder loads in the engine as it is; README.md in it says how):
  vllm         EAGLE-3 (speculators config), EAGLE, Medusa, MLPSpeculator, draft LM (method draft_model)
  sglang       EAGLE-3 (LlamaForCausalLMEagle3, midlayer.*), EAGLE (LlamaForCausalLMEagle),
               draft LM (STANDALONE); a draft LM folder is an HF LlamaForCausalLM with the tokenizer
  tgi          Medusa (medusa_lm_head.safetensors), tied MLPSpeculator (MLPSpeculatorPreTrainedModel),
               each with the target's tokenizer (TGI's router reads it from the draft folder)
  speculators  EAGLE-3 (same folder as vllm; loads with speculators' SpeculatorModel)
  trtllm       ReDrafter (Apple's drafter folder: TensorRT-LLM's examples/redrafter converter and
               Apple's recurrent_drafting read it)

the export also carries specdec.json (provenance), and eval.json and the recipe (the trainer's final/
has both: recipe.yaml, written as recipe.resolved.yaml); specdec-push uploads it to the Hugging Face Hub.
"""


def build_parser() -> argparse.ArgumentParser:
    from specdec.train.export import DTYPES, ENGINE_FORMATS

    p = argparse.ArgumentParser(
        prog="specdec-export", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write a trained draft head in a serving engine's own format.", epilog=EPILOG)
    p.add_argument("head_dir", help="a head folder (save_pretrained: config.json + model.safetensors)")
    p.add_argument("--format", required=True, choices=ENGINE_FORMATS, dest="fmt")
    p.add_argument("--out", required=True, help="output folder (must not exist, unless --force)")
    p.add_argument("--target", default=None,
                   help="target to export against (default: the name in the head's config.json)")
    p.add_argument("--verifier", default=None,
                   help="how the engine config names the target (default: its hub id when known, "
                        "as for the embedded smollm2-135m, else its local folder: give the hub id "
                        "before pushing)")
    p.add_argument("--dtype", default=None, choices=DTYPES, help="cast the weights (default: as saved)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from specdec.heads import HeadShapeError
    from specdec.train.export import ExportError, export_head

    try:
        out = export_head(args.head_dir, args.fmt, args.out, target=args.target,
                          verifier=args.verifier, dtype=args.dtype, force=args.force)
    except (ExportError, HeadShapeError, FileNotFoundError, KeyError, ValueError, OSError) as err:
        if os.environ.get("SPECDEC_DEBUG"):
            raise
        msg = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"specdec-export: error: {msg}", file=sys.stderr)
        return 1
    print(f"specdec-export: wrote the {args.fmt} export to {out} (see {out}/README.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
