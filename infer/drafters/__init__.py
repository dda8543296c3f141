"""Drafter registry: method name -> a Drafter (or None for plain decoding).

* ``plain``: no drafter; the engine decodes one token per step.
* head methods: the trained head folder is loaded with ``specdec.heads.load_head`` and asked for
  its drafter (``head.new_drafter(target, **opts)``); the method name must match the head type.
* training-free methods: found by module name. ``infer/drafters/<name>.py`` is the method
  ``<name>``; it defines ``make_drafter(target, **opts) -> Drafter`` (or a ``DRAFTER`` class
  built as ``DRAFTER(target, **opts)``). Adding one needs no edit here.
"""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

def head_methods() -> dict[str, str]:
    """Method name -> head type, from the head registry (a head's ``METHOD`` or its key)."""
    from specdec.heads import get_head_class, head_types

    return {get_head_class(t).method_name(): t for t in head_types()}


def method_for_head(folder) -> str | None:
    """The method that drafts with the head in ``folder`` (its config's head type), or None
    when the folder is no head folder: the caller then says what is wrong."""
    from specdec.heads.base import read_head_config

    try:
        head_type = read_head_config(folder)["head_type"]
    except (OSError, ValueError):
        return None
    return _method_of_head_type().get(head_type)


def default_method(head) -> str:
    """The method a run without --method drafts with: the head's own (a loaded head's, or a
    folder's config head type), plain without a head. A folder naming no head type gets eagle3,
    whose loader then says what is wrong with it."""
    if head is None:
        return "plain"
    if hasattr(head, "method_name"):
        return head.method_name()
    return method_for_head(head) or "eagle3"


def default_target(target: str | None, head) -> str:
    """The target a command runs: the one given, else the head folder's own (``target_for_head``),
    else the embedded default."""
    from specdec.infer.target import DEFAULT_TARGET

    return target or (head and target_for_head(head)) or DEFAULT_TARGET


def target_for_head(folder) -> str | None:
    """The target a head folder was trained on, by the name its recipe gave (final/recipe.yaml),
    where that name loads here: an embedded name, a hub id or an existing folder / .gguf; else None
    (a folder that moved or lives on another machine: the caller's default applies)."""
    import yaml

    from specdec.infer.target import EMBEDDED, TINY_TARGET, _looks_like_hub_id

    try:
        name = str(yaml.safe_load((Path(folder) / "recipe.yaml").read_text())["target"]["name"])
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
    if name in EMBEDDED or name == TINY_TARGET or Path(name).expanduser().exists() or _looks_like_hub_id(name):
        return name
    return None


def _method_of_head_type() -> dict[str, str]:
    return {t: m for m, t in head_methods().items()}


def unknown_method_message(method: str, available) -> str:
    """'unknown method ...', pointing from a head type (mlp_speculator) to its method (mlp)."""
    own = _method_of_head_type().get(method, method)
    hint = f" (a {method!r} head drafts as method {own!r})" if own != method else ""
    return f"unknown method {method!r}{hint}; available: {', '.join(available)}"


class DrafterError(ValueError):
    """Unknown method, missing/mismatched head, or a drafter module without a factory."""


def training_free_methods() -> list[str]:
    """Methods implemented as modules in this package (pld, lookahead, rest, hybrid, ...):
    every public module that defines a factory (helper modules without one are not methods)."""
    here = Path(__file__).parent
    names = sorted(m.name for m in pkgutil.iter_modules([str(here)]) if not m.name.startswith("_"))
    return [n for n in names if _factory(n) is not None]


def _factory(name: str):
    module = importlib.import_module(f"{__name__}.{name}")
    return getattr(module, "make_drafter", None) or getattr(module, "DRAFTER", None)


def available_methods() -> list[str]:
    return ["plain", *head_methods(), *training_free_methods()]


def make_drafter(method: str, target, head=None, **opts):
    """Build the drafter for ``method`` on ``target``; ``head`` is a head folder (or an already
    loaded head object) for head methods. Returns None for ``plain``."""
    if method == "plain":
        if head is not None:
            raise DrafterError("method 'plain' takes no head")
        if opts:
            raise DrafterError(f"method 'plain' drafts nothing, so it takes no drafter options: {sorted(opts)}")
        return None
    if method in head_methods():
        return _with_opts_checked(method, lambda: _head_drafter(method, target, head, **opts))
    if method in training_free_methods():
        factory = _factory(method)
        if head is not None:  # only a method that merges in a head (hybrid) accepts one
            import inspect

            if "head" not in inspect.signature(factory).parameters:
                raise DrafterError(f"method {method!r} is training-free and takes no head")
            opts["head"] = head
        return _with_opts_checked(method, lambda: factory(target, **opts))
    raise DrafterError(unknown_method_message(method, available_methods()))


def _with_opts_checked(method: str, build):
    """build(), with an option the drafter does not take said as a DrafterError."""
    try:
        return build()
    except TypeError as err:
        if "unexpected keyword argument" not in str(err):
            raise
        raise DrafterError(f"method {method!r} does not take that option: {err}") from None


def load_draft_head(folder, target):
    """Load a trained head folder for drafting on ``target``: checked against it, in the target's
    dtype (heads are saved in fp32; an fp32 head beside a bf16 target measured 2x slower
    drafting), bf16 projections prepacked (a head loaded here only drafts) but for the
    vocabulary-sized ones: drafters pack those themselves, cut to the frequent tokens
    (heads.common.DraftLogits), and the frozen copies of the target's LM head do not draft;
    its Llama-style blocks in their fused decoding form (``infer/models/head_fusion.py``)."""
    from specdec.heads import load_head
    from specdec.infer.models.head_fusion import fuse_for_decoding
    from specdec.infer.models.linear import pack_linears

    folder = Path(folder)
    if not folder.is_dir():
        raise DrafterError(f"head folder {folder} does not exist")
    head = load_head(folder, target)
    head.to(next(target.model.parameters()).dtype)
    pack_linears(head, skip_out_features=getattr(head.config, "vocab_size", None))
    fuse_for_decoding(head)
    return head


def _head_drafter(method: str, target, head, **opts):
    if head is None:
        raise DrafterError(f"method {method!r} needs a trained head: pass its folder "
                           f"(specdec-generate/serve: --head PATH; specdec-bench: {method}=PATH)")
    if isinstance(head, (str, Path)):
        head = load_draft_head(head, target)
    head_type = getattr(head, "head_type", None)  # DraftHead.head_type() = its registry key
    head_type = head_type() if callable(head_type) else head_type
    expected = head_methods()[method]
    if head_type is not None and head_type != expected:
        raise DrafterError(f"method {method!r} expects a {expected!r} head, but the head is {head_type!r}")
    return head.new_drafter(target, **opts)
