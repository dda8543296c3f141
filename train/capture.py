"""Offline feature capture: run the frozen target once over tokenised data, store features.

Directory layout (docs/ARCHITECTURE.md):
  DIR/manifest.json             format, target identity, feature spec, dtype, shard list
                                (file, num_sequences, num_tokens, sha256), complete, source
  DIR/shard-00000.safetensors   input_ids [T] int32, loss_mask [T] uint8, offsets [n+1] int64,
                                hidden [T,H], aux [T,A*H], topk_values [T,k], topk_indices [T,k]

Shards cover consecutive sequences of the dataset (store index = dataset index), so a
sequence keeps its place however the capture was batched. Each shard is written to a
temporary name and renamed, then the manifest is replaced atomically: a killed capture
resumes after the last shard the manifest lists, and a shard whose bytes, presence or
provenance disagree with the manifest raises `CaptureError` naming it.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .features import check_aux_layers, compute_features

FORMAT = "specdec-features/1"
MANIFEST = "manifest.json"
FLOAT_KEYS = ("hidden", "aux", "topk_values")


class CaptureError(RuntimeError):
    """A capture directory is corrupt, incomplete or does not match what is asked of it."""


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def feature_dict(hidden: bool, aux_layers, topk_logits: int) -> dict:
    """The manifest's `features` entry (same fields as heads' FeatureSpec)."""
    return {"hidden": bool(hidden), "aux_layers": [int(x) for x in aux_layers],
            "topk_logits": int(topk_logits)}


def as_feature_dict(spec) -> dict:
    """A features dict from a dict or any FeatureSpec-like object."""
    if isinstance(spec, dict):
        return feature_dict(spec.get("hidden", True), spec.get("aux_layers", ()), spec.get("topk_logits", 0))
    return feature_dict(spec.hidden, spec.aux_layers, spec.topk_logits)


def feature_keys(features: dict) -> set[str]:
    """The tensors a shard holds for a feature spec."""
    keys = {"input_ids", "loss_mask", "offsets"}
    keys |= {"hidden"} if features["hidden"] else set()
    keys |= {"aux"} if features["aux_layers"] else set()
    keys |= {"topk_values", "topk_indices"} if features["topk_logits"] else set()
    return keys


def same_target(a: dict, b: dict) -> bool:
    """Identities match on shape + weights fingerprint; the display name may differ
    (`smollm2-135m` and the path of its folder are the same model)."""
    return {k: v for k, v in a.items() if k != "name"} == {k: v for k, v in b.items() if k != "name"}


def resolve_features(target, head_type: str | None = None, hidden: bool | None = None,
                     aux_layers=None, topk_logits: int | None = None) -> dict:
    """Feature spec from a head type (its `feature_spec()`), overridden by explicit values."""
    spec = feature_dict(True, [], 0)
    if head_type:
        try:
            from specdec.heads import get_head_class
        except ImportError as err:
            raise CaptureError("--head-type needs the head registry specdec.heads.get_head_class, "
                               "which this install lacks: give --aux-layers/--hidden/--topk-logits "
                               "instead") from err
        try:
            head = get_head_class(head_type).from_target(target)
        except KeyError as err:  # an unknown head type: the message lists the known ones
            raise CaptureError(err.args[0]) from None
        fs = head.feature_spec()
        spec = as_feature_dict(fs)
        del head
    if hidden is not None:
        spec["hidden"] = bool(hidden)
    if aux_layers is not None:
        try:
            spec["aux_layers"] = check_aux_layers(aux_layers, target.num_layers)
        except ValueError as err:
            raise CaptureError(f"--aux-layers: {err}") from None
    if topk_logits is not None:
        spec["topk_logits"] = int(topk_logits)
    if not (spec["hidden"] or spec["aux_layers"] or spec["topk_logits"]):
        raise CaptureError("nothing to capture: no hidden, no aux layers and no top-k logits")
    return spec


def plan_shards(lengths: list[int], shard_tokens: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) sequence ranges of about `shard_tokens` tokens each."""
    plan, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        tokens += n
        if tokens >= shard_tokens:
            plan.append((start, i + 1))
            start, tokens = i + 1, 0
    if start < len(lengths):
        plan.append((start, len(lengths)))
    return plan


