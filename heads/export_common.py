"""Writing trained heads in the folder layouts serving engines load as they are.

A head type supports an engine format by defining `_export_<fmt>(out_dir, target)` (see
`DraftHead.export`); that method maps its own tensor names to the engine's and builds the
engine's config.json, then calls `write_export` here, which writes

    config.json            the engine's config (field names exactly as its config class reads them)
    <weights>.safetensors  the engine's tensor names (metadata {"format": "pt"}, as transformers wants)
    specdec.json           provenance: head type + config, target identity, verifier, usage template
    tokenizer.json, tokenizer_config.json   the target's tokenizer, for engines that read it from
                           the draft folder (TGI's router: `tokenizer=True`)
    README.md              the model card (`render_model_card`; re-rendered by specdec-export once
                           eval.json / recipe.resolved.yaml are copied in, and by specdec-push)

Nothing here imports specdec.train: heads stay usable without the training stack.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from torch import Tensor

EXPORT_FORMAT = "specdec-export/1"
PROVENANCE_FILE, CARD_FILE = "specdec.json", "README.md"
EVAL_FILE, RECIPE_FILE = "eval.json", "recipe.resolved.yaml"
# Placeholders in usage templates: the draft folder (or hub repo) and the verifier reference.
DRAFT, VERIFIER = "<draft>", "<verifier>"

TITLES = {"eagle3": "EAGLE-3", "eagle": "EAGLE", "medusa": "Medusa", "hydra": "Hydra",
          "mlp_speculator": "MLPSpeculator", "draft_lm": "draft LM", "redrafter": "ReDrafter"}


class ExportError(ValueError):
    """A head cannot be written in the requested format; the message says why and what can."""


# ----------------------------------------------------------------------------------------------
# Facts about the target that engine configs record
# ----------------------------------------------------------------------------------------------
def verifier_ref(target, identity: dict | None = None) -> str:
    """How an engine config names the verifier (the target), tokenizer-free.

    `target.export_verifier` when the caller set one (specdec-export --verifier, e.g. a hub id
    before pushing), else the target's hub id (portable: the embedded smollm2-135m is
    HuggingFaceTB/SmolLM2-135M-Instruct quantised to 4 bits (Q4_1) and dequantised, so an engine
    loading the hub model verifies with its full-precision original: acceptance there may differ
    a little from the measured one), else its local model folder (absolute, loadable by every
    engine on this machine), else its name.
    """
    if target is not None:
        override = getattr(target, "export_verifier", None) or getattr(target, "hub_id", None)
        if override:
            return str(override)
        path = Path(target.path)
        if path.is_dir() and (path / "config.json").exists():
            return str(path.resolve())
        return str(target.name)
    if identity and identity.get("name"):
        return str(identity["name"])
    raise ExportError("this export needs the target (to name the verifier): pass target=")


def target_architectures(target) -> list[str]:
    archs = getattr(target.config, "architectures", None) if target is not None else None
    return list(archs) if archs else ([type(target.model).__name__] if target is not None else [])


def special_tokens(target) -> dict:
    """bos / eos / pad ids of the target (reference EAGLE configs carry them; engines ignore them)."""
    if target is None:
        return {}
    cfg = target.config
    return {k: getattr(cfg, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if getattr(cfg, k, None) is not None}


def rope_fields(rope: dict | None) -> dict:
    """RoPE in both spellings: transformers 4 (`rope_theta` + `rope_scaling`) and transformers 5
    (`rope_parameters`), so engines built on either read the head's rotary frequencies."""
    rope = dict(rope or {"rope_type": "default", "rope_theta": 10000.0})
    rope_type = rope.pop("type", None) or rope.get("rope_type", "default")
    theta = float(rope.get("rope_theta", 10000.0))
    scaling = None
    if rope_type != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        scaling["rope_type"] = rope_type
    return {"rope_theta": theta, "rope_scaling": scaling,
            "rope_parameters": {**rope, "rope_type": rope_type, "rope_theta": theta}}


def dtype_name(tensors: dict[str, Tensor]) -> str:
    """The floating dtype of the exported weights ("float32", "bfloat16", ...)."""
    for t in tensors.values():
        if t.is_floating_point():
            return str(t.dtype).removeprefix("torch.")
    return "float32"


