"""One ``specdec-train recipe.yaml`` run, start to finish.

    load target -> data (bundled / local files; optional self-distillation, cached and
    resumable) -> tokenise (cached) -> build the head, choose its draft vocab from the
    training tokens -> features: capture once (offline; a complete matching capture is
    reused) or the target in the loop (online) -> DeepSpeed training (checkpoints, resume)
    -> eval -> <output.dir>/final/

Work that every process would otherwise repeat is split: each process regenerates and
captures its own share of the data (``part-<r>-of-<w>`` files under the output folder, which
must be on a filesystem all processes see), and tokenisation runs on rank 0 first so the
others read its cache.
"""
from __future__ import annotations

import gc
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from .batches import OnlineSource, StoreSource
from .checkpoint import check_head_shapes, lock_output_dir, require_checkpoint
from .config import Recipe, resolve_head_class, split_loss
from .runlog import RunLogger
from .trainer import DistInfo, Trainer, barrier, setup_distributed
from .yamlnodes import RecipeError


def run(recipe: Recipe, resume: bool | None = None) -> Path:
    """Train the recipe's head; returns ``<output.dir>/final``. resume None = automatic."""
    marks = [("start", time.perf_counter())]  # phase ends, for the closing time summary
    dist = setup_distributed()
    out = Path(recipe.output.dir)
    if resume:
        require_checkpoint(out)
    lock = None
    if dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
        lock = lock_output_dir(out)  # this run's until it ends (or its process dies)
    try:
        return _run(recipe, resume, dist, out, marks)
    finally:
        if lock is not None:
            lock.close()


def _run(recipe: Recipe, resume: bool | None, dist: DistInfo, out: Path, marks: list) -> Path:
    from specdec.infer.target import load_target

    if dist.is_main and resume is False:  # start over: forget checkpoints and the metric log, keep data caches
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
        (out / "metrics.jsonl").unlink(missing_ok=True)
    barrier()
    target = load_target(recipe.target.name, dtype=recipe.target.dtype, device=dist.device)
    head = build_head(recipe, target)   # before the data work: a bad optim.freeze fails here
    if resume is not False:
        check_head_shapes(out, head)     # and so does a checkpoint this head cannot resume
    if dist.is_main:  # only now: a resume refused above keeps the record of what the checkpoint is
        recipe.dump(out / "recipe.resolved.yaml")
    train_ds, eval_ds = prepare_data(recipe, target, dist)
    choose_draft_vocab(head, train_ds, target.vocab_size)
    marks.append(("target + data", time.perf_counter()))
    if dist.is_main:  # now with every head field the target decided (hidden size, vocab, ...)
        recipe.dump(out / "recipe.resolved.yaml", head_fields=_head_fields(head))
    spec = head.feature_spec()
    if recipe.data.mode == "offline":
        train_src, eval_src = capture_sources(recipe, target, spec, train_ds, eval_ds, dist)
        del target  # the head holds its own copies of the frozen parts it needs
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    else:
        train_src, eval_src = OnlineSource(train_ds, target, spec), OnlineSource(eval_ds, target, spec)
    marks.append(("features", time.perf_counter()))
    trainer = Trainer(recipe, head, train_src, eval_src, dist)
    start = trainer.state["step"] if trainer.restore(resume) else 0
    logger = RunLogger(recipe, dist.is_main, start, finished=start >= trainer.total_steps)
    try:
        trainer.train(logger)
        marks.append(("training", time.perf_counter()))
        result = trainer.evaluate()
        final = trainer.save_final(result)
        marks.append(("eval + save", time.perf_counter()))
        if dist.is_main:
            print(time_summary(marks), file=sys.stderr, flush=True)
        return final
    finally:
        logger.finish()