def dataset_digest(dataset) -> str:
    """sha256 over every sequence's ids and mask: a resumed capture must see the same data."""
    h = hashlib.sha256()
    for row in dataset.select_columns(["input_ids", "loss_mask"]).iter(batch_size=1024):
        for ids, mask in zip(row["input_ids"], row["loss_mask"]):
            h.update(np.asarray(ids, np.int32).tobytes())
            h.update(np.asarray(mask, np.uint8).tobytes())
            h.update(b"|")
    return h.hexdigest()


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _capture_shard(model, seqs: list[tuple[list[int], list[int]]], features: dict,
                   batch_tokens: int, max_batch: int, pad_id: int, on_batch) -> dict:
    """Features of one shard's sequences, batched longest-first to waste little padding."""
    device = next(model.parameters()).device
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
    results: list[dict | None] = [None] * len(seqs)
    pos = 0
    while pos < len(order):
        longest = len(seqs[order[pos]][0])
        size = max(1, min(max_batch, batch_tokens // max(longest, 1), len(order) - pos))
        batch = order[pos:pos + size]
        ids = torch.full((size, longest), pad_id, dtype=torch.long)  # [B, T], right padding
        attn = torch.zeros((size, longest), dtype=torch.long)         # [B, T]
        for row, i in enumerate(batch):
            n = len(seqs[i][0])
            ids[row, :n] = torch.tensor(seqs[i][0])
            attn[row, :n] = 1
        out = compute_features(model, ids.to(device), attn.to(device), features["hidden"],
                               features["aux_layers"], features["topk_logits"])
        for row, i in enumerate(batch):
            n = len(seqs[i][0])
            results[i] = {k: v[row, :n].cpu() for k, v in out.items()}
        on_batch(int(attn.sum()))
        pos += size
    tensors = {
        "input_ids": torch.tensor([t for s in seqs for t in s[0]], dtype=torch.int32),  # [T]
        "loss_mask": torch.tensor([m for s in seqs for m in s[1]], dtype=torch.uint8),  # [T]
        "offsets": torch.tensor(np.cumsum([0] + [len(s[0]) for s in seqs]), dtype=torch.int64),
    }
    for key in results[0]:
        cat = torch.cat([r[key] for r in results])
        tensors[key] = (cat.to(torch.int32) if key == "topk_indices" else cat).contiguous()
    return tensors


def capture(target, dataset, out_dir, features: dict, *, batch_tokens: int = 8192,
            max_batch: int = 64, shard_tokens: int = 32768, source: dict | None = None,
            overwrite: bool = False, progress: bool = True,
            on_shard: Callable[[int], None] | None = None) -> Path:
    """Capture `features` for every sequence of a tokenised `dataset` into `out_dir`.

    Resumable: rerunning with the same target, features, dtype and data continues after the
    shards the manifest already lists (each re-verified by checksum). `on_shard(k)` is
    called after shard k is committed (tests use it to simulate a kill).
    """
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    out = Path(out_dir)
    features = as_feature_dict(features)
    model = target.model
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    lengths = [len(x) for x in dataset["input_ids"]]
    if not lengths:
        raise CaptureError("the dataset to capture is empty")
    plan = plan_shards(lengths, shard_tokens)
    manifest = {"format": FORMAT, "target": target.identity(), "features": features,
                "dtype": dtype, "shards": [], "complete": False,
                "source": {**(source or {}), "num_sequences": len(lengths),
                           "num_tokens": sum(lengths), "shard_tokens": shard_tokens,
                           "digest": dataset_digest(dataset)},
                "topk_values": "log_softmax"}
    done = 0
    if (out / MANIFEST).exists() and not overwrite:
        old = read_manifest(out)
        if not same_target(manifest["target"], old.get("target", {})):
            raise CaptureError(f"{out / MANIFEST}: the existing capture was made with target "
                               f"{old.get('target')}, not {manifest['target']}; use another "
                               "--out or --overwrite")
        for key, new_val, old_val in (("features", features, old.get("features")),
                                      ("dtype", dtype, old.get("dtype")),
                                      ("data", manifest["source"]["digest"], old["source"].get("digest")),
                                      ("shard_tokens", shard_tokens, old["source"].get("shard_tokens"))):
            if new_val != old_val:
                raise CaptureError(f"{out / MANIFEST}: the existing capture has a different {key} "
                                   f"({old_val} vs now {new_val}); use another --out or --overwrite")
        for entry in old["shards"]:
            _verify_shard(out, entry)
        manifest["shards"], done = old["shards"], len(old["shards"])
        if old.get("complete"):
            return out
    elif overwrite and out.exists():
        for f in [*out.glob("shard-*.safetensors*"), out / MANIFEST]:
            f.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.tmp"):  # left by a kill in the middle of a write
        stale.unlink()
    _write_json_atomic(out / MANIFEST, manifest)
    pad_id = getattr(target.tokenizer, "pad_token_id", None) or 0
    remaining = sum(lengths[plan[done][0]:]) if done < len(plan) else 0
    bar = tqdm(total=remaining, unit="tok", unit_scale=True, desc="capture", disable=not progress)
    for k in range(done, len(plan)):
        a, b = plan[k]
        rows = dataset.select(range(a, b))
        seqs = list(zip(rows["input_ids"], rows["loss_mask"]))
        tensors = _capture_shard(model, seqs, features, batch_tokens, max_batch, pad_id, bar.update)
        path = out / shard_name(k)
        tmp = path.with_name(path.name + ".tmp")
        # One metadata key only: safetensors writes a map's keys in random order, and
        # identical data must give identical bytes (and checksums).
        save_file(tensors, str(tmp), metadata={"format": FORMAT})
        os.replace(tmp, path)
        manifest["shards"].append({"file": path.name, "num_sequences": b - a,
                                   "num_tokens": int(tensors["input_ids"].numel()),
                                   "sha256": sha256_file(path)})
        _write_json_atomic(out / MANIFEST, manifest)
        if on_shard is not None:
            on_shard(k)
    bar.close()
    manifest["complete"] = True
    _write_json_atomic(out / MANIFEST, manifest)
    return out


def read_manifest(directory) -> dict:
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise CaptureError(f"{path}: no capture manifest (run `specdec-data capture` first)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CaptureError(f"{path}: corrupt manifest ({err})") from err
    if manifest.get("format") != FORMAT:
        raise CaptureError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def _verify_shard(directory: Path, entry: dict, checksum: bool = True) -> None:
    path = directory / entry["file"]
    if not path.exists():
        raise CaptureError(f"{path}: shard listed in the manifest is missing")
    if checksum and sha256_file(path) != entry["sha256"]:
        raise CaptureError(f"{path}: checksum mismatch, the shard is corrupt or was replaced; "
                           "delete it and rerun the capture to redo it")


class FeatureStore:
    """Random access to captured features by sequence index.

    `store[i]` -> {"input_ids" [n] long, "loss_mask" [n] bool, "hidden" [n,H], "aux"
    [n,A*H], "topk_values" [n,k], "topk_indices" [n,k] long} (the captured keys only).
    Shards are memory-mapped lazily (a few kept open) and only sequence i's rows are read;
    each shard's checksum is checked the first time it is opened.
    """

    def __init__(self, directory, target=None, features: dict | None = None,
                 check_checksums: bool = True, max_open: int = 4, allow_incomplete: bool = False):
        self.dir = Path(directory)
        self.manifest = read_manifest(self.dir)
        where = self.dir / MANIFEST
        if not self.manifest.get("complete") and not allow_incomplete:
            raise CaptureError(f"{where}: capture is incomplete; rerun the same "
                               "`specdec-data capture` command to finish it")
        if target is not None and not same_target(self.manifest["target"], target.identity()):
            raise CaptureError(f"{where}: captured for target {self.manifest['target']}, "
                               f"not {target.identity()}")
        if features is not None and as_feature_dict(features) != self.manifest["features"]:
            raise CaptureError(f"{where}: captured features {self.manifest['features']} differ "
                               f"from the requested {as_feature_dict(features)}")
        self.shards = self.manifest["shards"]
        self._starts = np.cumsum([0] + [s["num_sequences"] for s in self.shards]).tolist()
        self._check = check_checksums
        self._verified: set[int] = set()
        self._open: OrderedDict[int, tuple] = OrderedDict()
        self._max_open = max_open

    def __getstate__(self):  # DataLoader workers: reopen shards in each process
        state = dict(self.__dict__)
        state["_open"] = OrderedDict()
        return state

    @property
    def features(self) -> dict:
        return self.manifest["features"]

    def __len__(self) -> int:
        return self._starts[-1]

    def _shard(self, k: int):
        if k in self._open:
            self._open.move_to_end(k)
            return self._open[k]
        from safetensors import safe_open

        entry = self.shards[k]
        _verify_shard(self.dir, entry, checksum=self._check and k not in self._verified)
        self._verified.add(k)
        path = self.dir / entry["file"]
        handle = safe_open(str(path), framework="pt")
        missing = feature_keys(self.features) - set(handle.keys())
        if missing:
            raise CaptureError(f"{path}: lacks {sorted(missing)} that the manifest's features need")
        offsets = handle.get_tensor("offsets")
        if offsets.numel() != entry["num_sequences"] + 1 or int(offsets[-1]) != entry["num_tokens"]:
            raise CaptureError(f"{path}: offsets disagree with the manifest")
        self._open[k] = (handle, offsets)
        if len(self._open) > self._max_open:
            self._open.popitem(last=False)
        return self._open[k]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences")
        i %= len(self)
        k = bisect.bisect_right(self._starts, i) - 1
        handle, offsets = self._shard(k)
        j = i - self._starts[k]
        a, b = int(offsets[j]), int(offsets[j + 1])
        item = {key: handle.get_slice(key)[a:b] for key in handle.keys() if key != "offsets"}
        item["input_ids"] = item["input_ids"].long()
        item["loss_mask"] = item["loss_mask"].bool()
        if "topk_indices" in item:
            item["topk_indices"] = item["topk_indices"].long()
        return item

    def lengths(self) -> list[int]:
        """Token count of every sequence (reads each shard's small offsets tensor)."""
        out = []
        for k in range(len(self.shards)):
            offsets = self._shard(k)[1]
            out.extend((offsets[1:] - offsets[:-1]).tolist())
        return out

    def verify(self) -> None:
        """Check every shard: present, checksum, offsets; raises CaptureError naming the shard."""
        for k, entry in enumerate(self.shards):
            _verify_shard(self.dir, entry)
            self._verified.add(k)
            self._open.pop(k, None)
            self._shard(k)
