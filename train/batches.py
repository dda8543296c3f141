"""Padded training batches from captured features (offline) or the live target (online).

Both sources hand the trainer the batch dict every head's ``loss``/``acceptance`` reads
(docs/ARCHITECTURE.md): ``input_ids [B,T] long``, ``loss_mask [B,T] bool``,
``attention_mask [B,T] bool``, ``hidden [B,T,H]`` and, as the head's feature spec asks,
``aux [B,T,A*H]``, ``topk_values / topk_indices [B,T,k]``. Sequences are right-padded, so
every real position keeps its causal prefix exactly.

``GlobalBatchPlan`` decides which sequences each process sees at each optimizer step. It
depends only on (seed, epoch, global batch size), never on the number of processes: the
global batch of step s is cut into micro-batches [accum][world][micro], and process r takes
chunk ``a * world + r`` at accumulation step a. So 1 process x 2 accumulation steps and
2 processes x 1 step see the same micro-batches, and a resumed run sees the same
sequences as an uninterrupted one (its position is just the step number).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT_FEATURES = ("hidden", "aux", "topk_values")


def pad_batch(items: list[dict[str, torch.Tensor]], float_dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Right-pad per-sequence tensors ([T] or [T, D]) into one batch ([B, T] or [B, T, D])."""
    if not items:
        raise ValueError("pad_batch: no sequences")
    lengths = [int(item["input_ids"].shape[0]) for item in items]
    longest = max(lengths)
    batch: dict[str, torch.Tensor] = {}
    for key in items[0]:
        first = items[0][key]
        if not isinstance(first, torch.Tensor) or first.dim() == 0 or first.shape[0] != lengths[0]:
            continue  # per-sequence metadata (e.g. offsets), not a per-token tensor
        if key in FLOAT_FEATURES:
            dtype = float_dtype
        elif key == "loss_mask":
            dtype = torch.bool
        else:
            dtype = torch.long  # input_ids, topk_indices
        out = torch.zeros((len(items), longest, *first.shape[1:]), dtype=dtype)
        for row, item in enumerate(items):
            out[row, :lengths[row]] = item[key].to(dtype)
        batch[key] = out
    positions = torch.arange(longest)  # [T]
    batch["attention_mask"] = positions[None, :] < torch.tensor(lengths)[:, None]  # [B, T]
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


class StoreSource:
    """Sequences of a FeatureStore (offline features), restricted to ``indices``."""

    def __init__(self, store, indices: list[int]):
        self.store = store
        self.indices = list(indices)
        self._lengths = None

    def __len__(self) -> int:
        return len(self.indices)

    def lengths(self) -> list[int]:
        if self._lengths is None:
            self._lengths = [int(n) for n in _store_lengths(self.store, self.indices)]
        return self._lengths

    def batch(self, positions: list[int], float_dtype, device) -> dict[str, torch.Tensor]:
        items = [self.store[self.indices[p]] for p in positions]
        return pad_batch(items, float_dtype, device)


def _store_lengths(store, indices):
    lengths = getattr(store, "lengths", None)
    if callable(lengths):
        every = lengths()
        return [every[i] for i in indices]
    return [store[i]["input_ids"].shape[0] for i in indices]


