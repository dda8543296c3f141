"""The draft-head protocol and the pieces every head reuses.

Adding a head type
------------------
Write one module `heads/<name>.py` that defines a `DraftHead` subclass and ends with
`HEAD = <YourClass>`; `<name>` becomes its registry key (`specdec.heads.get_head_class(name)`,
recipes' `head: {type: <name>}`). The subclass provides:
  * `Config`: a dataclass; its fields are the recipe's `head:` keys (besides `type`);
  * `target_config(target) -> dict`: the Config fields the target dictates (hidden size, vocab...);
    `TARGET_FIELDS` lists those that must match the target when a saved head is loaded;
  * `FROZEN_PARTS`: {submodule name: "embed_tokens" | "lm_head" | "norm"} copied from the target by
    `attach_target` (frozen, never saved); build those submodules with `frozen_embedding` /
    `frozen_linear` / `RMSNorm` so they cost nothing until attached;
  * `feature_spec()`, `loss(batch)`, `acceptance(batch, depth)`, `new_drafter(target, **opts)`.
Saving, loading, validation and the registry then work unchanged; trainer, exporter and runtime
never look at the head's name.
"""
from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .tree import DraftTree, TreeBudget

HEAD_FORMAT = "specdec-head/1"
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
TOKEN_COUNTS_FILE = "token_counts.safetensors"  # training-data token frequencies (see set_draft_vocab)
IDENTITY_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
                       "num_key_value_heads", "intermediate_size")


class HeadShapeError(ValueError):
    """A head does not fit its target or its checkpoint; the message names the tensor/field."""


@dataclass(frozen=True)
class FeatureSpec:
    """What the target must return per token for a head (training capture and runtime)."""

    hidden: bool = True                # final post-norm hidden state [T, H]
    aux_layers: tuple[int, ...] = ()   # HF hidden_states indices, concatenated -> aux [T, A*H]
    topk_logits: int = 0               # top-k of the target's logits (distillation targets)


def save_weights(tensors: dict[str, Tensor], path: Path, metadata: dict | None = None) -> None:
    """safetensors' save_file, readable as the other files are: safetensors 0.8 writes through a
    private temporary file (mode 0600), and an engine in a container running as another user
    could not read the head."""
    import os

    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


@runtime_checkable
class Drafter(Protocol):
    """One proposer API for every method (see docs/ARCHITECTURE.md for the timeline)."""

    feature_spec: FeatureSpec
    # Optional ``feature_tail``: how many of a prompt's last tokens' features the drafter reads
    # (None or absent: all). ``prefill`` may then get features of the prompt's last tokens only.

    def reset(self, max_batch: int, max_len: int) -> None: ...
    def prefill(self, slot: int, token_ids: Tensor, features: dict[str, Tensor]) -> None: ...
    def propose(self, slots: Tensor, roots: Tensor, budget: TreeBudget) -> DraftTree: ...
    def commit(self, slot: int, token_ids: Tensor, features: dict[str, Tensor]) -> None: ...
    def release(self, slot: int) -> None: ...


# ----------------------------------------------------------------------------------------------
# Frozen target parts
# ----------------------------------------------------------------------------------------------
def frozen_embedding(vocab: int, hidden: int) -> nn.Embedding:
    """An uninitialised, frozen embedding: a placeholder that `attach_target` fills."""
    m = nn.utils.skip_init(nn.Embedding, vocab, hidden)
    return m.requires_grad_(False)


def frozen_linear(d_in: int, d_out: int) -> nn.Linear:
    m = nn.utils.skip_init(nn.Linear, d_in, d_out, bias=False)
    return m.requires_grad_(False)


def target_part(target, role: str) -> nn.Module:
    """The target's module for a role: embed_tokens, lm_head, norm (the final norm) or layers
    (its decoder layers)."""
    model = target.model
    if role == "embed_tokens":
        return model.get_input_embeddings()
    if role == "lm_head":
        return model.get_output_embeddings()
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    if role == "norm":
        for name in ("norm", "final_layernorm", "ln_f"):
            if hasattr(decoder, name):
                return getattr(decoder, name)
        raise HeadShapeError(f"target {target.name} has no final norm the head can copy")
    if role == "layers":
        if not hasattr(decoder, "layers"):
            raise HeadShapeError(f"target {target.name} has no decoder layers the head can copy")
        return decoder.layers
    raise ValueError(f"unknown frozen part role {role!r}")


