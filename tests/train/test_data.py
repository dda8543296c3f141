"""Conversation data: every input format, loss masks, truncation/packing, bad records, cache."""
from __future__ import annotations

import json

import pytest

from specdec.infer.tiny import tiny_tokenizer
from specdec.train.data import (BUNDLED, DataError, bundled_prompts, encode_conversation,
                                iter_conversations, load_conversations, prepare_dataset,
                                tokenize_conversations)

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4, of course."},
        {"role": "user", "content": "And the word?"},
        {"role": "assistant", "content": "assistant"}]  # equals the template's header text


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def masked_segments(ids, mask, tok) -> list[str]:
    """Decode each maximal run of mask=1 tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


# ----------------------------------------------------------------------------- formats

def test_each_format_and_per_record_detection(tmp_path):
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([{"id": "a", "conversations": [
        {"from": "system", "value": "S"}, {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello"}]}], indent=2))
    openai = write_jsonl(tmp_path / "openai.jsonl", [{"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Q"}]},
        {"role": "assistant", "content": "A"}]}])
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": "Do X", "input": "on Y", "output": "Done"},
                                  {"instruction": "Do Z", "input": "", "output": "Ok"}]))
    gsm8k = write_jsonl(tmp_path / "gsm8k.jsonl", [
        {"question": "2 apples + 3?", "answer": "2+3 = <<2+3=5>>5 apples.\n#### 5"}])
    # One JSONL mixing all four formats: detection is per record.
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [
        {"conversations": [{"from": "human", "value": "h"}, {"from": "gpt", "value": "g"}]},
        {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]},
        {"instruction": "i", "output": "o"},
        {"question": "q", "answer": "x <<1+1=2>>2"},
        {"question_id": 81, "category": "writing", "turns": ["t1", "about your answer: t2"]}])

    assert load_conversations(sharegpt)["messages"] == [[
        {"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}]]
    assert load_conversations([openai])["messages"][0] == [
        {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    assert load_conversations([alpaca])["messages"] == [
        [{"role": "user", "content": "Do X\n\non Y"}, {"role": "assistant", "content": "Done"}],
        [{"role": "user", "content": "Do Z"}, {"role": "assistant", "content": "Ok"}]]
    assert load_conversations([gsm8k])["messages"][0][1]["content"] == "2+3 = 5 apples.\n#### 5"
    mixed_ds = load_conversations([mixed])
    assert [m[0]["content"] for m in mixed_ds["messages"]] == ["h", "u", "i", "q", "t1"]
    assert mixed_ds["messages"][3][1]["content"] == "x 2"
    assert mixed_ds["messages"][4] == [{"role": "user", "content": "t1"}]  # Spec-Bench: the first turn
    assert [c.id for c in iter_conversations([mixed])][4] == "mixed.jsonl/81"
    # Several files at once, in order.
    assert len(load_conversations([sharegpt, openai, alpaca, gsm8k, mixed])) == 1 + 1 + 2 + 1 + 5


def test_forced_format_rejects_other_records(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "i", "output": "o"}])
    with pytest.raises(DataError, match=r"a\.jsonl:1: not a sharegpt record"):
        load_conversations([f], fmt="sharegpt", on_error="fail")


def test_bundled_prompts_ship_with_their_licences():
    licences = {"gsm8k": ("LICENSE.gsm8k", "MIT License"),
                "guanaco": ("LICENSE.guanaco_1k", "Apache License"),
                "sharegpt_dummy": ("LICENSE.sharegpt_dummy", "Apache License"),
                "tasks": ("LICENSE.task_mix", "Apache License 2.0")}
    assert set(BUNDLED) == set(licences)
    for name, (licence, kind) in licences.items():
        path = bundled_prompts(name)
        assert path.is_file(), path
        assert kind in (path.parent / licence).read_text()
    gsm = load_conversations(bundled_prompts("gsm8k"))
    assert len(gsm) == 7473
    assert not any("<<" in m[1]["content"] for m in gsm["messages"][:500])
    assert len(load_conversations(bundled_prompts("guanaco"))) == 1000
    assert len(load_conversations(bundled_prompts("sharegpt_dummy"))) == 500
    assert "MIT License" in (bundled_prompts("tasks").parent / "LICENSE.task_mix").read_text()
    with pytest.raises(DataError, match="alpaca"):
        bundled_prompts("alpaca")


# ----------------------------------------------------------------------------- bad records

def test_malformed_jsonl_fails_with_file_and_line_or_is_skipped(tmp_path, capsys):
    good = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
    f = tmp_path / "bad.jsonl"
    f.write_text("\n".join([json.dumps(good), json.dumps(good), "{not json",
                            json.dumps({"prompt": "no known keys"}),
                            json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
                            json.dumps(good)]) + "\n")
    with pytest.raises(DataError, match=rf"{f}:3: invalid JSON"):
        load_conversations([f], on_error="fail")
    ds = load_conversations([f], on_error="skip")
    assert len(ds) == 3
    err = capsys.readouterr().err
    assert "skipped 3 malformed records" in err
    assert f"{f}:4: unrecognised record" in err and f"{f}:5: messages[0]: role" in err


def test_malformed_json_list_names_record_index_and_line(tmp_path, capsys):
    records = [{"conversations": [{"from": "human", "value": "h"}, {"from": "gpt", "value": "g"}]}] * 2
    records.append({"conversations": [{"from": "alien", "value": "?"}]})
    f = tmp_path / "list.json"
    text = json.dumps(records, indent=2)
    f.write_text(text)
    # The third record's opening brace: the line the error must name.
    line = [i for i, s in enumerate(text.splitlines(), 1) if s == "  {"][2]
    with pytest.raises(DataError, match=rf"{f}:{line} \(record 2\): conversations\[0\]"):
        load_conversations([f], on_error="fail")
    assert len(load_conversations([f])) == 2
    assert "skipped 1 malformed" in capsys.readouterr().err
    f.write_text('[\n  {"messages": []},\n  {"messages": [oops]}\n]')
    with pytest.raises(DataError, match=rf"{f}:3: record 1: invalid JSON"):
        load_conversations([f])


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="no such data file"):
        load_conversations([tmp_path / "nope.jsonl"])


# ----------------------------------------------------------------------------- loss masks

def check_mask(messages, tok, end_token):
    ids, mask = encode_conversation(messages, tok)
    expected = [m["content"] + end_token for m in messages if m["role"] == "assistant"]
    assert masked_segments(ids, mask, tok) == expected
    # Everything unmasked is template, system or user text.
    return ids, mask


def test_loss_mask_is_assistant_content_plus_end_of_turn():
    tok = tiny_tokenizer()
    ids, mask = check_mask(CHAT, tok, "<|im_end|>")
    # Exactly those tokens: the masked ids are the assistant contents' bytes + one end each.
    n_content = sum(len(m["content"].encode()) for m in CHAT if m["role"] == "assistant")
    assert sum(mask) == n_content + 2
    # A reply with multi-byte characters and one that is empty (only the end token learns).
    check_mask([{"role": "user", "content": "¿Qué?"}, {"role": "assistant", "content": "Sí — ✓"},
                {"role": "user", "content": "and?"}, {"role": "assistant", "content": ""}],
               tok, "<|im_end|>")


@pytest.mark.e2e
def test_loss_mask_on_smollm2_tokenizer():
    from transformers import AutoTokenizer

    from specdec.infer.target import ensure_embedded

    tok = AutoTokenizer.from_pretrained(ensure_embedded("smollm2-135m"))
    check_mask(CHAT, tok, "<|im_end|>")
    # The template's default system prompt is inserted but never learned.
    check_mask(CHAT[1:], tok, "<|im_end|>")


def test_truncation_and_packing(tmp_path, capsys):
    tok = tiny_tokenizer()
    convs = [[{"role": "user", "content": f"question {i}"},
              {"role": "assistant", "content": "answer " * (i + 1)}] for i in range(12)]
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in convs])
    ds = load_conversations([f])
    full = tokenize_conversations(ds, tok, max_length=10_000)
    lengths = [len(x) for x in full["input_ids"]]
    assert all(len(x) == len(y) for x, y in zip(full["input_ids"], full["loss_mask"]))

    short = tokenize_conversations(ds, tok, max_length=60)
    assert len(short) == 12 and max(len(x) for x in short["input_ids"]) == 60
    for s, f_ in zip(short["input_ids"], full["input_ids"]):
        assert s == f_[:60]
    # So short that no assistant token survives: dropped (nothing to learn).
    capsys.readouterr()
    assert len(tokenize_conversations(ds, tok, max_length=20)) == 0
    assert f"left out {len(ds)} of {len(ds)} conversations with no assistant reply within 20" in capsys.readouterr().err

    packed = tokenize_conversations(ds, tok, max_length=150, pack=True)
    assert max(len(x) for x in packed["input_ids"]) <= 150
    assert len(packed) < len(full)
    # Packing concatenates whole sequences in order (all fit within 150 here).
    assert max(lengths) <= 150
    flat = lambda col: [t for row in col for t in row]  # noqa: E731
    assert flat(packed["input_ids"]) == flat(full["input_ids"])
    assert flat(packed["loss_mask"]) == flat(full["loss_mask"])


def test_prepare_dataset_splits_and_never_reuses_a_stale_cache(tmp_path, capsys):
    tok = tiny_tokenizer()
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": [
        {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(20)])
    cache = tmp_path / "cache"
    a = prepare_dataset([f], tok, max_length=64, eval_fraction=0.25, seed=1, cache_root=cache)
    assert (len(a["train"]), len(a["eval"])) == (15, 5)
    capsys.readouterr()
    b = prepare_dataset([f], tok, max_length=64, eval_fraction=0.25, seed=1, cache_root=cache)
    assert "using cached" in capsys.readouterr().err
    assert b["eval"]["input_ids"] == a["eval"]["input_ids"]
    # Changing max_length, the tokenizer's template or the file's content: recomputed.
    c = prepare_dataset([f], tok, max_length=23, eval_fraction=0.25, seed=1, cache_root=cache)
    assert "using cached" not in capsys.readouterr().err
    assert max(len(x) for x in c["train"]["input_ids"]) <= 23
    tok2 = tiny_tokenizer()
    tok2.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ")
    prepare_dataset([f], tok2, max_length=64, eval_fraction=0.25, seed=1, cache_root=cache)
    assert "using cached" not in capsys.readouterr().err
    write_jsonl(f, [{"messages": [{"role": "user", "content": "new"},
                                  {"role": "assistant", "content": "data"}]}] * 4)
    d = prepare_dataset([f], tok, max_length=64, eval_fraction=0.25, seed=1, cache_root=cache)
    assert "using cached" not in capsys.readouterr().err
    assert len(d["train"]) + len(d["eval"]) == 4


def test_a_byte_order_mark_is_read_past(tmp_path):
    f = tmp_path / "bom.jsonl"
    f.write_bytes("\ufeff".encode() + b'{"messages": [{"role": "user", "content": "q"}, '
                  b'{"role": "assistant", "content": "a"}]}\n')
    assert load_conversations([f], on_error="fail")["messages"][0][1]["content"] == "a"


def test_a_file_without_conversations_is_said_in_a_line(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="no conversation in .*empty.jsonl"):
        load_conversations([empty])
    with pytest.raises(DataError, match="no conversation"):
        prepare_dataset([empty], tiny_tokenizer(), cache_root=tmp_path / "cache")


@pytest.mark.parametrize("n, eval_fraction", [(1, 0.25), (6, 0.0)])
def test_prepare_dataset_caches_a_split_without_eval(tmp_path, capsys, n, eval_fraction):
    # one conversation cannot be split, and eval_fraction 0 asks for no eval: both leave the eval
    # split empty, which datasets cannot load back once saved
    tok = tiny_tokenizer()
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": [
        {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(n)])
    for _ in range(2):
        ds = prepare_dataset([f], tok, max_length=64, eval_fraction=eval_fraction, cache_root=tmp_path / "cache")
        assert (len(ds["train"]), len(ds["eval"])) == (n, 0)
        assert ds["eval"].column_names == ds["train"].column_names
    assert "using cached" in capsys.readouterr().err


# ----------------------------------------------------------------------------- CLI

def test_cli_help_lists_every_subcommand(capsys):
    from specdec.train.data_cli import SUBCOMMANDS, main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out
        with pytest.raises(SystemExit) as exit_:
            main([name, "--help"])
        assert exit_.value.code == 0
        assert "--target" in capsys.readouterr().out


def test_bundled_task_prompts_are_what_the_script_writes(tmp_path):
    """train/assets/task_mix.jsonl is reproducible from the bundled texts (no foreign text in
    it): prompts only, each task family in every run of nine."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "make_task_prompts.py"
    spec = importlib.util.spec_from_file_location("make_task_prompts", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "tasks.jsonl"
    module.main(["--out", str(out)])
    shipped = bundled_prompts("tasks")
    assert out.read_bytes() == shipped.read_bytes(), "rerun scripts/make_task_prompts.py"
    convs = load_conversations(shipped)
    assert len(convs) == 1000
    assert all([m["role"] for m in msgs] == ["user"] for msgs in convs["messages"])
    ids = [json.loads(line)["id"] for line in shipped.read_text(encoding="utf-8").splitlines()[:90]]
    families = [i.split("-", 2)[2] for i in ids]
    assert len(set(families)) == 9 and all(families.count(f) == 10 for f in set(families))


def test_jsonl_records_may_hold_unicode_line_separators(tmp_path):
    """json.dumps(ensure_ascii=False) writes U+2028 / U+0085 raw inside strings (the
    self-distillation files do): only a newline ends a JSONL record."""
    rec = {"messages": [{"role": "user", "content": "a\u2028b\x85c"}, {"role": "assistant", "content": "d"}]}
    f = tmp_path / "u.jsonl"
    f.write_text("".join(json.dumps(rec, ensure_ascii=False) + "\n" for _ in range(2)), encoding="utf-8")
    ds = load_conversations([f], on_error="fail")
    assert len(ds) == 2 and ds["messages"][0][0]["content"] == "a\u2028b\x85c"
