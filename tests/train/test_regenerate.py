"""Self-distillation: prompts kept, replies from the target, resumable without duplicates."""
from __future__ import annotations

import json

import pytest
import torch

from specdec.train.data import DataError, load_conversations
from specdec.train.regenerate import first_turn_prompt, regenerate

GEN = dict(batch_size=3, max_new_tokens=6, progress=False)


@pytest.fixture
def prompts_file(tmp_path):
    f = tmp_path / "p.jsonl"
    rows = [{"id": i, "messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": f"Question {i}?" + "!" * i},
                                   {"role": "assistant", "content": "old reply"},
                                   {"role": "user", "content": "follow-up"}]} for i in range(7)]
    rows.append({"question": "only a question"})  # GSM8K record, no answer: still a prompt
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def read(out):
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_first_turn_prompt_keeps_system_and_first_user():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a"}, {"role": "user", "content": "u2"}]
    assert first_turn_prompt(msgs) == msgs[:2]
    assert first_turn_prompt([{"role": "assistant", "content": "a"}]) is None


def test_replies_are_the_targets_own_greedy_output(tmp_path, tiny_target, prompts_file):
    out = tmp_path / "r.jsonl"
    stats = regenerate(tiny_target, [prompts_file], out, **GEN)
    records = read(out)
    assert stats["written"] == 8 and len(records) == 8
    for r in records:
        assert r["messages"][-1]["role"] == "assistant"
        assert [m["role"] for m in r["messages"][:-1]] in (["system", "user"], ["user"])
        assert r["finish_reason"] in ("stop", "length")
    by_id = {r["id"]: r for r in records}
    assert by_id["p.jsonl/3"]["messages"][1]["content"] == "Question 3?!!!"
    # Each reply is what greedy generate() gives for that prompt alone: 8 prompts through 3
    # slots, so most start while others are mid-reply (slots refilled as replies finish).
    tok, model = tiny_target.tokenizer, tiny_target.model
    for r in records:
        ids = tok(tok.apply_chat_template(r["messages"][:-1], tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False, return_tensors="pt")["input_ids"]
        alone = model.generate(ids, max_new_tokens=6, do_sample=False,
                               pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        alone = alone[:alone.index(tok.eos_token_id)] if tok.eos_token_id in alone else alone
        assert r["messages"][-1]["content"] == tok.decode(alone, skip_special_tokens=True).strip(), r["id"]
    # The output reads back as OpenAI-format conversations.
    assert len(load_conversations([out], on_error="fail")) == 8


def test_long_prompts_fit_by_tokens_and_past_the_positions_are_skipped(tmp_path, tiny_target, capsys):
    # tiny-llama has 1,024 positions and byte tokens: 900 characters fit (a bound in characters
    # would not), 1,100 do not
    f = tmp_path / "long.jsonl"
    rows = [{"id": n, "messages": [{"role": "user", "content": "ab" * (n // 2)}]} for n in (900, 1100, 10)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.jsonl"
    stats = regenerate(tiny_target, [f], out, **{**GEN, "max_new_tokens": 200})
    assert stats["written"] == 2 and sorted(r["id"] for r in read(out)) == ["long.jsonl/10", "long.jsonl/900"]
    assert "skipped 1 prompt(s) of 1024 tokens or more" in capsys.readouterr().err


def test_resume_skips_written_ids_and_drops_a_half_line(tmp_path, tiny_target, prompts_file):
    out = tmp_path / "r.jsonl"
    regenerate(tiny_target, [prompts_file], out, limit=3, **GEN)
    first = out.read_text()
    assert len(read(out)) == 3
    # A kill in the middle of a write leaves half a line: it is dropped and redone.
    out.write_text(first + '{"id": "p.jsonl/3", "messages": [{"ro')
    stats = regenerate(tiny_target, [prompts_file], out, limit=5, **GEN)
    assert stats == {**stats, "written": 2, "already_done": 3}
    records = read(out)
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)) == 5
    assert out.read_text().startswith(first)  # finished records untouched
    # Nothing left to do: a rerun writes nothing.
    assert regenerate(tiny_target, [prompts_file], out, limit=5, **GEN)["written"] == 0


def test_refuses_to_append_to_a_foreign_file(tmp_path, tiny_target, prompts_file):
    out = tmp_path / "r.jsonl"
    out.write_text("not json\n{}\n")
    with pytest.raises(DataError, match=r"r\.jsonl:1: not a regenerate record"):
        regenerate(tiny_target, [prompts_file], out, **GEN)


def test_sampled_cli_run(tmp_path, tiny_target_dir, prompts_file, capsys):
    from specdec.train.data_cli import main

    out = tmp_path / "r.jsonl"
    argv = ["regenerate", "--target", str(tiny_target_dir), "--dtype", "float32", "--data",
            str(prompts_file), "--out", str(out), "--limit", "4", "--batch-size", "2",
            "--max-new-tokens", "5", "--temperature", "0.8"]
    assert main(argv) == 0
    assert "wrote 4 replies" in capsys.readouterr().out
    assert len(read(out)) == 4


@pytest.mark.parametrize("flag,value,says", [("--batch-size", "0", "--batch-size must be >= 1"),
                                               ("--max-new-tokens", "0", "--max-new-tokens must be >= 1"),
                                               ("--limit", "0", "--limit must be >= 1"),
                                               ("--temperature", "-1", "--temperature must be"),
                                               ("--top-p", "0", "--top-p must be in (0, 1]")])
def test_cli_bad_flag_is_a_line_not_a_traceback(tmp_path, prompts_file, capsys, flag, value, says):
    from specdec.train.data_cli import main

    out = tmp_path / "r.jsonl"
    argv = ["regenerate", "--target", "no-such-target-is-loaded", "--data", str(prompts_file),
            "--out", str(out), flag, value]
    assert main(argv) == 2  # said before the target loads
    assert says in capsys.readouterr().err
    assert not out.exists()


def test_cli_out_that_is_a_folder_is_a_line(tmp_path, prompts_file, capsys):
    from specdec.train.data_cli import main

    argv = ["regenerate", "--target", "no-such-target-is-loaded", "--data", str(prompts_file),
            "--out", str(tmp_path)]
    assert main(argv) == 2  # not an IsADirectoryError traceback after the target loads
    assert "is a folder; regenerate writes a JSONL file" in capsys.readouterr().err


def test_recipe_keeps_original_replies_only_of_files_that_have_them(tmp_path, tiny_target, prompts_file):
    """A prompt-only file (like bundled:tasks) is self-distilled; asking to keep the datasets'
    own replies too must not fail on it, only skip it."""
    from pathlib import Path

    from specdec.train.config import load_recipe
    from specdec.train.pipeline import prepare_data
    from specdec.train.trainer import DistInfo

    only_prompts = tmp_path / "tasks.jsonl"
    only_prompts.write_text("".join(json.dumps({"id": f"t{i}", "messages": [
        {"role": "user", "content": f"Summarize: text number {i}."}]}) + "\n" for i in range(5)))
    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "medusa.yaml", [
        f"data.files=[{only_prompts}, {prompts_file}]", "data.eval_fraction=0", "data.limit=null",
        "data.regenerate.enabled=true", "data.regenerate.keep_original=true",
        "data.regenerate.num_prompts=4", "data.regenerate.max_new_tokens=4",
        "data.regenerate.batch_size=2", f"data.regenerate.dir={tmp_path / 'regen'}"])
    train, _ = prepare_data(recipe, tiny_target, DistInfo(0, 0, 1, torch.device("cpu")))
    # 4 + 4 self-distilled replies, and the 7 original replies of the file that has them
    # (its 8th record is a bare GSM8K question: no reply to keep)
    assert len(train) == 4 + 4 + 7


def test_recipe_reuses_replies_when_num_prompts_changes(tmp_path, tiny_target, prompts_file, capsys):
    """Replies are cached per prompt: asking for more prompts writes only the new ones, and
    each request gets the replies to exactly its first N prompts, in prompt order."""
    from pathlib import Path

    from specdec.train.config import load_recipe
    from specdec.train.pipeline import regenerate_files
    from specdec.train.trainer import DistInfo

    def files_for(n):
        recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "medusa.yaml", [
            "data.regenerate.enabled=true", f"data.regenerate.num_prompts={n}",
            "data.regenerate.max_new_tokens=4", "data.regenerate.batch_size=2",
            f"data.regenerate.dir={tmp_path / 'regen'}"])
        (out,) = regenerate_files(recipe, tiny_target, [prompts_file], DistInfo(0, 0, 1, torch.device("cpu")))
        return out, capsys.readouterr().err

    first, log = files_for(3)
    assert "'written': 3" in log
    more, log = files_for(5)
    assert "'written': 2" in log and "'already_done': 3" in log
    fewer, log = files_for(2)
    assert "'written': 0" in log
    ids = lambda f: [r["id"].split("/")[-1] for r in read(f)]   # the prompt's index in the file
    assert ids(more) == ["0", "1", "2", "3", "4"] and ids(fewer) == ["0", "1"]
    assert read(fewer) == read(more)[:2] == read(first)[:2]     # the same cached replies


def test_recipe_regenerates_for_an_edited_file_and_reuses_a_moved_one(tmp_path, tiny_target, prompts_file, capsys):
    """The cache is named by the file's content: editing the prompts must not keep training on
    the old ones, and a copy of the same file elsewhere (a new clone) reuses its replies."""
    from pathlib import Path

    from specdec.train.config import load_recipe
    from specdec.train.pipeline import regenerate_files
    from specdec.train.trainer import DistInfo

    def replies(path):
        recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "medusa.yaml", [
            "data.regenerate.enabled=true", "data.regenerate.num_prompts=2",
            "data.regenerate.max_new_tokens=4", "data.regenerate.batch_size=2",
            f"data.regenerate.dir={tmp_path / 'regen'}"])
        (out,) = regenerate_files(recipe, tiny_target, [path], DistInfo(0, 0, 1, torch.device("cpu")))
        return [r["messages"][-2]["content"] for r in read(out)], capsys.readouterr().err

    before, _ = replies(prompts_file)
    moved = tmp_path / "elsewhere" / prompts_file.name
    moved.parent.mkdir()
    moved.write_bytes(prompts_file.read_bytes())
    again, log = replies(moved)
    assert again == before and "'written': 0" in log
    prompts_file.write_text(prompts_file.read_text().replace("Question", "Query"))
    edited, log = replies(prompts_file)
    assert edited == ["Query 0?", "Query 1?!"] and "'written': 2" in log