def time_summary(marks: list[tuple[str, float]]) -> str:
    """'finished in 27.5 min (target + data 4.6, features 6.7, ...)' from (phase, end time) marks."""
    phases = ", ".join(f"{name} {(t - prev) / 60:.1f}" for (_, prev), (name, t) in zip(marks, marks[1:]))
    return f"specdec-train: finished in {(marks[-1][1] - marks[0][1]) / 60:.1f} min ({phases})"


def _head_fields(head) -> dict | None:
    import dataclasses

    config = getattr(head, "config", None)
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else None


# ----------------------------------------------------------------------------- data

def resolve_files(files: list[str]) -> list[Path]:
    """``bundled:<name>`` -> the packaged prompt file; anything else must be an existing file."""
    from specdec.train.data import DataError, bundled_prompts

    paths = []
    for name in files:
        path = bundled_prompts(name.split(":", 1)[1]) if name.startswith("bundled:") else Path(name)
        if not path.is_file():
            raise DataError(f"data.files: {name}: no such file")
        paths.append(path)
    return paths


def _slug(path: Path) -> str:
    """``<stem>-<content digest>``: an edited file gets new prompts (its cached prompt list
    would otherwise be read forever), and a moved or recloned one keeps its replies."""
    from specdec.train.data import file_digest

    return f"{path.stem}-{file_digest(path)[:8]}"


def regenerate_files(recipe: Recipe, target, files: list[Path], dist: DistInfo) -> list[Path]:
    """Self-distil the first ``num_prompts`` prompts of each file; every process does its share.

    Returns the JSONL files (one per file and process share) holding the replies to exactly
    those prompts, in prompt order. Replies are cached per prompt, not per ``num_prompts``:
    a rerun, or a recipe asking for more (or fewer) prompts, reuses every reply written before.
    """
    from specdec.train.data import iter_conversations
    from specdec.train.regenerate import regenerate

    g, d = recipe.data.regenerate, recipe.data
    folder = Path(g.dir or Path(recipe.output.dir) / "regenerated")
    folder.mkdir(parents=True, exist_ok=True)
    # the settings that shape a reply name its file, so a shared cache folder is never stale
    settings = json.dumps([target.identity(), g.max_new_tokens, g.temperature,
                           recipe.optim.seed, d.format], sort_keys=True)
    key = hashlib.sha256(settings.encode()).hexdigest()[:8]
    share = None if g.num_prompts is None else len(range(dist.rank, g.num_prompts, dist.world_size))
    view = "" if share is None else f".first{g.num_prompts}"  # replies to the first N prompts

    def name(path: Path, kind: str, rank: int) -> Path:
        return folder / f"{_slug(path)}-{key}{kind}-{rank}-of-{dist.world_size}.jsonl"

    for path in files:
        prompts, replies = name(path, ".prompts", dist.rank), name(path, ".part", dist.rank)
        if not prompts.exists():  # this process's prompts: conversation i with i % world == rank
            tmp = prompts.with_suffix(".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                for i, conv in enumerate(iter_conversations([path], d.format)):
                    if i % dist.world_size == dist.rank:
                        f.write(json.dumps({"id": conv.id, "messages": conv.messages}, ensure_ascii=False) + "\n")
            tmp.replace(prompts)
        stats = regenerate(target, [prompts], replies, limit=share, batch_size=g.batch_size,
                           max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                           seed=recipe.optim.seed + dist.rank, fmt="openai", progress=dist.is_main)
        if share is not None:
            _first_replies(prompts, replies, share, name(path, f"{view}.part", dist.rank))
        if dist.is_main:
            print(f"regenerated {path.name}: {stats}", file=sys.stderr)
    barrier()
    outputs = [name(path, f"{view}.part", r) for path in files for r in range(dist.world_size)]
    return [p for p in outputs if p.stat().st_size > 0]


def _first_replies(prompts: Path, replies: Path, count: int, out: Path) -> None:
    """Write the replies to the first ``count`` prompts, in prompt order (regenerate writes them
    in length order, and the cache may hold replies to later prompts too). Prompts are counted
    as `regenerate` counts them: records without a user turn are not prompts."""
    from specdec.train.data import jsonl_lines
    from specdec.train.regenerate import first_turn_prompt

    records = [json.loads(line) for _, line in jsonl_lines(prompts.read_text(encoding="utf-8"))]
    ids = [r["id"] for r in records if first_turn_prompt(r["messages"]) is not None][:count]
    by_id = {}  # a reply's id is "<prompts file name>/<prompt id>"
    for _, line in jsonl_lines(replies.read_text(encoding="utf-8")):
        by_id[json.loads(line)["id"].removeprefix(f"{prompts.name}/")] = line
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(by_id[i] + "\n" for i in ids if i in by_id), encoding="utf-8")
    tmp.replace(out)


