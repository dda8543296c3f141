"""Training recipes: YAML -> typed dataclasses, strictly validated before any work starts.

A recipe has eight sections (all but ``head`` optional)::

    target:    {name, dtype}
    head:      {type, <fields of get_head_class(type).Config>}
    data:      {files, format, max_length, eval_fraction, limit, mode, capture_dir, seed,
                regenerate: {enabled, num_prompts, max_new_tokens, batch_size, ...}}
    loss:      {<loss weights: head Config fields or keyword arguments of head.loss()>}
    optim:     {lr, weight_decay, betas, eps, warmup, schedule, epochs, max_steps, max_minutes,
                micro_batch_size, grad_accum, clip, seed, freeze}
    output:    {dir, save_every, eval_every, eval_depth, keep_last, log_every}
    deepspeed: {zero_stage, precision, extra}
    wandb:     {project, mode, name, entity, tags}

The YAML is *composed* (not loaded) so every value keeps its line: an unknown or
mistyped key fails as ``recipe.yaml:12: optim.lrr: unknown key (did you mean 'lr'?)``.
``a.b=value`` overrides are spliced into the same node tree, so they are typed and
checked exactly like the file (their errors name the override instead of a line).
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .yamlnodes import (RecipeError, apply_override, check_keys, compose, convert, convert_fields,
                        type_hints, where)

SECTIONS = ("target", "head", "data", "loss", "optim", "output", "deepspeed", "wandb")


@dataclass
class TargetConfig:
    name: str = "smollm2-135m"  # embedded name, HF folder, .gguf file or hub id
    # dtype of the frozen target for feature capture / online features (auto: bfloat16 where
    # the device computes it natively, else float32)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"


@dataclass
class HeadConfig:
    type: str = ""  # a registry name (specdec.heads.head_types()) or "package.module:Class"
    fields: dict[str, Any] = field(default_factory=dict)  # the Config fields the recipe sets


@dataclass
class RegenerateConfig:
    """Self-distillation: let the target write the replies it will later be asked to draft."""

    enabled: bool = False
    num_prompts: int | None = None  # first N prompts of each data file (None: all of them)
    max_new_tokens: int = 256
    batch_size: int = 16
    temperature: float = 0.0  # 0 = greedy, the setting speculative decoding is benchmarked in
    keep_original: bool = True  # also train on the datasets' own replies (prefill only, cheap)
    dir: str | None = None  # cache (resumable); default <output.dir>/regenerated


@dataclass
class DataConfig:
    files: list[str] = field(default_factory=lambda: ["bundled:gsm8k"])  # paths or bundled:<name>
    pack: bool = False  # concatenate short sequences into rows of max_length
    format: str = "auto"  # auto | sharegpt | openai | alpaca | gsm8k | spec_bench
    max_length: int = 1024  # tokens per sequence (longer conversations are truncated)
    eval_fraction: float = 0.05  # held-out share of the sequences for eval
    limit: int | None = None  # original conversations: the first N of each file (None: all)
    mode: Literal["offline", "online"] = "offline"  # capture features once / target in the loop
    capture_dir: str | None = None  # offline features; default <output.dir>/features
    capture_batch_tokens: int = 8192  # tokens per target forward during capture
    seed: int = 0  # shuffling of conversations and the train/eval split
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)


@dataclass
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0  # applied to matrices only, never to norms and biases
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup: int | float = 0  # an int counts optimizer steps; a float < 1 is a share of them
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; overrides epochs when set
    max_minutes: float | None = None  # training time budget: fewer steps on a slower machine
    # (the step count is fixed once, early, from measured step times; the LR schedule fits it)
    micro_batch_size: int = 4  # sequences per process per forward
    grad_accum: int = 1
    clip: float = 1.0  # max gradient norm; 0 disables clipping
    seed: int = 0  # head initialisation, dropout, data order
    freeze: list[str] = field(default_factory=list)  # parameter names (or their prefixes, e.g.
    # layers.0.mlp) kept at their starting values: a head started from target weights keeps them


@dataclass
class OutputConfig:
    dir: str = "runs/default"
    save_every: int = 0  # checkpoint every N optimizer steps (0: only at the end)
    eval_every: int = 0  # eval every N optimizer steps (0: only at the end)
    eval_depth: int = 5  # acceptance reported at depth 1..eval_depth
    keep_last: int = 2  # checkpoints kept (older ones are deleted)
    log_every: int = 1  # optimizer steps between metric lines


@dataclass
class DeepSpeedConfig:
    zero_stage: int = 0  # 0-3
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 where the device has it natively
    extra: dict[str, Any] = field(default_factory=dict)  # deep-merged into the DeepSpeed config


@dataclass
class WandbConfig:
    project: str = "specdec"
    # auto: $WANDB_MODE if set, else online when logged in (API key / netrc), else offline
    mode: Literal["auto", "offline", "online", "disabled"] = "auto"
    name: str | None = None
    entity: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class Recipe:
    target: TargetConfig = field(default_factory=TargetConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: dict[str, Any] = field(default_factory=dict)
    optim: OptimConfig = field(default_factory=OptimConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    source: str | None = None  # the YAML file it came from (not a recipe key)

    def to_dict(self, head_fields: dict | None = None) -> dict:
        """Plain data in recipe layout (head fields flattened beside ``type``).

        ``head_fields``: the built head's complete Config, to record what was actually used.
        """
        out = {}
        for name in SECTIONS:
            value = getattr(self, name)
            if name == "head":
                out[name] = {"type": value.type, **_plain(head_fields or value.fields)}
            else:
                out[name] = _plain(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value)
        return out

    def dump(self, path: str | Path, head_fields: dict | None = None) -> Path:
        """Write the resolved recipe (every default filled in) as YAML."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(self.to_dict(head_fields), sort_keys=False))
        return path


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ----------------------------------------------------------------------------- loading