def llama_dims(target) -> dict[str, Any]:
    """The Llama-family shape fields of a target, under the names head Configs use."""
    cfg = target.config
    heads = cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {
        "rope_type": "default", "rope_theta": getattr(cfg, "rope_theta", 10000.0)}
    return dict(hidden_size=cfg.hidden_size, vocab_size=target.vocab_size,
                num_attention_heads=heads,
                num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                intermediate_size=cfg.intermediate_size,
                rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
                rope_parameters=dict(rope),
                max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096),
                num_target_layers=cfg.num_hidden_layers)


# ----------------------------------------------------------------------------------------------
# The head base class
# ----------------------------------------------------------------------------------------------
class DraftHead(nn.Module):
    Config: ClassVar[type]
    TARGET_FIELDS: ClassVar[tuple[str, ...]] = ("hidden_size", "vocab_size")
    FROZEN_PARTS: ClassVar[dict[str, str]] = {}

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.target_identity: dict | None = None
        self.has_target_parts = not self.FROZEN_PARTS
        self.token_counts: Tensor | None = None  # [V] from the training data, saved beside the weights

    # --- construction -------------------------------------------------------------------------
    # The `--method` name users type for this head (specdec-generate / specdec-bench);
    # None means the registry key itself. Set it for a shorter, conventional name ("mlp").
    METHOD: ClassVar[str | None] = None

    @classmethod
    def head_type(cls) -> str:
        """Registry key = the defining module's name (heads/<name>.py)."""
        return cls.__module__.rsplit(".", 1)[-1]

    @classmethod
    def method_name(cls) -> str:
        return cls.METHOD or cls.head_type()

    @classmethod
    def target_config(cls, target) -> dict[str, Any]:
        """Config fields derived from the target; heads override."""
        return {}

    @classmethod
    def config_from_target(cls, target, **fields):
        names = {f.name for f in dataclasses.fields(cls.Config)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise ValueError(f"unknown {cls.head_type()} head field(s) {unknown}; "
                             f"known: {sorted(names)}")
        derived = {k: v for k, v in cls.target_config(target).items() if k in names}
        for k in cls.TARGET_FIELDS:
            if k in fields and k in derived and fields[k] != derived[k]:
                raise HeadShapeError(f"{k}={fields[k]} does not match the target's {derived[k]}")
        return cls.Config(**{**derived, **fields})

    @classmethod
    def from_target(cls, target, **fields) -> "DraftHead":
        """A new head for `target`, with its frozen parts copied from it."""
        head = cls(cls.config_from_target(target, **fields))
        head.attach_target(target)
        head.init_from_target(target)
        return head

    def init_from_target(self, target) -> None:
        """Hook for a new head (not a loaded one) to start trainable weights from the target's."""

    def attach_target(self, target) -> None:
        """Copy the frozen target parts (embeddings / LM head / final norm) into the head."""
        for name, role in self.FROZEN_PARTS.items():
            mine, theirs = getattr(self, name), target_part(target, role)
            for pname, p in mine.named_parameters(recurse=False):
                src = getattr(theirs, pname, None)
                if src is None or src.shape != p.shape:
                    got = None if src is None else tuple(src.shape)
                    raise HeadShapeError(f"{name}.{pname}: head expects {tuple(p.shape)}, "
                                         f"target {target.name} has {got}")
                with torch.no_grad():
                    p.copy_(src.detach().to(p.dtype))
                p.requires_grad_(False)
            if hasattr(mine, "eps") and hasattr(theirs, "variance_epsilon"):
                mine.eps = theirs.variance_epsilon
        self.target_identity = target.identity()
        self.has_target_parts = True

    def require_target_parts(self) -> None:
        if not self.has_target_parts:
            raise RuntimeError(f"this {self.head_type()} head was loaded without its target: "
                               "pass target= to load_head (or call attach_target) before using it")

    # --- the protocol heads implement ---------------------------------------------------------
    def feature_spec(self) -> FeatureSpec:
        raise NotImplementedError

    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        raise NotImplementedError

    def acceptance(self, batch: dict[str, Tensor], depth: int) -> dict:
        raise NotImplementedError

    def new_drafter(self, target, **opts) -> Drafter:
        raise NotImplementedError

    def set_draft_vocab(self, token_counts: Tensor) -> None:
        """Called by the trainer before training with token_counts [V] (how often each target
        token occurs on loss-masked positions of the training data). Heads with a reduced draft
        vocabulary (EAGLE-3) choose it here; the others keep the counts, which are saved with the
        head so that drafting can score only the most frequent tokens (`frequent_tokens`)."""
        self.token_counts = token_counts.detach().to("cpu", torch.long)

    def frequent_tokens(self, n: int) -> Tensor | None:
        """The ids of the n most frequent training tokens (ties: lower id first), ascending; None
        when the head has no counts (trained before they were saved, or elsewhere) or n covers
        the whole vocabulary."""
        counts = self.token_counts
        if counts is None or n <= 0 or n >= counts.numel():
            return None
        order = torch.sort(counts, descending=True, stable=True).indices
        return order[:n].sort().values

    # --- save / load / export -----------------------------------------------------------------
    def saved_state_dict(self) -> dict[str, Tensor]:
        """Trainable weights and persistent buffers; frozen target copies are left out."""
        frozen = tuple(f"{n}." for n in self.FROZEN_PARTS)
        return {k: v for k, v in self.state_dict().items() if not k.startswith(frozen)}

    def config_dict(self) -> dict:
        return {"head_type": self.head_type(), "format": HEAD_FORMAT,
                **dataclasses.asdict(self.config), "target": self.target_identity}

    def save_pretrained(self, out_dir, overrides: dict[str, Tensor] | None = None) -> Path:
        """Write config.json + model.safetensors; ``overrides`` (name -> tensor) are written in
        place of those weights (the trainer's exact values of parameters it kept frozen)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG_FILE).write_text(json.dumps(self.config_dict(), indent=2) + "\n")
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.saved_state_dict().items()}
        unknown = sorted(set(overrides or {}) - set(tensors))
        if unknown:
            raise KeyError(f"overrides name weights this head does not save: {unknown}")
        tensors.update((k, v.detach().cpu().contiguous()) for k, v in (overrides or {}).items())
        save_weights(tensors, out / WEIGHTS_FILE, metadata={"format": HEAD_FORMAT})
        if self.token_counts is not None:
            save_weights({"token_counts": self.token_counts.contiguous()}, out / TOKEN_COUNTS_FILE)
        return out

    def export_formats(self) -> list[str]:
        """Engine formats this head can be written in (`_export_<fmt>` methods + our own)."""
        return ["specdec"] + sorted(n[len("_export_"):] for n in dir(self) if n.startswith("_export_"))

    def export(self, fmt: str, out_dir, target=None) -> Path:
        if fmt == "specdec":
            return self.save_pretrained(out_dir)
        fn = getattr(self, f"_export_{fmt}", None)
        if fn is None:
            raise ValueError(f"a {self.head_type()} head cannot be exported as {fmt!r}; "
                             f"formats: {self.export_formats()}")
        return fn(Path(out_dir), target)


def read_head_config(head_dir) -> dict:
    path = Path(head_dir) / CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(f"{head_dir} is not a head folder: no {CONFIG_FILE}")
    cfg = json.loads(path.read_text())
    if "head_type" not in cfg:
        raise ValueError(f"{path} has no 'head_type'")
    return cfg


def build_head(cls, cfg: dict, target=None) -> DraftHead:
    """Rebuild a head from its config.json dict, checking it against `target` when given."""
    trained_for = cfg.get("target")
    names = {f.name for f in dataclasses.fields(cls.Config)}
    unknown = sorted(set(cfg) - names - {"head_type", "format", "target"})
    if unknown:
        raise ValueError(f"{cls.head_type()} head config has unknown field(s) {unknown}")
    fields = {k: v for k, v in cfg.items() if k in names}
    if target is not None:
        ident = target.identity()
        if trained_for:
            for k in IDENTITY_SHAPE_KEYS:
                if k in trained_for and trained_for[k] != ident.get(k):
                    raise HeadShapeError(
                        f"this head was trained for target {trained_for.get('name')!r} with "
                        f"{k}={trained_for[k]}, but target {target.name!r} has {k}={ident.get(k)}")
            if trained_for.get("fingerprint") not in (None, ident.get("fingerprint")):
                warnings.warn(f"head was trained for target {trained_for.get('name')!r}; the "
                              f"weights fingerprint of {target.name!r} differs (another checkpoint "
                              "or a fine-tuned one?)", stacklevel=3)
        derived = cls.target_config(target)
        for k in cls.TARGET_FIELDS:
            if k in fields and k in derived and fields[k] != derived[k]:
                raise HeadShapeError(f"head field {k}: the head has {fields[k]}, "
                                     f"target {target.name!r} has {derived[k]}")
    head = cls(cls.Config(**fields))
    head.target_identity = trained_for
    return head


def load_state_strict(head: DraftHead, tensors: dict[str, Tensor], where: str = "") -> None:
    """Load saved tensors; missing / unexpected / wrong-shaped ones raise HeadShapeError."""
    expected = head.saved_state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        raise HeadShapeError(f"{where}missing tensor {missing[0]} (shape "
                             f"{tuple(expected[missing[0]].shape)}); all missing: {missing}")
    if unexpected:
        raise HeadShapeError(f"{where}unexpected tensor {unexpected[0]} "
                             f"{tuple(tensors[unexpected[0]].shape)}; all unexpected: {unexpected}")
    for k, v in expected.items():
        if tuple(tensors[k].shape) != tuple(v.shape):
            raise HeadShapeError(f"{where}tensor {k} has shape {tuple(tensors[k].shape)} in the "
                                 f"checkpoint but the head expects {tuple(v.shape)}")
    head.load_state_dict({k: tensors[k] for k in expected}, strict=False)


# ----------------------------------------------------------------------------------------------
# Losses over a large vocabulary, one chunk of rows at a time
# ----------------------------------------------------------------------------------------------
class LogitLoss(NamedTuple):
    loss: Tensor          # [N] per-row loss (soft cross-entropy = KL + teacher entropy)
    top1: Tensor          # [N] student argmax
    conf: Tensor          # [N] student probability of its argmax
    teacher_top1: Tensor  # [N] teacher argmax (-1 where the teacher gives none)


# Up to this many logits ([N, V] elements, 128 MB in float32) a loss keeps them for backward
# instead of recomputing them chunk by chunk: an EAGLE-3 CPU batch (~1,800 positions x an 8k
# draft vocab) then computes its LM head once, not twice (with EAGLE-3's shared soft labels: loss +
# backward 11-25% faster on captured batches, the recipe's training 14.2 -> 13.2 min), while a GPU
# batch over a 128k vocab stays chunked.
KEEP_LOGITS_ELEMS = 1 << 25


def _rows_per_chunk(vocab: int, budget_elems: int = 1 << 22) -> int:
    return max(1, budget_elems // max(vocab, 1))


def chunked_logit_loss(h: Tensor, weight: Tensor, *, teacher_h: Tensor | None = None,
                       teacher_weight: Tensor | None = None, teacher_probs: Tensor | None = None,
                       teacher_ids: Tensor | None = None, topk_values: Tensor | None = None,
                       topk_indices: Tensor | None = None, chunk_rows: int | None = None) -> LogitLoss:
    """Cross-entropy of the student logits `h @ weight.T` against one teacher, chunk by chunk.

    h [N, H] student features; weight [V, H] the student LM head (frozen target head or the
    head's own). Exactly one teacher:
      teacher_h [N, Ht] (+ teacher_weight [V, Ht], default `weight`): soft labels
          softmax(teacher_h @ teacher_weight.T), as EAGLE trains;
      teacher_probs [N, V]: those soft labels already computed (`soft_labels`);
      teacher_ids [N]: hard labels;
      topk_values / topk_indices [N, k]: a sparse teacher renormalised over its top-k
          (indices < 0 are dropped; values may be logits or log-probs).
    Past KEEP_LOGITS_ELEMS each chunk's [rows, V] logits are recomputed in backward
    (activation checkpointing), so peak memory is one chunk, never [N, V].
    """
    N, V = h.shape[0], weight.shape[0]
    rows = chunk_rows or (max(N, 1) if N * V <= KEEP_LOGITS_ELEMS else _rows_per_chunk(V))
    if teacher_h is not None and teacher_weight is None:
        teacher_weight = weight

    def one_chunk(hc: Tensor, s: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        logp = F.log_softmax((hc @ weight.T).float(), dim=-1)                 # [n, V]
        e = s + hc.shape[0]
        if teacher_probs is not None:
            tp = teacher_probs[s:e]
            t1 = tp.argmax(-1)
            loss = -(tp * logp).sum(-1)
        elif teacher_h is not None:
            with torch.no_grad():
                tl = (teacher_h[s:e] @ teacher_weight.T).float()
                tp, t1 = tl.softmax(-1), tl.argmax(-1)
            loss = -(tp * logp).sum(-1)
        elif teacher_ids is not None:
            t1 = teacher_ids[s:e]
            loss = -logp.gather(1, t1.clamp(min=0)[:, None]).squeeze(1)
        else:
            idx, val = topk_indices[s:e].long(), topk_values[s:e].float()
            val = val.masked_fill(idx < 0, float("-inf"))
            tp = torch.nan_to_num(val.softmax(-1), nan=0.0)                    # all dropped -> 0
            loss = -(tp * logp.gather(1, idx.clamp(min=0))).sum(-1)
            t1 = torch.where((idx >= 0).any(-1), idx.gather(1, val.argmax(-1, keepdim=True))[:, 0],
                             torch.full_like(idx[:, 0], -1))
        conf, top1 = logp.detach().max(-1)
        return loss, top1, conf.exp(), t1

    parts = []
    for s in range(0, N, rows):
        hc = h[s:s + rows]
        if torch.is_grad_enabled() and hc.requires_grad and N > rows:
            parts.append(checkpoint(one_chunk, hc, s, use_reentrant=False))
        else:
            parts.append(one_chunk(hc, s))
    if not parts:
        z = h.new_zeros(0)
        zi = torch.zeros(0, dtype=torch.long, device=h.device)
        return LogitLoss(z, zi, z, zi)
    return LogitLoss(*(torch.cat(p) for p in zip(*parts)))


@torch.no_grad()
def soft_labels(h: Tensor, weight: Tensor) -> Tensor | None:
    """softmax(h @ weight.T) in float32 [N, V], the teacher of `chunked_logit_loss(teacher_probs=)`,
    for a loss that reads each row several times (EAGLE-3's unrolled steps); None when it would
    exceed KEEP_LOGITS_ELEMS (then pass teacher_h and let each chunk compute its rows)."""
    if h.shape[0] * weight.shape[0] > KEEP_LOGITS_ELEMS:
        return None
    return (h @ weight.T).float().softmax(-1)


@torch.no_grad()
def chunked_top1(h: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """Argmax [N] and its probability [N] of softmax(h @ weight.T), without [N, V] at once."""
    rows = _rows_per_chunk(weight.shape[0])
    top, conf = [], []
    for s in range(0, h.shape[0], rows):
        p = (h[s:s + rows] @ weight.T).float().softmax(-1)
        c, t = p.max(-1)
        top.append(t)
        conf.append(c)
    if not top:
        return torch.zeros(0, dtype=torch.long, device=h.device), h.new_zeros(0)
    return torch.cat(top), torch.cat(conf)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over mask (0 when the mask is empty, keeping the graph)."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


# ----------------------------------------------------------------------------------------------
# Acceptance statistics (trainer eval): one pattern for every head
# ----------------------------------------------------------------------------------------------
def depth_valid_mask(batch: dict[str, Tensor], depth: int) -> Tensor:
    """valid [depth, B, T]: the depth-d prediction made at position t (the token t+1+d, whose
    target distribution is the target's output at position t+d) is scored iff t+d < T, token t+d
    is real and loss_mask[t+d] (d = 1 is the convention "position t counts iff loss_mask[t+1]")."""
    lm = batch["loss_mask"].bool() & batch.get("attention_mask", batch["loss_mask"]).bool()
    B, T = lm.shape
    out = torch.zeros(depth, B, T, dtype=torch.bool, device=lm.device)
    for d in range(1, depth + 1):
        if d < T:
            out[d - 1, :, :T - d] = lm[:, d:]
    return out


def shift_left(x: Tensor, k: int, fill=0) -> Tensor:
    """x [B, T, ...] -> y with y[:, t] = x[:, t+k] (fill past the end). [a,b,c], 1 -> [b,c,fill]."""
    if k == 0:
        return x
    pad = x.new_full((x.shape[0], min(k, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, k:], pad], dim=1)


def target_argmax(batch: dict[str, Tensor], lm_head_weight: Tensor | None = None) -> Tensor:
    """The target's greedy next token at every position [B, T] (from captured top-k logits when
    present, else from lm_head(hidden))."""
    if "topk_indices" in batch:
        vals, idx = batch["topk_values"], batch["topk_indices"].long()
        return idx.gather(-1, vals.argmax(-1, keepdim=True)).squeeze(-1)
    if lm_head_weight is None:
        raise ValueError("target_argmax needs topk_indices in the batch or the LM head weight")
    h = batch["hidden"]
    B, T, H = h.shape
    flat = h.reshape(B * T, H)
    rows = _rows_per_chunk(lm_head_weight.shape[0])
    with torch.no_grad():
        out = [(flat[s:s + rows] @ lm_head_weight.T).argmax(-1) for s in range(0, B * T, rows)]
    return torch.cat(out).view(B, T)


def acceptance_stats(pred: Tensor, conf: Tensor, target: Tensor, valid: Tensor) -> dict:
    """Per-depth acceptance from teacher-forced predictions.

    pred / target [D, B, T] long: the draft's top-1 and the target's argmax at depth d+1 for the
    chain started at position t; conf [D, B, T] the draft's top-1 probability; valid [D, B, T].
    Returns correct [D] (chains whose depths 1..d+1 all matched: the greedy accepted length
    counts), count [D] (scored chains), and calibration lists `confidence` / `hit` / `depth`
    with one entry per prediction made after an accepted prefix.
    """
    hit = (pred == target) & valid
    prefix_ok = torch.ones_like(valid[0])
    correct, count, confs, hits, depths = [], [], [], [], []
    for d in range(pred.shape[0]):
        scored = valid[d] & prefix_ok          # the draft reached depth d+1 with a correct prefix
        confs.append(conf[d][scored])
        hits.append(hit[d][scored])
        depths.append(torch.full_like(conf[d][scored], d + 1, dtype=torch.long))
        prefix_ok = prefix_ok & hit[d]
        correct.append((prefix_ok & valid[d]).sum())
        count.append(valid[d].sum())
    return {"correct": torch.stack(correct).cpu(), "count": torch.stack(count).cpu(),
            "confidence": torch.cat(confs).float().cpu().tolist(),
            "hit": torch.cat(hits).cpu().tolist(), "depth": torch.cat(depths).cpu().tolist()}


def init_linear_(module: nn.Module, std: float = 0.02) -> None:
    """Default init for trainable Linear weights (normal std, zero bias)."""
    for m in module.modules():
        if isinstance(m, nn.Linear) and m.weight.requires_grad:
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


__all__ = ["DraftHead", "Drafter", "FeatureSpec", "HeadShapeError", "LogitLoss",
           "acceptance_stats", "chunked_logit_loss", "chunked_top1", "depth_valid_mask", "frozen_embedding",
           "frozen_linear", "init_linear_", "llama_dims", "masked_mean", "shift_left", "soft_labels",
           "target_argmax", "target_part"]
