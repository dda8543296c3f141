"""Draft heads. A head type is a module `specdec.heads.<name>` defining `HEAD = <DraftHead
subclass>`; the registry finds them by that naming convention (see `specdec.heads.base`)."""
from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache
from pathlib import Path

from .base import DraftHead, Drafter, FeatureSpec, HeadShapeError
from .tree import CPU_TREE_BUDGET, GPU_TREE_BUDGET, DraftTree, TreeBudget

_NOT_HEADS = {"base", "layers", "tree"}


@lru_cache(maxsize=None)
def _load(name: str):
    """The HEAD class of module heads/<name>.py, or None if that module defines none."""
    module = importlib.import_module(f"{__name__}.{name}")
    head = getattr(module, "HEAD", None)
    if head is not None and not (isinstance(head, type) and issubclass(head, DraftHead)):
        raise TypeError(f"{module.__name__}.HEAD must be a DraftHead subclass, got {head!r}")
    return head


def _candidates() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__)
                  if not m.ispkg and not m.name.startswith("_") and m.name not in _NOT_HEADS)


@lru_cache(maxsize=None)
def head_types() -> tuple[str, ...]:
    """Every registered head type (imports each heads/<name>.py once)."""
    return tuple(n for n in _candidates() if _load(n) is not None)


def get_head_class(name: str) -> type[DraftHead]:
    """The DraftHead subclass registered as `name`."""
    if name in _candidates():
        cls = _load(name)
        if cls is not None:
            return cls
    raise KeyError(f"unknown head type {name!r}; known types: {', '.join(head_types())}")


def load_head(head_dir, target=None) -> DraftHead:
    """Rebuild a saved head from `head_dir` (config.json + model.safetensors).

    With `target`, the head is checked against it (HeadShapeError names the mismatching field or
    tensor and both shapes) and its frozen target parts are re-attached, ready to use. Without
    it, the trainable weights load (enough to export) but the head cannot run.
    """
    from safetensors.torch import load_file

    from .base import (TOKEN_COUNTS_FILE, WEIGHTS_FILE, HeadShapeError, build_head, load_state_strict,
                       read_head_config)

    cfg = read_head_config(head_dir)
    head = build_head(get_head_class(cfg["head_type"]), cfg, target)
    weights = Path(head_dir) / WEIGHTS_FILE
    if not weights.exists():
        raise FileNotFoundError(f"{head_dir} has no {WEIGHTS_FILE}")
    load_state_strict(head, load_file(str(weights)), where=f"{weights}: ")
    counts_file = Path(head_dir) / TOKEN_COUNTS_FILE
    if counts_file.exists():  # optional: older heads and heads trained elsewhere have none
        counts = load_file(str(counts_file)).get("token_counts")
        vocab = getattr(head.config, "vocab_size", None)
        if counts is None or counts.ndim != 1 or (vocab and counts.numel() != vocab):
            got = None if counts is None else tuple(counts.shape)
            raise HeadShapeError(f"{counts_file}: token_counts should be [{vocab}], got {got}")
        head.token_counts = counts.long()
    if target is not None:
        head.attach_target(target)
    return head.eval()


__all__ = ["CPU_TREE_BUDGET", "DraftHead", "DraftTree", "Drafter", "FeatureSpec", "GPU_TREE_BUDGET",
           "HeadShapeError", "TreeBudget", "get_head_class", "head_types", "load_head"]