class OnlineSource:
    """Tokenised sequences whose features the frozen target computes at batch time.

    ``rows``: a ``datasets.Dataset`` (or list of dicts) with ``input_ids`` and ``loss_mask``;
    rows are read one by one, so a large Arrow dataset is never copied into Python lists.
    """

    def __init__(self, rows, target, feature_spec):
        self.rows = rows
        self.target = target
        self.spec = feature_spec
        self._lengths = None

    def __len__(self) -> int:
        return len(self.rows)

    def lengths(self) -> list[int]:
        if self._lengths is None:
            if hasattr(self.rows, "select_columns"):  # a datasets.Dataset: scan in chunks
                self._lengths = []
                for chunk in self.rows.select_columns(["input_ids"]).iter(batch_size=4096):
                    self._lengths.extend(len(ids) for ids in chunk["input_ids"])
            else:
                self._lengths = [len(row["input_ids"]) for row in self.rows]
        return self._lengths

    def batch(self, positions: list[int], float_dtype, device) -> dict[str, torch.Tensor]:
        from specdec.train.features import compute_features

        items = [{"input_ids": torch.as_tensor(self.rows[p]["input_ids"]),
                  "loss_mask": torch.as_tensor(self.rows[p]["loss_mask"])} for p in positions]
        batch = pad_batch(items, float_dtype, device)
        model_device = next(self.target.model.parameters()).device
        feats = compute_features(self.target.model, batch["input_ids"].to(model_device),
                                 batch["attention_mask"].to(model_device).long(),
                                 hidden=self.spec.hidden, aux_layers=tuple(self.spec.aux_layers),
                                 topk=self.spec.topk_logits)
        for key, value in feats.items():
            dtype = float_dtype if value.is_floating_point() else torch.long
            batch[key] = value.to(device=device, dtype=dtype)
        return batch


@dataclass
class GlobalBatchPlan:
    """Which sequences each process reads at each optimizer step (see module docstring).

    ``lengths`` turns on length grouping: each epoch's shuffled order is cut into groups of
    ``group_batches`` global batches, each group is sorted by length and split into global
    batches, and the batch order is shuffled again. Micro-batches then hold sequences of
    similar length (little padding) while every epoch still sees all of them in random order.
    """

    num_items: int
    micro_batch_size: int
    grad_accum: int
    world_size: int
    rank: int
    seed: int = 0
    lengths: list[int] | None = None
    group_batches: int = 16

    def __post_init__(self):
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"{self.num_items} training sequences are fewer than one global batch "
                f"(micro_batch_size {self.micro_batch_size} x grad_accum {self.grad_accum} x "
                f"{self.world_size} processes = {self.global_batch_size}): add data or shrink the batch")
        self._epoch_cache: tuple[int, torch.Tensor] | None = None

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        # the last partial global batch of an epoch is dropped: every step has equal size
        return self.num_items // self.global_batch_size

    def micro_batch(self, step: int, accum_index: int) -> list[int]:
        """Item positions for this process at optimizer step ``step`` (0-based), micro ``accum_index``."""
        epoch, within = divmod(step, self.steps_per_epoch)
        order = self._epoch_order(epoch)  # [steps_per_epoch, global_batch]
        chunk = accum_index * self.world_size + self.rank
        start = chunk * self.micro_batch_size
        return order[within, start:start + self.micro_batch_size].tolist()

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            self._epoch_cache = (epoch, self._build_order(epoch))
        return self._epoch_cache[1]

    def _build_order(self, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(self.num_items, generator=gen)
        used = self.steps_per_epoch * self.global_batch_size
        perm = perm[:used]
        if self.lengths is not None:
            lengths = torch.as_tensor(self.lengths)
            group = self.group_batches * self.global_batch_size
            parts = []
            for start in range(0, used, group):
                part = perm[start:start + group]
                # stable sort, longest first: deterministic for equal lengths
                parts.append(part[torch.argsort(-lengths[part], stable=True)])
            perm = torch.cat(parts)
        order = perm.view(self.steps_per_epoch, self.global_batch_size)
        if self.lengths is not None:
            # each global batch is a consecutive run of a sorted group, so its micro-batches
            # are length-homogeneous whatever the world size; shuffle the batch order
            order = order[torch.randperm(self.steps_per_epoch, generator=gen)]
        return order


def eval_batches(num_items: int, batch_size: int, world_size: int, rank: int) -> list[list[int]]:
    """Eval positions for this process: a strided shard of 0..num_items-1 in batches."""
    mine = list(range(rank, num_items, world_size))
    return [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]