def _has_replies(path: Path, fmt: str) -> bool:
    from specdec.train.data import iter_conversations

    return any(any(m["role"] == "assistant" for m in c.messages)
               for c in iter_conversations([path], fmt))


def prepare_data(recipe: Recipe, target, dist: DistInfo):
    """(train, eval) tokenised ``datasets.Dataset``s with ``input_ids`` and ``loss_mask``."""
    from datasets import concatenate_datasets

    from specdec.train.data import DataError, prepare_dataset

    d = recipe.data
    files = resolve_files(d.files)
    sources: list[tuple[Path, str, int | None]] = []
    if d.regenerate.enabled:
        sources += [(p, "openai", None) for p in regenerate_files(recipe, target, files, dist)]
    if not d.regenerate.enabled:
        sources += [(p, d.format, d.limit) for p in files]
    elif d.regenerate.keep_original:  # prompt-only files (bundled:tasks) have no replies to keep
        sources += [(p, d.format, d.limit) for p in files if _has_replies(p, d.format)]
    parts = []
    for first in (True, False):  # rank 0 tokenises (and caches) first, the others then read it
        if first == dist.is_main:
            parts = [prepare_dataset([p], target.tokenizer, max_length=d.max_length, pack=d.pack,
                                     fmt=fmt, eval_fraction=d.eval_fraction, seed=d.seed, limit=limit)
                     for p, fmt, limit in sources]
        barrier()
    train = concatenate_datasets([p["train"] for p in parts])
    evals = [p["eval"] for p in parts if len(p["eval"])]
    eval_ds = concatenate_datasets(evals) if evals else parts[0]["eval"]
    if len(train) == 0:
        raise DataError("no training sequences: check data.files / data.limit")
    o = recipe.optim
    batch = o.micro_batch_size * o.grad_accum * dist.world_size
    if len(train) < batch:  # said before the capture, not as the batch plan's traceback after it
        raise DataError(f"{len(train)} training sequences are fewer than one global batch (optim."
                        f"micro_batch_size {o.micro_batch_size} x optim.grad_accum {o.grad_accum} x "
                        f"{dist.world_size} processes = {batch}): add data (data.limit) or shrink the batch")
    if dist.is_main:
        n_tok = sum(len(x) for x in train["input_ids"])
        print(f"data: {len(train)} training sequences ({n_tok:,} tokens), {len(eval_ds)} eval",
              file=sys.stderr)
    return train, eval_ds


def token_counts(dataset, vocab_size: int) -> torch.Tensor:
    """[V] how often each token is a loss-masked (to be predicted) token of ``dataset``."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for chunk in dataset.select_columns(["input_ids", "loss_mask"]).iter(batch_size=1024):
        for ids, mask in zip(chunk["input_ids"], chunk["loss_mask"]):
            ids, mask = torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(mask).bool()
            counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def build_head(recipe: Recipe, target):
    """``from_target`` with the recipe's fields (seeded), `optim.freeze` applied."""
    head_cls = resolve_head_class(recipe.head.type)
    loss_fields, _ = split_loss(head_cls, recipe.loss)
    torch.manual_seed(recipe.optim.seed)
    try:
        head = head_cls.from_target(target, **recipe.head.fields, **loss_fields)
    except ValueError as err:  # a field the target rules out (aux layer ids, vocab sizes, shapes)
        raise RecipeError(f"{recipe.source}: head: {err}") from None
    try:
        freeze_parameters(head, recipe.optim.freeze)
    except ValueError as err:
        raise RecipeError(f"{recipe.source}: optim.freeze: {err}") from None
    return head


