"""Conversation data for draft-head training.

Reads ShareGPT, OpenAI `messages`, Alpaca and GSM8K records from local JSON or JSONL files
(format detected per record), renders them with the target's chat template, masks the loss
to assistant tokens, truncates or packs to a maximum length, splits train/eval and caches
the tokenised result under a key that changes with any input that matters.

Loss-mask convention (docs/ARCHITECTURE.md): 1 on every assistant-content token and on the
end-of-turn token that closes an assistant reply; 0 on system/user/template tokens.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

FORMATS = ("auto", "openai", "sharegpt", "alpaca", "gsm8k", "spec_bench")
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "system": "system"}
# Tokens that close a turn in common chat templates (ChatML, Llama-3, Phi-3, Gemma).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
ASSETS = Path(__file__).resolve().parent / "assets"
BUNDLED = {  # name -> file in train/assets/, licence beside it as LICENSE.<stem>
    "gsm8k": "gsm8k_train.jsonl",          # MIT
    "guanaco": "guanaco_1k.jsonl",         # Apache-2.0
    "sharegpt_dummy": "sharegpt_dummy.json",  # Apache-2.0 (FastChat)
    "tasks": "task_mix.jsonl",             # Apache-2.0 + MIT: built from the two above (scripts/make_task_prompts.py)
}
CACHE_VERSION = 3  # bump when tokenisation or the cache layout changes (3: no empty eval split saved)


class DataError(ValueError):
    """Bad input data; the message starts with `file:line:` where it can."""


def bundled_prompts(name: str) -> Path:
    """Path of a permissively licensed prompt set shipped in the package (see BUNDLED)."""
    if name not in BUNDLED:
        raise DataError(f"unknown bundled prompt set {name!r}; choose from {', '.join(BUNDLED)}")
    return ASSETS / BUNDLED[name]


# ----------------------------------------------------------------------------- reading

@dataclass
class ErrorPolicy:
    """`on_error="fail"` raises at the first bad record; "skip" counts and reports them."""

    on_error: str = "skip"
    skipped: int = 0
    examples: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.on_error not in ("skip", "fail"):
            raise ValueError(f"on_error must be 'skip' or 'fail', not {self.on_error!r}")

    def bad(self, where: str, why: str) -> None:
        if self.on_error == "fail":
            raise DataError(f"{where}: {why}")
        self.skipped += 1
        if len(self.examples) < 5:
            self.examples.append(f"{where}: {why}")

    def report(self, what: str = "records") -> None:
        if self.skipped:
            lines = "\n  ".join(self.examples)
            print(f"specdec-data: skipped {self.skipped} malformed {what} (--on-error fail stops "
                  f"at the first one instead):\n  {lines}", file=sys.stderr)


def _read_records(path: Path, policy: ErrorPolicy) -> Iterator[tuple[object, str, int]]:
    """Yield (record, "file:line", index) for each record of a JSON list/object or JSONL file."""
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is no record
    start = len(text) - len(text.lstrip())
    jsonl = path.suffix == ".jsonl"
    if not jsonl and text[start:start + 1] == "{":
        try:
            yield json.loads(text), f"{path}:{text.count(chr(10), 0, start) + 1}", 0
            return
        except json.JSONDecodeError as err:
            if err.msg != "Extra data":  # several objects, one a line: JSONL named .json
                raise DataError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from err
            jsonl = True
    if jsonl:
        index = 0
        for lineno, line in jsonl_lines(text):
            try:
                yield json.loads(line), f"{path}:{lineno}", index
            except json.JSONDecodeError as err:
                policy.bad(f"{path}:{lineno}", f"invalid JSON ({err.msg})")
            index += 1
    elif text[start:start + 1] == "[":
        yield from _json_list(text, start, path)
    else:
        raise DataError(f"{path}:1: expected a JSON list, a JSON object or JSON lines")


def jsonl_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of each non-blank JSONL record. Only \n ends a record: splitlines()
    also cuts at U+2028, U+0085 ... that json.dumps(ensure_ascii=False) leaves raw inside strings."""
    for lineno, line in enumerate(text.split("\n"), 1):
        if line.strip():
            yield lineno, line


