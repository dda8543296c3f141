"""Export a trained head (a `save_pretrained` folder) in the format a serving engine loads.

    export_head("runs/x/final", "vllm", "exports/x-vllm")            # library
    specdec-export runs/x/final --format vllm --out exports/x-vllm     # CLI (cli.py)

The per-format tensor names and configs live with each head type (`_export_<fmt>` methods,
helpers in `specdec.heads.export_common`); this module picks the target, writes the folder
under a temporary name, adds the training records (eval.json, the resolved recipe) and the
model card, and renames it into place, so a failure never leaves a half-written export.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from specdec.heads import get_head_class, head_types, load_head
from specdec.heads.base import read_head_config
from specdec.heads.export_common import EVAL_FILE, RECIPE_FILE, ExportError, write_card

ENGINE_FORMATS = ("vllm", "sglang", "tgi", "speculators", "trtllm")
# Training records a head folder may carry (the trainer writes eval.json and recipe.yaml into
# <output.dir>/final/), copied into the export under the names the model card reads.
RECORDS = {EVAL_FILE: (EVAL_FILE,), RECIPE_FILE: (RECIPE_FILE, "recipe.yaml")}
DTYPES = ("float32", "bfloat16", "float16")


def formats_for(head_type: str) -> list[str]:
    """Engine formats a head type can be written in (its `_export_<fmt>` methods)."""
    cls = get_head_class(head_type)
    return sorted(n.removeprefix("_export_") for n in dir(cls) if n.startswith("_export_"))


def head_types_for(fmt: str) -> list[str]:
    return [t for t in head_types() if fmt in formats_for(t)]


def check_format(head_type: str, fmt: str) -> None:
    """Raise ExportError naming the formats that can hold `head_type` when `fmt` cannot."""
    if fmt in formats_for(head_type):
        return
    can = formats_for(head_type)
    holds = head_types_for(fmt)
    raise ExportError(
        f"a {head_type} head cannot be written in the {fmt!r} format; formats that can hold it: "
        f"{', '.join(can) if can else 'none (only specdec itself loads it, from its head folder)'}"
        + (f" ({fmt!r} holds: {', '.join(holds)})" if holds else ""))


def load_export_target(head_cfg: dict, target=None):
    """The target to export against: `target` (a Target, name or path) or the one named in the
    head's config.json (`target.name`)."""
    from specdec.infer.target import Target, TargetError, load_target

    if isinstance(target, Target):
        return target
    name = target or (head_cfg.get("target") or {}).get("name")
    if not name:
        raise ExportError("the head's config.json names no target: pass --target NAME_OR_PATH")
    try:
        return load_target(name)
    except (TargetError, OSError, ValueError) as err:
        raise ExportError(f"could not load the target {name!r} "
                          f"({'given' if target else 'named in the head config'}): {err}; "
                          "pass --target NAME_OR_PATH (embedded name, model folder or hub id)") from err


def export_head(head_dir, fmt: str, out, *, target=None, verifier: str | None = None,
                dtype: str | None = None, force: bool = False) -> Path:
    """Write the head saved in `head_dir` as `fmt` into the folder `out` (which must not exist
    unless `force`). `verifier` overrides how the engine config names the target (default: its
    local folder, or its hub id); `dtype` casts the weights. Returns `out`."""
    import torch

    head_dir, out = Path(head_dir), Path(out)
    check_head_dir(head_dir)
    cfg = read_head_config(head_dir)
    head_type = cfg["head_type"]
    if fmt not in ENGINE_FORMATS:
        raise ExportError(f"unknown format {fmt!r}; formats: {', '.join(ENGINE_FORMATS)}")
    check_format(head_type, fmt)
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if out.exists() and not force:
        raise ExportError(f"{out} already exists: choose another --out or pass --force to replace it")
    tgt = load_export_target(cfg, target)
    head = load_head(head_dir, tgt)
    if dtype is not None:
        head.to(getattr(torch, dtype))
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    previous = getattr(tgt, "export_verifier", None)
    tgt.export_verifier = verifier or previous   # read by export_common.verifier_ref
    try:
        head.export(fmt, partial, tgt)
        copy_records(head_dir, partial)
        write_card(partial, location=str(out.resolve()))
        _move_into_place(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        tgt.export_verifier = previous
    return out


def check_head_dir(head_dir: Path) -> None:
    """Raise ExportError naming the folder to export when `head_dir` is a training run, one of its
    checkpoints or an export rather than a head folder (users pass all three for `final/`)."""
    from specdec.heads.export_common import PROVENANCE_FILE

    if not head_dir.is_dir():
        raise ExportError(f"{head_dir} does not exist (or is not a folder): give the head folder, "
                          "a specdec-train run's final/")
    if (head_dir / PROVENANCE_FILE).is_file():
        raise ExportError(f"{head_dir} is already an engine export ({PROVENANCE_FILE}): export the "
                          "head folder it was written from (a specdec-train run's final/)")
    if (head_dir / "config.json").is_file():
        return
    run = head_dir.parent.parent if (head_dir / "trainer_state.json").is_file() else head_dir
    if (run / "final" / "config.json").is_file():
        raise ExportError(f"{head_dir} is a training run{' checkpoint' if run != head_dir else ''}, "
                          f"not a head folder: export the trained head, {run / 'final'}")
    if run != head_dir or (run / "checkpoints").is_dir():
        raise ExportError(f"{head_dir} is a training {'checkpoint' if run != head_dir else 'run'} "
                          f"without a final head yet ({run / 'final'} is written when training "
                          "ends): run the same specdec-train command again to finish it, then "
                          "export final/")


def copy_records(head_dir: Path, out: Path) -> list[str]:
    """Copy eval.json and the resolved recipe from the head folder into the export."""
    copied = []
    for dest, sources in RECORDS.items():
        for name in sources:
            if (head_dir / name).is_file():
                shutil.copyfile(head_dir / name, out / dest)
                copied.append(dest)
                break
    return copied


def _move_into_place(partial: Path, out: Path) -> None:
    """rename(2) the finished folder to `out`; an existing `out` (force) is swapped out first and
    deleted only once the new one is in place."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    try:
        partial.rename(out)
    except BaseException:
        if old is not None:
            old.rename(out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


__all__ = ["DTYPES", "ENGINE_FORMATS", "ExportError", "check_format", "export_head", "formats_for",
           "head_types_for", "load_export_target"]
