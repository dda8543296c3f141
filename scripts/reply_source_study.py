"""What do self-distilled replies buy over the datasets' original replies?

Trains the same head twice on the features a finished `specdec-train` run captured: once on
its self-distilled sequences only (replies the target generated itself), once on the original
dataset replies only, with equal steps and tokens per step; then reports held-out per-position
acceptance of both on each kind of held-out sequence. A sequence counts as self-distilled when
the target's greedy next token equals the reply's next token at >= 97% of its reply positions
(bf16 capture noise flips a few).

    python scripts/reply_source_study.py runs/smollm2-135m/eagle3 --steps 120

Plain AdamW on one process (a study, not a recipe): the head, its loss, its draft vocab and
its acceptance metric are the runtime's own.
"""
from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import torch


def self_distilled(head, batch) -> bool:
    from specdec.heads.base import shift_left

    mask = batch["loss_mask"][0]
    agree = shift_left(batch["input_ids"], 1)[0] == head.target_next(batch)[0]
    return bool(agree[mask].float().mean() > 0.97)


def split_by_source(head, store, dtype) -> dict[str, list[int]]:
    from specdec.train.batches import pad_batch

    groups = {"self": [], "original": []}
    with torch.no_grad():
        for i in range(len(store)):
            groups["self" if self_distilled(head, pad_batch([store[i]], dtype)) else "original"].append(i)
    return groups


def acceptance(head, store, indices, dtype, depth: int) -> list[float]:
    """P(accepted length >= k), k = 1..depth, over the given held-out sequences."""
    from specdec.train.batches import pad_batch

    correct, count = torch.zeros(depth), 0
    head.eval()
    with torch.no_grad():
        for i in indices:
            stats = head.acceptance(pad_batch([store[i]], dtype), depth)
            correct += stats["correct"][:depth].float()
            count += int(stats["count"][0])
    head.train()
    return [round(x, 4) for x in (correct / max(count, 1)).tolist()]


def train(make_head, store, indices, args, dtype):
    from specdec.train.batches import pad_batch

    torch.manual_seed(args.seed)
    head = make_head()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warm = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    rng = random.Random(args.seed)
    for _ in range(args.steps):
        batch = pad_batch([store[i] for i in rng.sample(indices, min(args.batch, len(indices)))], dtype)
        loss, _ = head.loss(batch)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
    return head


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a finished specdec-train run (offline features, final/ head)")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="JSON file for the table (default: RUN_DIR/reply_sources.json)")
    args = ap.parse_args(argv)

    from specdec.heads import get_head_class, load_head
    from specdec.infer.target import load_target
    from specdec.train.capture import FeatureStore

    run = Path(args.run_dir)
    final = json.loads((run / "final" / "config.json").read_text())
    target = load_target(final.get("target", {}).get("name", "smollm2-135m"), dtype=torch.float32)
    trained = load_head(run / "final", target)
    dtype = torch.bfloat16 if torch.cpu._is_avx512_bf16_supported() else torch.float32
    train_store = FeatureStore(run / "features" / "train" / "part-0-of-1", check_checksums=False)
    eval_store = FeatureStore(run / "features" / "eval" / "part-0-of-1", check_checksums=False)
    trained = trained.to(dtype)
    train_groups = split_by_source(trained, train_store, dtype)
    eval_groups = split_by_source(trained, eval_store, dtype)
    print({k: len(v) for k, v in train_groups.items()}, "training sequences;",
          {k: len(v) for k, v in eval_groups.items()}, "held out")

    def make_head():  # same type, fields and draft vocab as the run's head, fresh weights
        cls = get_head_class(trained.head_type())
        head = cls.from_target(target, **{k: v for k, v in vars(trained.config).items()})
        head.load_state_dict({k: v for k, v in trained.state_dict().items() if k in ("d2t", "t2d")},
                             strict=False)
        init = getattr(head, "init_from_target", None)
        if callable(init):
            init(target)
        return head.to(dtype)

    table = {}
    for source in ("self", "original"):
        head = train(make_head, train_store, train_groups[source], args, dtype)
        table[source] = {f"eval_{g}": acceptance(head, eval_store, idx, dtype, args.depth)
                         for g, idx in eval_groups.items()}
        print(f"trained on {source} replies:", table[source], flush=True)
    out = Path(args.out or run / "reply_sources.json")
    out.write_text(json.dumps({"settings": vars(args), "reach_at_depth": table}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