def _json_list(text: str, pos: int, path: Path) -> Iterator[tuple[object, str, int]]:
    """Decode a JSON list element by element so each record's line number is known."""
    decoder = json.JSONDecoder()
    ws = re.compile(r"\s*")
    line, counted = 1, 0

    def line_at(p: int) -> int:
        nonlocal line, counted
        line += text.count("\n", counted, p)
        counted = p
        return line

    pos = ws.match(text, pos + 1).end()
    index = 0
    while pos < len(text) and text[pos] != "]":
        try:
            record, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            # Past a syntax error the list's structure is unknown: nothing after it can be read.
            raise DataError(f"{path}:{err.lineno}: record {index}: invalid JSON ({err.msg}); a "
                            "broken JSON list cannot be skipped past, fix it or use JSONL") from err
        yield record, f"{path}:{line_at(pos)} (record {index})", index
        pos = ws.match(text, end).end()
        if text[pos:pos + 1] == ",":
            pos = ws.match(text, pos + 1).end()
        elif text[pos:pos + 1] != "]":
            raise DataError(f"{path}:{line_at(pos)}: expected ',' or ']' after record {index}")
        index += 1


def _text(value, what: str) -> str:
    if isinstance(value, str):
        return value
    # OpenAI content parts: [{"type": "text", "text": ...}, ...]
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text", "")) for p in value)
    raise ValueError(f"{what} must be a string, got {type(value).__name__}")


def _openai(record: dict) -> list[dict]:
    msgs = record["messages"]
    if not isinstance(msgs, list):
        raise ValueError("'messages' must be a list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}]: role must be one of {ROLES}")
        out.append({"role": m["role"], "content": _text(m.get("content"), f"messages[{i}].content")})
    return out


def _sharegpt(record: dict) -> list[dict]:
    turns = record["conversations"]
    if not isinstance(turns, list):
        raise ValueError("'conversations' must be a list")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or t.get("from") not in SHAREGPT_ROLES:
            raise ValueError(f"conversations[{i}]: 'from' must be one of human/gpt/system")
        out.append({"role": SHAREGPT_ROLES[t["from"]],
                    "content": _text(t.get("value"), f"conversations[{i}].value")})
    return out


def _alpaca(record: dict) -> list[dict]:
    prompt = _text(record["instruction"], "instruction")
    extra = _text(record.get("input") or "", "input")
    msgs = [{"role": "user", "content": f"{prompt}\n\n{extra}" if extra.strip() else prompt}]
    if record.get("output") is not None:
        msgs.append({"role": "assistant", "content": _text(record["output"], "output")})
    return msgs


def _gsm8k(record: dict) -> list[dict]:
    msgs = [{"role": "user", "content": _text(record["question"], "question")}]
    if record.get("answer") is not None:
        # "48/2 = <<48/2=24>>24" -> "48/2 = 24": the <<...>> calculator notes are annotation.
        answer = re.sub(r"<<[^<>]*>>", "", _text(record["answer"], "answer"))
        msgs.append({"role": "assistant", "content": answer})
    return msgs


def _spec_bench(record: dict) -> list[dict]:
    # Spec-Bench / MT-bench questions: {"turns": [str, ...]}, user turns only. Later turns ask
    # about the answer to the first, so a standalone prompt is the first turn.
    turns = record["turns"]
    if not isinstance(turns, list) or not turns:
        raise ValueError("'turns' must be a non-empty list of strings")
    return [{"role": "user", "content": _text(turns[0], "turns[0]")}]


PARSERS = {"openai": ("messages", _openai), "sharegpt": ("conversations", _sharegpt),
           "alpaca": ("instruction", _alpaca), "gsm8k": ("question", _gsm8k),
           "spec_bench": ("turns", _spec_bench)}


def to_messages(record, fmt: str = "auto") -> list[dict]:
    """One record -> [{"role", "content"}, ...]; ValueError says what is wrong with it."""
    if not isinstance(record, dict):
        raise ValueError(f"a record must be a JSON object, got {type(record).__name__}")
    if fmt == "auto":
        fmt = next((name for name, (key, _) in PARSERS.items() if key in record), None)
        if fmt is None:
            raise ValueError(f"unrecognised record with keys {sorted(record)[:6]}: expected "
                             "'messages' (OpenAI), 'conversations' (ShareGPT), 'instruction' "
                             "(Alpaca), 'question' (GSM8K) or 'turns' (Spec-Bench)")
    key, parse = PARSERS[fmt]
    if key not in record:
        raise ValueError(f"not a {fmt} record: no {key!r} key")
    msgs = parse(record)
    if not msgs:
        raise ValueError("empty conversation")
    return msgs


@dataclass
class Conversation:
    id: str          # "<file name>/<record id or index>", stable across runs
    messages: list[dict]
    where: str       # "file:line" for error messages


