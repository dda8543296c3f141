"""specdec-bench: Spec-Bench's method, its inputs, and the three report files."""
from __future__ import annotations

import json

import pytest

from specdec.heads.tree import TreeBudget
from specdec.infer.bench import cli, specbench
from specdec.infer.bench.specbench import BenchError, Turn

FIELDS = {"tau", "tokens_per_s", "speedup", "speedup_vs_hf", "identical_rate", "n_questions",
          "new_tokens", "accept_length_hist", "accept_rate_by_position"}


def write_questions(path, questions) -> str:
    path.write_text("".join(json.dumps(q) + "\n" for q in questions))
    return str(path)


QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a haiku.", "Now make it rhyme."]},
    {"question_id": 2, "category": "writing", "turns": ["Say hi."]},
    {"question_id": 3, "category": "summarization", "turns": ["Summarize: cats sit. Cats sit."]},
    {"question_id": 4, "category": "qa", "turns": ["Why is the sky blue?"]},
]


def test_shipped_questions_and_licence():
    qs = specbench.load_questions()
    assert len(qs) == 280 and (specbench.DEFAULT_QUESTIONS.parent / "LICENSE").exists()
    assert sum(len(q["turns"]) == 2 for q in qs) == 80


def test_limit_is_round_robin_over_the_chosen_categories(tmp_path):
    path = write_questions(tmp_path / "q.jsonl", QUESTIONS)
    assert [q["question_id"] for q in specbench.load_questions(path, limit=3)] == [1, 3, 4]
    assert [q["question_id"] for q in specbench.load_questions(path, limit=4)] == [1, 3, 4, 2]
    assert [q["question_id"] for q in specbench.load_questions(path, ["qa", "writing"])] == [1, 2, 4]
    with pytest.raises(BenchError, match="unknown categories"):
        specbench.load_questions(path, ["poetry"])
    (tmp_path / "bad.jsonl").write_text('{"turns": "not a list"}\n')
    with pytest.raises(BenchError, match="bad.jsonl:1"):
        specbench.load_questions(tmp_path / "bad.jsonl")
    (tmp_path / "array.jsonl").write_text('[{"turns": ["hi"]}]\n')
    with pytest.raises(BenchError, match="array.jsonl:1: .*a JSON object"):
        specbench.load_questions(tmp_path / "array.jsonl")
    (tmp_path / "latin1.jsonl").write_bytes(b'\xff\xfe{"turns": ["hi"]}\n')
    for unreadable in (tmp_path / "latin1.jsonl", tmp_path):  # not UTF-8; a folder
        with pytest.raises(BenchError, match="cannot read it as UTF-8 JSONL"):
            specbench.load_questions(unreadable)


def test_method_specs():
    specs = specbench.parse_methods("pld,eagle3=/heads/e3,rest=/ds/x,hybrid=/heads/e3")
    assert [s.label for s in specs] == ["hf", "plain", "pld", "eagle3", "rest", "hybrid"]
    kw = {s.label: s.llm_kwargs() for s in specs}
    assert kw["eagle3"] == {"method": "eagle3", "head": "/heads/e3"}
    assert kw["rest"] == {"method": "rest", "datastore": "/ds/x"}
    assert kw["hybrid"] == {"method": "hybrid", "draft_head": "/heads/e3"}
    twice = specbench.parse_methods("rest=/a,rest=/b")
    assert [s.label for s in twice][2:] == ["rest=/a", "rest=/b"]
    for text, named in (("plain,plain", "plain"), ("pld,pld", "pld"), ("eagle3=/h,eagle3=/h", "eagle3=/h")):
        with pytest.raises(BenchError, match=f"--methods names {named} more than once"):
            specbench.parse_methods(text)
    with pytest.raises(BenchError, match="unknown method"):
        specbench.parse_methods("plain,warp")
    with pytest.raises(BenchError, match="takes no"):
        specbench.parse_methods("plain=3")
    with pytest.raises(BenchError, match="takes no"):
        specbench.parse_methods("pld=3")[2].llm_kwargs()


def test_second_turn_prompt_holds_the_first_answer(tiny_target):
    tok, prompts = tiny_target.tokenizer, []

    def fake_generate(prompt_ids, max_new_tokens):
        prompts.append(tok.decode(prompt_ids))
        return Turn(tok("ANSWER-ONE")["input_ids"] + tiny_target.eos_token_ids, 0.5, [2, 1])

    ans = specbench.answer_question(fake_generate, tok, QUESTIONS[0], 16)
    assert "ANSWER-ONE" not in prompts[0] and "ANSWER-ONE" in prompts[1]
    assert prompts[1].index("Write a haiku.") < prompts[1].index("ANSWER-ONE") < prompts[1].index("Now make it rhyme.")
    assert ans.seconds == 1.0 and ans.step_tokens == [2, 1, 2, 1]


