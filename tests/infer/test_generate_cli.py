"""specdec-generate on the tiny target: --json output, streaming output, errors, the entry point."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from specdec.infer.generate import main


def test_json_one_object_per_prompt(tiny_target_dir, tiny_target, capsys):
    rc = main(["--target", str(tiny_target_dir), "--prompt", "Hello", "--prompt", "Tell me a story",
               "--max-new-tokens", "12", "--json"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    tok = tiny_target.tokenizer
    for line, prompt in zip(lines, ["Hello", "Tell me a story"]):
        obj = json.loads(line)
        assert {"text", "token_ids", "tau", "tokens_per_s"} <= set(obj)
        assert 1 <= len(obj["token_ids"]) <= 12 and obj["tau"] >= 1.0 and obj["tokens_per_s"] > 0
        assert obj["text"] == tok.decode(obj["token_ids"], skip_special_tokens=True)
        # --chat is the default: the ids continue the chat-templated prompt greedily
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            ref = tiny_target.model.generate(torch.tensor([ids]), max_new_tokens=len(obj["token_ids"]),
                                             do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
        assert obj["token_ids"] == ref


def test_streams_text_and_reports_tau(tiny_target_dir, capsys):
    rc = main(["--target", str(tiny_target_dir), "--prompt", "abc", "--no-chat", "--max-new-tokens", "10",
               "--temperature", "0.7", "--top-k", "20", "--seed", "1"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "τ =" in captured.err and "tokens/s" in captured.err
    again = main(["--target", str(tiny_target_dir), "--prompt", "abc", "--no-chat", "--max-new-tokens", "10",
                  "--temperature", "0.7", "--top-k", "20", "--seed", "1"])
    assert again == 0 and capsys.readouterr().out == captured.out  # the seed fixes the sample


def test_bad_method_and_missing_head_are_reported(tiny_target_dir, capsys):
    assert main(["--target", str(tiny_target_dir), "--prompt", "x", "--method", "telepathy"]) == 2
    assert "unknown method" in capsys.readouterr().err
    assert main(["--target", str(tiny_target_dir), "--prompt", "x", "--method", "eagle3"]) == 2
    assert "--head" in capsys.readouterr().err


def test_bad_options_devices_and_long_prompts_are_said_in_a_line(tiny_target_dir, capsys):
    base = ["--target", str(tiny_target_dir), "--prompt", "x"]
    assert main([*base, "--method", "pld", "--opt", "bogus=1"]) == 2
    assert "method 'pld' does not take that option" in capsys.readouterr().err
    assert main([*base, "--opt", "ngram=3"]) == 2                  # plain drafts nothing
    assert "method 'plain' drafts nothing" in capsys.readouterr().err
    assert main([*base, "--head", str(tiny_target_dir)]) == 2      # a target folder, not a head
    assert "has no 'head_type'" in capsys.readouterr().err    # not "method 'plain' takes no head"
    assert main([*base, "--method", "pld", "--opt", "dtype=1"]) == 2
    assert "--opt dtype: not a drafter option" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main([*base, "--budget", "4,4"])
    assert exit_info.value.code == 2
    if not torch.cuda.is_available():
        assert main([*base, "--device", "cuda"]) == 2
        assert "use --device cpu" in capsys.readouterr().err
    assert main(["--target", str(tiny_target_dir), "--prompt", "word " * 80, "--max-len", "32"]) == 2
    assert "max_len=32" in capsys.readouterr().err
    assert main([*base, "--max-len", "5000"]) == 2               # tiny-llama has 1,024 positions
    assert "past the 1024 positions" in capsys.readouterr().err


def test_a_head_without_method_drafts_with_its_own(tiny_target_dir, tiny_target, tmp_path, capsys):
    from specdec.heads import get_head_class

    torch.manual_seed(0)
    get_head_class("mlp_speculator").from_target(tiny_target).save_pretrained(tmp_path / "head")
    base = ["--target", str(tiny_target_dir), "--prompt", "abc", "--max-new-tokens", "8", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*base, "--head", str(tmp_path / "head")]) == 0    # method mlp, from the head's config
    drafted = json.loads(capsys.readouterr().out)
    assert drafted["token_ids"] == plain["token_ids"] and drafted["steps"] <= plain["steps"]
    # the target too, from the recipe the trainer copies into final/ (else smollm2-135m)
    (tmp_path / "head" / "recipe.yaml").write_text(f"target:\n  name: {tiny_target_dir}\n")
    assert main(base[2:] + ["--head", str(tmp_path / "head")]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]


def test_entry_point_json_smoke(tiny_target_dir):
    exe = os.path.join(os.path.dirname(sys.executable), "specdec-generate")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "specdec.infer.generate"]
    proc = subprocess.run(cmd + ["--target", str(tiny_target_dir), "--prompt", "hi", "--max-new-tokens", "5",
                                 "--json"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(obj["token_ids"]) <= 5 and isinstance(obj["tau"], float)


# rest / hybrid build a datastore on first use (slow): their own tests cover them.
@pytest.mark.parametrize("method", ["pld", "lookahead"])
def test_training_free_methods_run_when_present(tiny_target_dir, method, capsys):
    from specdec.infer.drafters import training_free_methods

    if method not in training_free_methods():
        pytest.skip(f"infer/drafters/{method}.py does not exist yet")
    greedy = ["--target", str(tiny_target_dir), "--prompt", "abcabcabcabc", "--no-chat",
              "--max-new-tokens", "16", "--json"]
    assert main(greedy) == 0
    plain = json.loads(capsys.readouterr().out)
    rc = main(greedy + ["--method", method])
    out = capsys.readouterr()
    if rc != 0:
        pytest.skip(f"{method} needs options this smoke test does not give: {out.err.strip()[-200:]}")
    assert json.loads(out.out)["token_ids"] == plain["token_ids"]