def llama_layer_config(c, target, tensors: dict[str, Tensor]) -> dict:
    """A LlamaConfig dict for a one-layer EAGLE-family draft built from the head's Config `c`
    (hidden/head sizes, norm eps, RoPE: the head's own, which are the target's)."""
    return {"model_type": "llama", "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
            "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            **rope_fields(c.rope_parameters), **special_tokens(target),
            "torch_dtype": dtype_name(tensors)}


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------
def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def write_export(out_dir, head, target, fmt: str, config: dict, tensors: dict[str, Tensor], *,
                 usage: str, weights_file: str = "model.safetensors",
                 notes: list[str] | tuple[str, ...] = (), tokenizer: bool = False) -> Path:
    """Write one engine-format folder (see the module docstring); returns it.

    `usage` is a shell snippet using the placeholders <draft> and <verifier>; `notes` are
    sentences for the model card (engine caveats); `tokenizer` adds the target's tokenizer."""
    from .base import save_weights

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Tied stages may share storage; safetensors refuses aliases, so every tensor gets its own copy.
    plain = {k: v.detach().to("cpu").clone().contiguous() for k, v in tensors.items()}
    save_weights(plain, out / weights_file, metadata={"format": "pt"})
    write_json(out / "config.json", config)
    if tokenizer:
        write_tokenizer(out, target)
    verifier = verifier_ref(target, head.target_identity)
    original = getattr(target, "quantised_from", None)
    if original and original[0] == verifier:  # the engine's verifier is not the very weights trained on
        notes = [*notes, f"Trained against specdec's embedded `{target.name}` ({original[1]}, dequantised); "
                         f"an engine loading `{verifier}` verifies with its full-precision weights, where "
                         "acceptance may differ a little from the table below."]
    write_json(out / PROVENANCE_FILE, {
        "format": EXPORT_FORMAT, "engine_format": fmt, "head_type": head.head_type(),
        "head_config": head.config_dict(), "target": head.target_identity,
        "verifier": verifier, "weights_file": weights_file,
        "dtype": dtype_name(plain), "usage": usage, "notes": list(notes)})
    write_card(out)
    return out


def write_tokenizer(out: Path, target) -> None:
    """The target's tokenizer as tokenizer.json plus a tokenizer_config.json naming
    PreTrainedTokenizerFast with the chat template inline: the one layout transformers 4 and 5
    both load. (transformers 5's save_pretrained names its own TokenizersBackend class, which the
    transformers 4 inside TGI cannot import, and moves the template to chat_template.jinja, which
    TGI's router never reads: its chat endpoint then has no template.)"""
    tok = getattr(target, "tokenizer", None)
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise ExportError("this format carries the target's tokenizer, but the target has no fast "
                          "(tokenizer.json) tokenizer to write")
    backend.save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if getattr(tok, name, None) is not None:
            cfg[name] = str(getattr(tok, name))
    if getattr(tok, "chat_template", None):
        cfg["chat_template"] = tok.chat_template
    write_json(out / "tokenizer_config.json", cfg)


def write_card(folder, location: str | None = None) -> Path:
    path = Path(folder) / CARD_FILE
    path.write_text(render_model_card(folder, location))
    return path


# ----------------------------------------------------------------------------------------------
# The model card
# ----------------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_recipe(folder: Path) -> dict | None:
    path = folder / RECIPE_FILE
    if not path.exists():
        return None
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return None
    return data if isinstance(data, dict) else None


def looks_like_hub_id(name: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name or "")) and not Path(name).exists()