def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = (), head_resolver=None,
                check_files: bool = False) -> Recipe:
    """Parse, override and validate a recipe file. Raises RecipeError on any bad key;
    ``check_files``: also on a data file that does not exist here (the command line's check)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise RecipeError(f"cannot read recipe {path}: {err}") from err
    return parse_recipe(text, name=str(path), overrides=overrides, head_resolver=head_resolver,
                        check_files=check_files)


def parse_recipe(text: str, name: str = "<recipe>", overrides=(), head_resolver=None,
                 check_files: bool = False) -> Recipe:
    """Like load_recipe, from YAML text (``name`` is used in error messages)."""
    root = compose(text, name)
    if root is None:
        root = yaml.MappingNode("tag:yaml.org,2002:map", [])
    if not isinstance(root, yaml.MappingNode):
        raise RecipeError(f"{where(root)}: a recipe is a mapping of sections ({', '.join(SECTIONS)})")
    for item in overrides:
        apply_override(root, item)
    return _build_recipe(root, name, head_resolver or resolve_head_class, check_files)


def _build_recipe(root: yaml.MappingNode, name: str, head_resolver, check_files: bool = False) -> Recipe:
    seen = check_keys(root, SECTIONS, "")
    recipe = Recipe(source=name)
    for section in ("target", "data", "optim", "output", "deepspeed", "wandb"):
        if section in seen:
            setattr(recipe, section, convert(seen[section], type(getattr(recipe, section)), section))
    if "head" not in seen:
        raise RecipeError(f"{name}: missing section 'head' (with at least `type:`)")
    head_cls, recipe.head = _build_head(seen["head"], head_resolver)
    if "loss" in seen:
        recipe.loss = _build_loss(seen["loss"], head_cls, recipe.head.fields)
    _check_ranges(recipe, seen)
    if check_files and "data" in seen:
        _check_files(seen["data"])
    return recipe


def _check_files(data_node) -> None:
    """Every data.files entry names a bundled set or an existing file, said at its line: the
    run would otherwise load the target first and then fail without one."""
    from specdec.train.data import BUNDLED

    files = next((v for k, v in data_node.value if k.value == "files"), None)
    for i, item in enumerate(files.value if isinstance(files, yaml.SequenceNode) else []):
        name = str(item.value)
        if name.startswith("bundled:"):
            if name[len("bundled:"):] not in BUNDLED:
                raise RecipeError(f"{where(item)}: data.files[{i}]: unknown bundled set {name!r} "
                                  f"(bundled: {', '.join(BUNDLED)})")
        elif not Path(name).is_file():
            raise RecipeError(f"{where(item)}: data.files[{i}]: no such file {name!r} "
                              f"(relative paths start at {Path.cwd()})")


def _build_head(node, head_resolver):
    if not isinstance(node, yaml.MappingNode):
        raise RecipeError(f"{where(node)}: head: expected a mapping with `type:`")
    type_node = next((v for k, v in node.value if k.value == "type"), None)
    if type_node is None:
        raise RecipeError(f"{where(node)}: head.type: missing (one of the registered head types)")
    head_type = convert(type_node, str, "head.type")
    try:
        head_cls = head_resolver(head_type)
    except Exception as err:  # noqa: BLE001 - report any registry failure with the line
        raise RecipeError(f"{where(type_node)}: head.type: {err}") from err
    config_cls = getattr(head_cls, "Config", None)
    if not dataclasses.is_dataclass(config_cls):
        raise RecipeError(f"{where(type_node)}: head.type: {head_cls.__name__}.Config is not a dataclass")
    names = [f.name for f in dataclasses.fields(config_cls) if f.init]
    seen = check_keys(node, ["type", *names], "head")
    given = {k: v for k, v in seen.items() if k != "type"}
    # only the keys the recipe gives: the head derives the rest (hidden size, vocab, ...) from
    # the target in from_target, and a default here would override that
    fields = convert_fields(given, config_cls, "head")
    return head_cls, HeadConfig(type=head_type, fields=fields)


def _loss_kwargs(head_cls) -> tuple[list[str], bool]:
    """Keyword parameters of ``head_cls.loss`` (besides batch), and whether it takes **kwargs."""
    params = inspect.signature(head_cls.loss).parameters
    named = [n for n, p in params.items() if n not in ("self", "batch")
             and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return named, any(p.kind is p.VAR_KEYWORD for p in params.values())


def _build_loss(node, head_cls, head_fields: dict) -> dict:
    """``loss:`` keys weight the head's loss. A key may be a keyword parameter of
    ``head_cls.loss`` (passed at every call) or a field of the head's Config (loss weights
    such as ``step_decay`` usually live there; merged into the head's fields)."""
    if isinstance(node, yaml.ScalarNode) and node.tag.endswith(":null"):
        return {}
    named, open_kwargs = _loss_kwargs(head_cls)
    config_fields = [f.name for f in dataclasses.fields(head_cls.Config) if f.init]
    allowed = list(dict.fromkeys(named + config_fields))
    if open_kwargs and isinstance(node, yaml.MappingNode):
        allowed += [k.value for k, _ in node.value if k.value not in allowed]
    seen = check_keys(node, allowed, "loss")
    kw_hints, field_hints = type_hints(head_cls.loss), type_hints(head_cls.Config)
    out = {}
    for k, v in seen.items():
        if k in head_fields:
            raise RecipeError(f"{where(v)}: loss.{k}: also set as head.{k}; give it once")
        tp = kw_hints.get(k, Any) if k in named or k not in config_fields else field_hints.get(k, Any)
        out[k] = convert(v, tp, f"loss.{k}")
    return out


