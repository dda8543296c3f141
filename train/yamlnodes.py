"""YAML node trees -> typed Python values, with errors that name the dotted key and its line.

The recipe loader composes YAML (``yaml.compose``) instead of loading it, so every value is
still a node that remembers where it came from (``node.start_mark``: file name and line).
``convert(node, type, "optim.lr")`` checks a node against a type annotation (int, float, bool,
str, Literal, X | None, list[X], tuple[X, Y], dict[str, X], nested dataclasses) and raises
``RecipeError("recipe.yaml:12: optim.lr: expected float, got 'fast'")``. Command-line
overrides are spliced into the same tree, their marks naming the override instead of a line.
"""
from __future__ import annotations

import dataclasses
import difflib
import io
import types
import typing
from typing import Any, Literal

import yaml


class RecipeError(ValueError):
    """A recipe key is unknown, mistyped or out of range; the message names key and line."""


def compose(text: str, name: str):
    stream = io.StringIO(text)
    stream.name = name  # the YAML reader puts this name into every mark
    try:
        return yaml.compose(stream, Loader=yaml.SafeLoader)
    except yaml.YAMLError as err:
        raise RecipeError(f"{name}: not valid YAML: {err}") from err


def where(node) -> str:
    mark = node.start_mark
    if mark.name.startswith("override "):
        return mark.name
    return f"{mark.name}:{mark.line + 1}"


def apply_override(root: yaml.MappingNode, item: str) -> None:
    """Splice ``a.b.c=value`` into the node tree; the value is parsed as YAML."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise RecipeError(f"override {item!r}: expected dotted.key=value")
    parts = key.strip().split(".")
    value = compose(raw if raw.strip() else "''", f"override {item!r}")
    if value is None:  # `a.b=null`
        value = yaml.ScalarNode("tag:yaml.org,2002:null", "null", *_marks(f"override {item!r}"))
    node = root
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        for k, v in node.value:
            if k.value == part:
                if last:
                    node.value[node.value.index((k, v))] = (k, value)
                    return
                if not isinstance(v, yaml.MappingNode):  # e.g. `data: ~` in the file
                    v2 = yaml.MappingNode("tag:yaml.org,2002:map", [], *_marks(f"override {item!r}"))
                    node.value[node.value.index((k, v))] = (k, v2)
                    v = v2
                node = v
                break
        else:
            k = yaml.ScalarNode("tag:yaml.org,2002:str", part, *_marks(f"override {item!r}"))
            v = value if last else yaml.MappingNode("tag:yaml.org,2002:map", [], *_marks(f"override {item!r}"))
            node.value.append((k, v))
            node = v


def _marks(name: str):
    mark = yaml.Mark(name, 0, 0, 0, None, None)
    return mark, mark


def check_keys(node, allowed, prefix: str) -> dict:
    """Map key -> value node; an unknown or repeated key is an error naming it and its line."""
    if not isinstance(node, yaml.MappingNode):
        raise RecipeError(f"{where(node)}: {prefix or 'recipe'}: expected a mapping")
    seen = {}
    for k, v in node.value:
        dotted = f"{prefix}.{k.value}" if prefix else k.value
        if k.value not in allowed:
            hint = difflib.get_close_matches(str(k.value), list(allowed), n=1)
            hint = f" (did you mean {hint[0]!r}?)" if hint else f" (known: {', '.join(allowed)})"
            raise RecipeError(f"{where(k)}: {dotted}: unknown key{hint}")
        if k.value in seen:
            raise RecipeError(f"{where(k)}: {dotted}: key given twice")
        seen[k.value] = v
    return seen


def convert_fields(seen: dict, cls, prefix: str) -> dict:
    hints = type_hints(cls)
    return {k: convert(v, hints.get(k, Any), f"{prefix}.{k}") for k, v in seen.items()}


def type_hints(obj) -> dict:
    try:
        return typing.get_type_hints(obj)
    except Exception:  # noqa: BLE001 - unresolvable annotations: accept any value
        return {}


_CONSTRUCTOR = yaml.constructor.SafeConstructor()


def _scalar(node):
    return _CONSTRUCTOR.construct_object(node, deep=True)


def convert(node, tp, dotted: str):
    """Turn a YAML node into a value of type ``tp``, or raise RecipeError naming key + line."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    is_null = isinstance(node, yaml.ScalarNode) and node.tag.endswith(":null")
    if tp is Any or tp is object:
        return _CONSTRUCTOR.construct_object(node, deep=True)
    if origin in (typing.Union, types.UnionType):
        if is_null and type(None) in args:
            return None
        errors = []
        # try int before float so `warmup: 10` stays a step count
        for option in sorted((a for a in args if a is not type(None)), key=lambda a: a is float):
            try:
                return convert(node, option, dotted)
            except RecipeError as err:
                errors.append(str(err))
        raise RecipeError(errors[0] if len(errors) == 1 else
                          f"{where(node)}: {dotted}: expected {_type_name(tp)}")
    if is_null:
        raise RecipeError(f"{where(node)}: {dotted}: must not be null (expected {_type_name(tp)})")
    if dataclasses.is_dataclass(tp):
        names = [f.name for f in dataclasses.fields(tp) if f.init]
        return tp(**convert_fields(check_keys(node, names, dotted), tp, dotted))
    if origin is Literal:
        value = _scalar(node) if isinstance(node, yaml.ScalarNode) else None
        if value not in args:
            raise RecipeError(f"{where(node)}: {dotted}: expected one of {', '.join(map(repr, args))}, "
                              f"got {node.value if isinstance(node, yaml.ScalarNode) else node.tag!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(node, yaml.SequenceNode):
            raise RecipeError(f"{where(node)}: {dotted}: expected a list ({_type_name(tp)})")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(node.value) != len(args):
                raise RecipeError(f"{where(node)}: {dotted}: expected {len(args)} items, got {len(node.value)}")
            return tuple(convert(n, a, f"{dotted}[{i}]") for i, (n, a) in enumerate(zip(node.value, args)))
        item = args[0] if args else Any
        items = [convert(n, item, f"{dotted}[{i}]") for i, n in enumerate(node.value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(node, yaml.MappingNode):
            raise RecipeError(f"{where(node)}: {dotted}: expected a mapping")
        value_tp = args[1] if len(args) == 2 else Any
        return {str(k.value): convert(v, value_tp, f"{dotted}.{k.value}") for k, v in node.value}
    if not isinstance(node, yaml.ScalarNode):
        raise RecipeError(f"{where(node)}: {dotted}: expected {_type_name(tp)}, got a "
                          f"{'list' if isinstance(node, yaml.SequenceNode) else 'mapping'}")
    value = _scalar(node)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and node.style is None:  # YAML 1.1 reads `1e-4` as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str) or (node.style is None and not isinstance(value, bool)):
            return node.value if not isinstance(value, str) else value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise RecipeError(f"{where(node)}: {dotted}: expected {_type_name(tp)}, got {node.value!r}")


def _type_name(tp) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")