def iter_conversations(paths, fmt: str = "auto", on_error: str = "skip",
                       policy: ErrorPolicy | None = None) -> Iterator[Conversation]:
    """Every well-formed conversation of the files, in order; malformed ones per `on_error`."""
    if fmt not in FORMATS:
        raise DataError(f"unknown data format {fmt!r}; choose from {', '.join(FORMATS)}")
    own_policy = policy is None
    policy = policy or ErrorPolicy(on_error)
    seen: set[str] = set()
    for path in [Path(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]:
        for record, where, index in _read_records(path, policy):
            try:
                messages = to_messages(record, fmt)
            except ValueError as err:
                policy.bad(where, str(err))
                continue
            rid = record.get("id", record.get("question_id"))
            cid = f"{path.name}/{rid if rid is not None else index}"
            if cid in seen:  # an id repeated inside the file: keep both, disambiguated
                cid = f"{cid}#{index}"
            seen.add(cid)
            yield Conversation(cid, messages, where)
    if own_policy:
        policy.report()


def _messages_features():
    from datasets import Features, List, Value

    return Features({"messages": List({"role": Value("string"), "content": Value("string")})})


def load_conversations(paths, fmt: str = "auto", on_error: str = "skip"):
    """Read conversation files into a `datasets.Dataset` with one column `messages`."""
    from datasets import Dataset

    rows = [{"messages": c.messages} for c in iter_conversations(paths, fmt, on_error)]
    if not rows:  # (datasets cannot build an empty dataset from a list)
        names = ", ".join(map(str, [paths] if isinstance(paths, (str, os.PathLike)) else paths))
        raise DataError(f"no conversation in {names} (empty, or every record skipped)")
    return Dataset.from_list(rows, features=_messages_features())


# ----------------------------------------------------------------------------- tokenising

def end_of_turn_ids(tokenizer) -> set[int]:
    """Token ids that can close an assistant turn for this tokenizer."""
    ids = set()
    for token in END_OF_TURN_TOKENS:  # (get_vocab() would copy the whole vocabulary)
        tid = tokenizer.convert_tokens_to_ids(token)
        known = isinstance(tid, int) and tid != tokenizer.unk_token_id
        if known and tokenizer.convert_ids_to_tokens(tid) == token:
            ids.add(tid)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def _assistant_spans(tokenizer, messages, text: str) -> list[tuple[int, int]]:
    """Character spans of the assistant contents inside the rendered chat `text`."""
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        content = m["content"]
        if m["role"] == "assistant" and i > 0:
            # Start after the assistant header so content equal to header text ("assistant")
            # cannot match inside it.
            head = _render(tokenizer, messages[:i], add_generation_prompt=True)
            if text.startswith(head):
                cursor = max(cursor, len(head))
        start = text.find(content, cursor)
        if start < 0 and content.strip() != content:  # templates that strip() contents
            content = content.strip()
            start = text.find(content, cursor)
        if start < 0:
            if m["role"] == "assistant":
                raise DataError(f"the chat template does not reproduce assistant message {i} "
                                "verbatim, so its tokens cannot be located for the loss mask")
            continue
        if m["role"] == "assistant":
            spans.append((start, start + len(content)))
        cursor = start + len(content)
    return spans


def encode_conversation(messages: list[dict], tokenizer,
                        end_ids: set[int] | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of one conversation rendered with the tokenizer's chat template.

    end_ids: the end-of-turn ids (default `end_of_turn_ids(tokenizer)`; pass them when
    encoding many conversations).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the target's tokenizer has no chat template")
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("loss masking needs a fast tokenizer (character offsets)")
    text = _render(tokenizer, messages)
    spans = _assistant_spans(tokenizer, messages, text)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    ends = end_of_turn_ids(tokenizer) if end_ids is None else end_ids
    starts = [a for a, _ in offsets]  # non-decreasing
    for s, e in spans:
        j = max(bisect.bisect_right(starts, s) - 1, 0)
        while j < len(ids) and starts[j] < e:
            if offsets[j][1] > s:  # token overlaps the assistant content
                mask[j] = 1
            j += 1
        # The end-of-turn token after the content (whitespace tokens may sit in between).
        for j in range(j, min(j + 4, len(ids))):
            if ids[j] in ends:
                mask[j] = 1
                break
            if text[offsets[j][0]:offsets[j][1]].strip():
                break
    return ids, mask


def tokenize_conversations(ds, tokenizer, max_length: int, pack: bool = False):
    """Dataset of conversations -> Dataset with `input_ids` and `loss_mask` (list[int]).

    Sequences longer than `max_length` are truncated; ones with no assistant token left are
    dropped. `pack=True` concatenates whole sequences greedily into rows of at most
    `max_length` tokens (attention then spans the packed neighbours, as in usual SFT packing;
    no loss crosses a boundary since each sequence starts with template tokens, mask 0).
    """
    from datasets import Dataset, Features, List, Value

    if max_length < 2:
        raise DataError(f"max_length must be >= 2, got {max_length}")
    rows_ids, rows_mask = [], []
    row_ids, row_mask = [], []
    end_ids = end_of_turn_ids(tokenizer)
    dropped = 0
    for messages in ds["messages"]:
        ids, mask = encode_conversation(messages, tokenizer, end_ids)
        ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask[1:]):  # position t learns from mask[t+1]: nothing to learn here
            dropped += 1
            continue
        if not pack:
            rows_ids.append(ids), rows_mask.append(mask)
            continue
        if row_ids and len(row_ids) + len(ids) > max_length:
            rows_ids.append(row_ids), rows_mask.append(row_mask)
            row_ids, row_mask = [], []
        row_ids, row_mask = row_ids + ids, row_mask + mask
    if row_ids:
        rows_ids.append(row_ids), rows_mask.append(row_mask)
    if dropped:
        print(f"specdec-data: left out {dropped} of {len(ds)} conversations with no assistant reply "
              f"within {max_length} tokens", file=sys.stderr)
    features = Features({"input_ids": List(Value("int32")), "loss_mask": List(Value("int8"))})
    return Dataset.from_dict({"input_ids": rows_ids, "loss_mask": rows_mask}, features=features)


# ----------------------------------------------------------------------------- prepare + cache

def tokenizer_fingerprint(tokenizer) -> str:
    """A digest that changes when the vocabulary, merges, specials or chat template change."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None
             else json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    return h.hexdigest()


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def prepare_dataset(paths, tokenizer, max_length: int = 2048, pack: bool = False,
                    fmt: str = "auto", on_error: str = "skip", eval_fraction: float = 0.05,
                    seed: int = 0, limit: int | None = None, cache: bool = True,
                    cache_root: str | os.PathLike | None = None):
    """Load, tokenise and split: DatasetDict(train=..., eval=...), cached by content key.

    The cache key covers each input file's bytes, the tokenizer (vocab + template), the
    format/error options, max_length, packing, the split and the limit, so changing any of
    them never reuses a stale result.
    """
    from datasets import DatasetDict, load_from_disk

    from specdec.infer.target import cache_dir

    paths = [Path(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
    for p in paths:
        if not p.is_file():
            raise DataError(f"{p}: no such data file")
    key_src = {"v": CACHE_VERSION, "files": [[str(p.resolve()), file_digest(p)] for p in paths],
               "fmt": fmt, "on_error": on_error, "max_length": max_length, "pack": pack,
               "eval_fraction": eval_fraction, "seed": seed, "limit": limit,
               "tokenizer": tokenizer_fingerprint(tokenizer)}
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:20]
    folder = Path(cache_root or cache_dir() / "data") / key
    if cache and (folder / "dataset_dict.json").exists():
        print(f"specdec-data: using cached tokenised data {folder}", file=sys.stderr)
        return _with_eval(load_from_disk(str(folder)))
    convs = load_conversations(paths, fmt, on_error)
    if limit is not None:
        convs = convs.select(range(min(limit, len(convs))))
    ds = tokenize_conversations(convs, tokenizer, max_length, pack)
    if len(ds) == 0:
        raise DataError(f"no usable conversation (with assistant tokens) in {', '.join(map(str, paths))}")
    n_eval = max(1, round(eval_fraction * len(ds))) if eval_fraction > 0 and len(ds) >= 2 else 0
    if n_eval:
        split = ds.train_test_split(test_size=n_eval, seed=seed)
        out = DatasetDict(train=split["train"], eval=split["test"])
    else:
        out = DatasetDict(train=ds, eval=ds.select([]))
    if cache:
        import datasets

        partial = folder.with_name(folder.name + f".partial{os.getpid()}")
        bars = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # a bar per split for a sub-second save is noise
        try:  # without an empty eval split: datasets cannot load one back (_with_eval restores it)
            DatasetDict({name: split for name, split in out.items() if len(split)}).save_to_disk(str(partial))
        finally:
            if bars:
                datasets.enable_progress_bars()
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(partial, folder)  # a killed run never leaves a half cache entry
        out = _with_eval(load_from_disk(str(folder)))
    return out


def _with_eval(splits):
    """A cached DatasetDict with its eval split back (saved without it when it was empty)."""
    if "eval" not in splits:
        splits["eval"] = splits["train"].select([])
    return splits