def split_loss(head_cls, loss: dict) -> tuple[dict, dict]:
    """(head Config fields, loss() keyword arguments) of a validated ``loss:`` section."""
    named, open_kwargs = _loss_kwargs(head_cls)
    config_fields = {f.name for f in dataclasses.fields(head_cls.Config)}
    fields = {k: v for k, v in loss.items() if k in config_fields and k not in named}
    return fields, {k: v for k, v in loss.items() if k not in fields}


def _check_ranges(recipe: Recipe, seen: dict) -> None:
    """Value checks that types cannot express, reported at the section's line."""
    def fail(section: str, key: str, why: str):
        node = seen.get(section)
        line = where(node) if node is not None else recipe.source
        if isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if k.value == key), node)
            line = where(node)
        raise RecipeError(f"{line}: {section}.{key}: {why}")

    o, d, out, ds = recipe.optim, recipe.data, recipe.output, recipe.deepspeed
    # an empty name would train into the current directory / load the default target
    if not out.dir.strip():
        fail("output", "dir", "must not be empty (a folder for checkpoints and final/)")
    if not recipe.target.name.strip():
        fail("target", "name", "must not be empty (smollm2-135m, a HF folder, a .gguf file or a hub id)")
    if not 0 <= ds.zero_stage <= 3:
        fail("deepspeed", "zero_stage", f"must be 0, 1, 2 or 3, got {ds.zero_stage}")
    for key in ("micro_batch_size", "grad_accum", "epochs"):
        if getattr(o, key) < 1:
            fail("optim", key, f"must be >= 1, got {getattr(o, key)}")
    if o.max_steps is not None and o.max_steps < 1:
        fail("optim", "max_steps", f"must be >= 1, got {o.max_steps}")
    if o.max_minutes is not None and not o.max_minutes > 0:
        fail("optim", "max_minutes", f"must be > 0 (or null: no time budget), got {o.max_minutes}")
    if o.lr <= 0:
        fail("optim", "lr", f"must be > 0, got {o.lr}")
    if isinstance(o.warmup, float) and not 0 <= o.warmup < 1 or o.warmup < 0:
        fail("optim", "warmup", f"an int (steps) >= 0 or a float share in [0, 1), got {o.warmup}")
    if not 0 <= d.eval_fraction < 1:
        fail("data", "eval_fraction", f"must be in [0, 1), got {d.eval_fraction}")
    if d.max_length < 2:
        fail("data", "max_length", f"must be >= 2, got {d.max_length}")
    if not d.files:
        fail("data", "files", "at least one file or bundled:<name>")
    for key in ("save_every", "eval_every", "keep_last"):
        if getattr(out, key) < 0:
            fail("output", key, f"must be >= 0, got {getattr(out, key)}")
    if out.eval_depth < 1 or out.log_every < 1:
        fail("output", "eval_depth" if out.eval_depth < 1 else "log_every", "must be >= 1")