def render_model_card(folder, location: str | None = None) -> str:
    """README.md for an export folder, from its specdec.json, eval.json and recipe.resolved.yaml.
    `location` is where users find the draft (the final folder, or the hub repo when pushing);
    default: `folder` itself."""
    folder = Path(folder)
    prov = _read_json(folder / PROVENANCE_FILE) or {}
    head_type = prov.get("head_type", "draft")
    title = TITLES.get(head_type, head_type)
    target = prov.get("target") or {}
    verifier = prov.get("verifier") or target.get("name") or "?"
    fmt = prov.get("engine_format", "?")
    tags = ["speculative-decoding", "specdec", head_type, fmt]
    lines = ["---", "tags:", *[f"- {t}" for t in tags]]
    if looks_like_hub_id(verifier):
        lines.append(f"base_model: {verifier}")
    lines += ["---", "", f"# {title} draft head for `{target.get('name', verifier)}`", "",
              f"Speculative-decoding draft head ({title}) trained with specdec, written in the "
              f"**{fmt}** format. It proposes tokens and the target verifies them, so the generated "
              "text is exactly the target's, only faster.", "", "| | |", "|---|---|",
              f"| head type | `{head_type}` |", f"| format | `{fmt}` |"]
    if target:
        shape = ", ".join(f"{k} {target[k]}" for k in ("model_type", "hidden_size",
                          "num_hidden_layers", "vocab_size") if target.get(k) is not None)
        lines.append(f"| target | `{target.get('name')}` ({shape}; weights fingerprint "
                     f"`{target.get('fingerprint')}`) |")
    lines.append(f"| verifier reference | `{verifier}` |")
    if prov.get("dtype"):
        lines.append(f"| weights dtype | {prov['dtype']} |")
    files = sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    lines += [f"| files | {', '.join(f'`{f}`' for f in files if f != CARD_FILE)} |", ""]
    if prov.get("usage"):
        draft = str(location or folder.resolve())
        lines += ["## Use it", "", "```bash",
                  prov["usage"].replace(DRAFT, draft).replace(VERIFIER, verifier), "```", ""]
    lines += [f"- {n}" for n in prov.get("notes", [])]
    if prov.get("notes"):
        lines.append("")
    lines += _training_section(_read_recipe(folder), prov.get("head_config") or {})
    lines += _acceptance_section(_read_json(folder / EVAL_FILE))
    return "\n".join(lines).rstrip() + "\n"


def _training_section(recipe: dict | None, head_config: dict) -> list[str]:
    lines = ["## Training", ""]
    if recipe is None:
        lines.append("No recipe.resolved.yaml in this export: the training recipe is not recorded.")
    else:
        data = recipe.get("data") or {}
        regen = data.get("regenerate") or {}
        lines.append(f"- data: {', '.join(map(str, data.get('files') or [])) or '?'} "
                     f"(max_length {data.get('max_length')}, limit {data.get('limit')}, "
                     f"{'self-distilled replies' if regen.get('enabled') else 'original replies'})")
        optim = recipe.get("optim") or {}
        lines.append("- optimiser: " + ", ".join(
            f"{k} {optim[k]}" for k in ("lr", "epochs", "max_steps", "micro_batch_size",
                                        "grad_accum", "schedule") if k in optim))
        lines.append(f"- target: `{(recipe.get('target') or {}).get('name')}` in "
                     f"{(recipe.get('target') or {}).get('dtype')}; the full recipe is "
                     f"`{RECIPE_FILE}`")
    fields = {k: v for k, v in head_config.items() if k not in ("format", "target", "head_type")}
    if fields:
        lines.append("- head: " + ", ".join(f"{k}={v}" for k, v in fields.items()))
    return lines + [""]


def _acceptance_section(ev: dict | None) -> list[str]:
    lines = ["## Measured acceptance", ""]
    if not ev or not ev.get("acceptance"):
        return lines + ["No eval.json in this export: acceptance was not measured.", ""]
    lines += [f"Held-out set ({ev.get('num_sequences', '?')} sequences, step {ev.get('step', '?')}),"
              " teacher-forced greedy chains: P(accepted length >= k) and the acceptance at depth k"
              " given depths 1..k-1 accepted.", "",
              "| depth k | P(len >= k) | acceptance a_k | correct / count |", "|---|---|---|---|"]
    for k, (reach, acc) in enumerate(zip(ev.get("reach", []), ev["acceptance"]), start=1):
        correct, count = (ev.get("correct") or [None] * k)[k - 1], (ev.get("count") or [None] * k)[k - 1]
        lines.append(f"| {k} | {reach:.3f} | {acc:.3f} | {correct} / {count} |")
    tau = (f"Expected tokens per step of a greedy chain of {ev.get('depth', len(ev['acceptance']))}"
           f" drafts: **tau = {ev.get('tau', float('nan')):.3f}**")
    if ev.get("ece") is not None:
        tau += f" (calibration of the draft's confidence: ECE {ev['ece']:.4f})"
    return lines + ["", tau + ".", ""]