def test_methods_take_turns_question_by_question(tiny_target, monkeypatch):
    """A drifting machine must not bias the ratios: every question is answered by all methods
    back to back, the first to answer rotating, each method on its own engine throughout."""
    calls, made = [], []

    class Fake:
        def __init__(self, *args):
            self.label = args[1].label if len(args) > 1 else "hf"
            made.append(self.label)

        def __call__(self, prompt_ids, max_new_tokens):
            calls.append(self.label)
            return Turn([5], 0.1, [1])

    monkeypatch.setattr(specbench, "EngineGenerator", Fake)
    monkeypatch.setattr(specbench, "HFGenerator", Fake)
    methods = specbench.parse_methods("plain,pld")
    questions = [QUESTIONS[1], QUESTIONS[2], QUESTIONS[3]]  # one turn each
    answers = specbench.run_benchmark(tiny_target, methods, questions, 4, runs=2, progress=False)
    assert made == ["hf", "plain", "pld"]  # one engine per method, built once
    timed = calls[3:]  # after the three warm-ups
    blocks = [timed[i:i + 3] for i in range(0, len(timed), 3)]
    assert all(sorted(b) == ["hf", "plain", "pld"] for b in blocks)
    assert [b[0] for b in blocks] == ["hf", "plain", "pld", "hf", "plain", "pld"]
    assert {k: [len(run) for run in v] for k, v in answers.items()} == {k: [3, 3] for k in made}
    assert [a.question_id for a in answers["pld"][1]] == [2, 3, 4]


def test_bench_end_to_end_on_the_tiny_target(tiny_target_dir, tmp_path):
    qfile = write_questions(tmp_path / "q.jsonl", QUESTIONS[:3])
    out = tmp_path / "out"
    rc = cli.main(["--target", str(tiny_target_dir), "--methods", "plain,pld", "--questions", qfile,
                   "--max-new-tokens", "16", "--runs", "2", "--no-progress", "--out", str(out)])
    assert rc == 0
    for name in ("results.json", "results.md", "speedup.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = json.loads((out / "results.json").read_text())
    assert {"cpu", "cpu_capability", "cpu_native_bf16", "cores", "torch", "device"} <= set(res["machine"])
    assert res["target"]["name"] == tiny_target_dir.name
    assert res["settings"]["max_new_tokens"] == 16 and res["settings"]["runs"] == 2
    assert set(res["methods"]) == {"hf", "plain", "pld"}
    for name, m in res["methods"].items():
        assert set(m["categories"]) == {"writing", "summarization"}
        for block in [m["overall"], *m["categories"].values()]:
            assert FIELDS <= set(block), name
            assert {f"{k}_std" for k in ("tau", "tokens_per_s", "speedup", "speedup_vs_hf")} <= set(block)
        assert m["overall"]["n_questions"] == 3
        assert m["categories"]["writing"]["n_questions"] == 2
        assert 0 < m["overall"]["new_tokens"] <= 16 * 4  # 4 turns in all
    for name in ("plain", "pld"):
        assert res["methods"][name]["overall"]["identical_rate"] == 1.0
    assert res["methods"]["plain"]["overall"]["speedup"] == pytest.approx(1.0)
    assert res["methods"]["plain"]["overall"]["tau"] == pytest.approx(1.0)
    assert res["methods"]["pld"]["overall"]["tau"] >= 1.0
    md = (out / "results.md").read_text()
    assert "| pld |" in md and "published" in md.lower() and "Vicuna-7B" in md


def test_budget_and_drafter_options_reach_every_speculative_method(tiny_target_dir, tmp_path, capsys,
                                                                   monkeypatch):
    """--budget goes to every speculative method's steps (plain keeps none) and caps what a step
    accepts (1 node: τ <= 2); the settings record it and the options; an --opt a drafter does not
    take fails naming the method."""
    from specdec.infer.api import LLM

    seen = {}
    generate = LLM.generate

    def recording(self, prompts, params=None, chat=False, budget=None, on_output=None):
        seen.setdefault(self.method, set()).add(budget)
        return generate(self, prompts, params, chat, budget, on_output)

    monkeypatch.setattr(LLM, "generate", recording)
    qfile = write_questions(tmp_path / "q.jsonl", QUESTIONS[:2])

    def bench(*extra):
        out = tmp_path / f"out{len(extra)}"
        rc = cli.main(["--target", str(tiny_target_dir), "--methods", "plain,pld", "--questions", qfile,
                       "--max-new-tokens", "24", "--no-progress", "--out", str(out), *extra])
        return rc, out

    rc, out = bench("--budget", "1,1,1", "--opt", "max_ngram=3")
    assert rc == 0
    assert seen == {"plain": {None}, "pld": {TreeBudget(1, 1, 1)}}
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["budget"] == {"max_nodes": 1, "max_depth": 1, "topk": 1}
    assert res["settings"]["drafter_opts"] == {"max_ngram": 3}
    assert "tree budget 1 nodes, depth 1, top-1; drafter options max_ngram=3" in (out / "results.md").read_text()
    pld = res["methods"]["pld"]["overall"]
    assert 1.0 <= pld["tau"] <= 2.0 and pld["identical_rate"] == 1.0
    assert bench("--opt", "telepathy=1")[0] == 2
    assert "method 'pld'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        bench("--budget", "4,0,2")
    assert exit_info.value.code == 2                          # a usage error, as argparse's
    assert "--budget expects NODES,DEPTH,TOPK" in capsys.readouterr().err


def test_cli_errors_and_serve_dispatch(tmp_path, capsys):
    assert cli.main(["--target", "tiny-llama", "--methods", "plain,warp", "--out", str(tmp_path)]) == 2
    assert "unknown method" in capsys.readouterr().err
    assert cli.main(["--target", "tiny-llama", "--methods", "plain,mlp_speculator", "--out", str(tmp_path)]) == 2
    assert "as method 'mlp'" in capsys.readouterr().err       # the head type points to its method
    (tmp_path / "a-file").touch()                              # said before the run, not after it
    assert cli.main(["--target", "tiny-llama", "--methods", "plain", "--limit", "1", "--max-new-tokens", "2",
                     "--out", str(tmp_path / "a-file")]) == 2
    assert "cannot be a folder" in capsys.readouterr().err
    for empty in ("", ",", " , "):                            # not silently every category
        assert cli.main(["--target", "tiny-llama", "--categories", empty, "--out", str(tmp_path / "e")]) == 2
        assert "names no category" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()
    assert cli.main(["--target", "no-such-target-is-loaded", "--runs", "0", "--out", str(tmp_path / "r")]) == 2
    assert "--runs must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--serve", "--help"])
    assert exit_info.value.code == 0
    assert "--concurrency" in capsys.readouterr().out