def resolve_head_class(head_type: str):
    """A registered head type name, or ``package.module:Class`` for a head defined elsewhere."""
    if ":" in head_type:
        import importlib

        module, _, attr = head_type.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise RecipeError(f"cannot import head class {head_type!r}: {err}") from err
    from specdec.heads import get_head_class, head_types

    try:
        return get_head_class(head_type)
    except (KeyError, ValueError, ImportError) as err:
        raise RecipeError(f"unknown head type {head_type!r} (registered: {', '.join(head_types())})") from err


def recipe_help() -> str:
    """The sections and their keys with defaults, for ``specdec-train --help``."""
    import textwrap

    def keys(cls) -> str:
        out = []
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.type) or f.name == "regenerate":
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.append(f"{f.name}={default!r}" if default not in ("", None) else f.name)
        return ", ".join(out)

    def entry(name: str, text: str) -> list[str]:
        return textwrap.wrap(text, 96, initial_indent=f"  {name + ':':<17}", subsequent_indent=" " * 19)

    lines = []
    for name in SECTIONS:
        if name == "head":
            lines += entry(name, "type (a registered head type) + that head's Config fields")
        elif name == "loss":
            lines += entry(name, "loss weights: head Config fields (step_decay, loss_decay, ...) or "
                                 "keyword arguments of the head's loss()")
        else:
            lines += entry(name, keys(type(getattr(Recipe(), name))))
            if name == "data":
                lines += entry("data.regenerate", keys(RegenerateConfig))
    return "\n".join(lines)