def choose_draft_vocab(head, train_ds, vocab_size: int) -> None:
    """The data hook of heads with a reduced vocab (EAGLE-3): keep the data's frequent tokens."""
    hook = getattr(head, "set_draft_vocab", None)
    if callable(hook):
        hook(token_counts(train_ds, vocab_size))


def freeze_parameters(head: torch.nn.Module, prefixes: list[str]) -> None:
    """Keep the parameters `optim.freeze` names (whole names or dotted prefixes) at their
    starting values: a head started from target weights (init_layer, the LM head rows) keeps them."""
    names = [n for n, p in head.named_parameters() if p.requires_grad]
    for prefix in prefixes:
        hits = [n for n in names if n == prefix or n.startswith(prefix + ".")]
        if not hits:
            raise ValueError(f"{prefix!r} names no trainable parameter of this head "
                             f"(it has: {', '.join(names)})")
        for n in hits:
            head.get_parameter(n).requires_grad_(False)


# ----------------------------------------------------------------------------- features

class ConcatStore:
    """Several FeatureStores (one per capturing process) read as one, in order."""

    def __init__(self, stores):
        self.stores = list(stores)
        self.starts = [0]
        for s in self.stores:
            self.starts.append(self.starts[-1] + len(s))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i: int):
        import bisect

        k = bisect.bisect_right(self.starts, i) - 1
        return self.stores[k][i - self.starts[k]]

    def lengths(self) -> list[int]:
        return [n for s in self.stores for n in s.lengths()]


def capture_sources(recipe: Recipe, target, spec, train_ds, eval_ds, dist: DistInfo):
    """Capture (or reuse) this process's share of train/eval features; open every share."""
    from specdec.train.capture import CaptureError, FeatureStore, as_feature_dict, capture

    d = recipe.data
    default_dir = d.capture_dir is None
    root = Path(d.capture_dir or Path(recipe.output.dir) / "features")
    features = as_feature_dict(spec)
    sources = []
    for split, ds in (("train", train_ds), ("eval", eval_ds)):
        dirs = [root / split / f"part-{r}-of-{dist.world_size}" for r in range(dist.world_size)]
        bounds = [len(ds) * r // dist.world_size for r in range(dist.world_size + 1)]
        mine = ds.select(range(bounds[dist.rank], bounds[dist.rank + 1]))
        if len(mine):
            source = {"recipe": recipe.source, "split": split, "part": dist.rank, "of": dist.world_size}
            try:
                capture(target, mine, dirs[dist.rank], features, batch_tokens=d.capture_batch_tokens,
                        source=source, progress=dist.is_main)
            except CaptureError as err:
                if not default_dir:  # a user-named capture folder is never overwritten
                    raise
                print(f"features: {err}; capturing again", file=sys.stderr)
                capture(target, mine, dirs[dist.rank], features, batch_tokens=d.capture_batch_tokens,
                        source=source, progress=dist.is_main, overwrite=True)
        barrier()
        if default_dir and dist.is_main:  # shares of a run with another process count: never read again
            for stale in sorted(set((root / split).glob("part-*-of-*")) - set(dirs)):
                print(f"features: removing {stale} (captured by {stale.name.rsplit('-of-', 1)[1]} processes)",
                      file=sys.stderr)
                shutil.rmtree(stale, ignore_errors=True)
        stores = [FeatureStore(p, features=features) for p, a, b in zip(dirs, bounds, bounds[1:]) if b > a]
        store = ConcatStore(stores)
        sources.append(StoreSource(store, list(range(len(store)))))
    return sources