def test_plain_policy_server_drops_the_head(tmp_path):
    """`specdec-bench --serve -- --head DIR`: the plain run is the same server without a drafter
    (specdec-serve refuses a head with --method plain); the other policies keep the head."""
    from specdec.infer.bench.serve_load import LocalServer

    args = ["--head", "runs/h", "--dtype", "bfloat16", "--head=runs/h2", "--max-batch", "32"]
    plain = LocalServer("plain", args, tmp_path / "log").cmd
    assert "--head" not in plain and not any(a.startswith("--head=") for a in plain)
    assert plain[plain.index("--method") + 1] == "plain" and "bfloat16" in plain and "32" in plain
    goodput = LocalServer("goodput", args, tmp_path / "log").cmd
    assert goodput[goodput.index("--head") + 1] == "runs/h" and "--spec-policy" in goodput


def test_step_log_summary_by_batch_size(tmp_path):
    """`specdec-serve --step-log` lines -> one row per batch-size bucket, prefill-only steps left out."""
    from specdec.infer.bench.step_logs import bucket, markdown, summarize

    def step(batch, accepted=0, nodes=0, prefill=0, engine=10.0):
        return {"t": 0.0, "gap_ms": 0.5, "plan_ms": 0.25, "engine_ms": engine, "decode_ms": engine,
                "after_ms": 0.25, "batch": batch, "prefill_tokens": prefill, "tokens": batch + nodes,
                "nodes": nodes, "accepted": accepted, "arm": None}

    steps = [step(1), step(1, accepted=3, nodes=4, engine=14.0), step(0, prefill=50, engine=40.0),
             step(2, prefill=20, engine=19.0), step(3), step(9)]
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(s) + "\n" for s in steps))
    rows = summarize(log)
    assert [r["batch"] for r in rows] == ["1", "2-3", "8-15"] and [bucket(b) for b in (1, 4, 7, 32)] == \
        ["1", "4-7", "4-7", "32-63"]
    one, two = rows[0], rows[1]
    assert one["steps"] == 2 and one["speculating"] == 0.5 and one["tokens_per_step"] == 2.5
    assert one["engine_ms"] == 12.0 and one["around_ms"] == 1.0
    assert one["tokens_per_s"] == pytest.approx(1e3 * 5 / 26.0)  # 5 tokens in 2 x (engine + 1 ms around)
    assert two["steps"] == 2 and two["with_prefill"] == 0.5 and two["tokens_per_step"] == 2.5
    table = markdown({"goodput": rows})
    assert "| goodput | 1 | 2 | 50% | 0% | 2.50 | 12.00 | 1.00 | 192.3 |" in table


def test_earlier_results_in_out_are_kept_unless_overwrite(tiny_target_dir, tmp_path, capsys):
    qfile = write_questions(tmp_path / "q.jsonl", QUESTIONS[:1])
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text('{"earlier": "an hour of benchmarking"}\n')
    argv = ["--target", str(tiny_target_dir), "--methods", "plain", "--questions", qfile,
            "--max-new-tokens", "2", "--no-progress", "--out", str(out)]
    assert cli.main(argv) == 2                                   # refused before the run
    assert "--overwrite" in capsys.readouterr().err
    assert "an hour of benchmarking" in (out / "results.json").read_text()
    assert cli.main([*argv, "--overwrite"]) == 0
    assert "an hour of benchmarking" not in (out / "results.json").read_text()
