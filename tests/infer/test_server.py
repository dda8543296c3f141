"""specdec-serve on loopback with the tiny target: the openai client, batching, bad input, auth,
disconnects, queue limits, SIGTERM drain, and the --serve load generator against it."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

openai = pytest.importorskip("openai")

KEY = "test-key-123"
MAX_LEN = 512
MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_target):
    """A live server in a thread: tiny target, PLD drafter, goodput policy, API key."""
    from specdec.infer.server.cli import build_app, make_server

    app = build_app(tiny_target, "pld", max_batch=4, max_len=MAX_LEN, api_key=KEY, served_model_name=MODEL,
                    spec_nodes=(0, 2, 4), prefill_chunk=64, max_body_bytes=64 * 1024)
    port = free_port()
    srv = make_server(app, "127.0.0.1", port, log_level="warning")
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    yield app, f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0)


def auth():
    return {"Authorization": f"Bearer {KEY}"}


def complete(client, prompt, max_tokens=24, **kw):
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True}, **kw)
    return r.choices[0].text


def test_openai_client_completions_chat_and_streaming(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.completions.create(model=MODEL, prompt="abcabcabc", max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
    text = r.choices[0].text
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens == 9
    spec = r.usage.model_extra["speculation"]
    assert 1 <= spec["decode_steps"] <= 15 and spec["accepted_tokens"] >= 0  # the first token is the prefill's
    steps = spec["decode_steps"]
    assert spec["tau"] == pytest.approx((spec["accepted_tokens"] + steps) / steps, abs=1e-4)
    streamed = client.completions.create(model=MODEL, prompt="abcabcabc", max_tokens=16, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"

    messages = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, seed=3)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens <= 12
    parts, usage = [], None
    for c in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}):
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            parts.append(ch.delta.content or "")
    assert "".join(parts) == chat.choices[0].message.content
    assert usage.completion_tokens == chat.usage.completion_tokens
    # the raw stream ends with the SSE terminator
    with httpx.stream("POST", server[1] + "/v1/completions", headers=auth(), json={
            "model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}) as resp:
        lines = [ln for ln in resp.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)


def test_sampling_and_stop(client):
    prompt = "The quick brown fox"
    # (a seed is best effort, as in OpenAI's API: with adaptive speculation the random stream a
    # request consumes depends on the tree sizes chosen, so equal seeds need not give equal text)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0.9, top_p=0.9,
                                  seed=7, extra_body={"top_k": 50, "ignore_eos": True})
    assert r.usage.completion_tokens == 20 and r.choices[0].finish_reason == "length"
    full = complete(client, prompt, max_tokens=30)
    stop = full[10:12]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(stop)]


def test_stop_token_ids_end_the_completion(server, client):
    """vLLM's stop_token_ids extension is honoured (it was ignored as an unknown field)."""
    every_token = list(range(server[0].state.scheduler.engine.vocab_size))
    r = client.completions.create(model=MODEL, prompt="abcabc", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": every_token})
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"


def test_chat_can_carry_on_the_last_assistant_message(server):
    """vLLM's continue_final_message: the reply goes on from the assistant's text (it was ignored,
    and a new assistant message started after it)."""
    start = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "one two"}]
    body = {"model": MODEL, "messages": start, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "continue_final_message": True, "add_generation_prompt": False}
    carried = httpx.post(server[1] + "/v1/chat/completions", json=body, headers=auth()).json()
    new = httpx.post(server[1] + "/v1/chat/completions", json={**body, "continue_final_message": False,
                                                              "add_generation_prompt": True}, headers=auth()).json()
    assert carried["usage"]["prompt_tokens"] < new["usage"]["prompt_tokens"]  # no end of turn, no new header


def test_concurrent_requests_give_the_same_greedy_text(client):
    prompts = ["abcabcabcabc", "hello world, hello", "1 2 3 4 5 6", "zzzz", "The cat sat on the", "{[()]}" * 3]
    one_by_one = [complete(client, p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: complete(client, p), prompts))
    assert together == one_by_one


def _error(resp, status):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


BAD = [
    ("malformed json", b'{"model": "tiny", "prompt": ', 400, None),
    ("invalid utf-8", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None),
    ("not an object", b"[1, 2, 3]", 400, None),
    ("lone surrogate escape", b'{"model": "tiny", "prompt": "a \\ud800 b"}', 400, None),  # was a 500
    ("nested too deeply", b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None),
    ("max_tokens as string", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("temperature as string", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("prompt as number", {"prompt": 5}, 400, "prompt"),
    ("missing prompt", {}, 400, "prompt"),
    ("negative max_tokens", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("zero max_tokens", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("huge max_tokens", {"prompt": "x", "max_tokens": 10 ** 12}, 400, "max_tokens"),
    ("prompt longer than context", {"prompt": "y" * (MAX_LEN + 10)}, 400, "prompt"),
    ("token ids outside vocab", {"prompt": [1, 2, 10 ** 6]}, 400, "prompt"),
    ("empty prompt", {"prompt": ""}, 400, "prompt"),
    ("n > 1", {"prompt": "x", "n": 2}, 400, "n"),
    ("temperature out of range", {"prompt": "x", "temperature": 7.5}, 400, "temperature"),
    ("too many stop strings", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("stream_options without stream", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("unknown model", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("body too large", {"prompt": "x" * (70 * 1024)}, 413, None),
]


@pytest.mark.parametrize("name,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_json_4xx_and_the_server_keeps_serving(server, client, name, body, status, param):
    if isinstance(body, dict):
        body = json.dumps({"model": MODEL, **body}).encode()
    resp = httpx.post(server[1] + "/v1/completions", content=body,
                      headers={**auth(), "Content-Type": "application/json"})
    err = _error(resp, status)
    if param:
        assert err["param"] == param
    assert complete(client, "still alive?", max_tokens=4)


def test_bad_chat_input(server):
    base = server[1] + "/v1/chat/completions"
    for body, param in [({"messages": []}, "messages"),
                        ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
                        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
                         "max_completion_tokens"),
                        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs")]:
        err = _error(httpx.post(base, json={"model": MODEL, **body}, headers=auth()), 400)
        assert err["param"] == param
    image = [{"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}]
    err = _error(httpx.post(base, json={"model": MODEL, "messages": [{"role": "user", "content": image}]},
                            headers=auth()), 400)
    assert err["param"] == "messages" and err["message"].startswith("messages.0.content.0: only text")


def test_api_key_is_required_except_for_health(server):
    base = server[1]
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        assert _error(httpx.get(base + "/v1/models", headers=headers), 401)["code"] == "invalid_api_key"
        _error(httpx.get(base + "/metrics", headers=headers), 401)
        _error(httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers), 401)
    bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=2)


def _wait_idle(app, timeout=5.0):
    deadline = time.monotonic() + timeout
    sched = app.state.scheduler
    while sched.active or sched.engine.has_unfinished():
        assert time.monotonic() < deadline, "the slot was not freed"
        time.sleep(0.01)


def _generated_total(base):
    text = httpx.get(base + "/metrics", headers=auth()).text
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith("specdec_generation_tokens_total")))


def test_client_disconnect_frees_the_slot(server):
    app, base = server
    _wait_idle(app)
    before = _generated_total(base)
    body = {"model": MODEL, "prompt": "go", "max_tokens": MAX_LEN - 10, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, headers=auth()) as resp:
        next(resp.iter_lines())  # generation has started; now hang up
    _wait_idle(app)
    # non-streaming: the client gives up waiting
    body["stream"] = False
    with pytest.raises(httpx.TimeoutException):
        httpx.post(base + "/v1/completions", json=body, headers=auth(), timeout=0.3)
    _wait_idle(app)
    generated = _generated_total(base) - before
    assert generated < 2 * (MAX_LEN - 10)  # neither request ran to its end
    assert 'outcome="disconnected"' in httpx.get(base + "/metrics", headers=auth()).text


def test_queue_full_and_draining_answer_429_and_503(server, client):
    app, base = server
    sched = app.state.scheduler
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    sched.max_queue, limit = 0, sched.max_queue
    try:
        assert _error(httpx.post(base + "/v1/completions", json=body, headers=auth()), 429)["code"] == "queue_full"
    finally:
        sched.max_queue = limit
    sched.begin_drain()
    try:
        assert _error(httpx.post(base + "/v1/completions", json=body, headers=auth()), 503)["code"] == "draining"
        assert httpx.get(base + "/health").status_code == 503
    finally:
        sched.draining = False
    assert complete(client, "back", max_tokens=2) is not None


def test_metrics_report_speculation_and_latency(server, client):
    complete(client, "abcabcabcabcabc", max_tokens=16)
    text = httpx.get(server[1] + "/metrics", headers=auth()).text
    for name in ("specdec_requests_total", "specdec_tokens_per_second", "specdec_spec_tau",
                 'specdec_spec_acceptance_rate{position="1"}', "specdec_batch_size_bucket",
                 "specdec_spec_budget_nodes_bucket", "specdec_queue_length", "specdec_running_requests",
                 "specdec_time_to_first_token_seconds_bucket", "specdec_time_per_output_token_seconds_bucket",
                 "specdec_e2e_request_latency_seconds_bucket", 'specdec_cost_model_seconds{term="c"}'):
        assert name in text, name


def test_a_repeated_prompt_reuses_its_prefix(server, client):
    """Prefix caching is on by default: the same long prompt again is prefilled from its last
    token only, says usage.prompt_tokens_details (OpenAI's field) and /metrics, with the same text."""
    prompt = "You are a careful assistant. Answer briefly and precisely. " * 3 + "What is a prefix?"

    def ask():
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].text, r.usage

    def hit_tokens():
        text = httpx.get(server[1] + "/metrics", headers=auth()).text
        return float(next(ln.split()[-1] for ln in text.splitlines()
                          if ln.startswith("specdec_prefix_cache_hit_tokens_total")))

    before = hit_tokens()
    first, usage1 = ask()
    second, usage2 = ask()
    assert second == first
    assert usage2.prompt_tokens_details.cached_tokens == usage2.prompt_tokens - 1 > 16
    assert usage1.prompt_tokens_details.cached_tokens < usage2.prompt_tokens_details.cached_tokens
    assert hit_tokens() - before >= usage2.prompt_tokens - 1


def test_sigterm_drains_in_flight_requests_then_exits(tiny_target):
    """The first SIGTERM refuses new requests (503) but lets running streams finish, then exits."""
    from specdec.infer.server.cli import build_app, make_server

    app = build_app(tiny_target, "plain", max_batch=2, max_len=256, served_model_name=MODEL)
    port = free_port()
    srv = make_server(app, "127.0.0.1", port, log_level="warning")
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.02)
    base = f"http://127.0.0.1:{port}"
    lines = []
    body = {"model": MODEL, "prompt": "drain me", "max_tokens": 120, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as resp:
        it = resp.iter_lines()
        lines.append(next(it))  # decoding has begun
        srv.handle_exit(signal.SIGTERM, None)  # what uvicorn calls on the signal
        refused = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=10)
        assert _error(refused, 503)["code"] == "draining"
        lines += [ln for ln in it if ln]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    thread.join(20)
    assert not thread.is_alive(), "the server did not exit after draining"


def test_bench_serve_runs_the_real_cli_per_policy(tmp_path):
    """`specdec-bench --serve` starts `specdec-serve` (a subprocess on a free port), loads it at two
    concurrencies, stops it with SIGTERM (exit code 0) and writes JSON + Markdown + PNG, and with
    --step-logs each server's per-step log."""
    from specdec.infer.bench import serve_load

    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [f"{c} question {i}?"]})
                                   for i, c in enumerate(["writing", "math", "qa"])))
    out = tmp_path / "bench"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    assert serve_load.main(["--policies", "plain,goodput", "--concurrency", "1,2", "--num-prompts", "3",
                            "--warmup", "2", "--rounds", "2", "--max-tokens", "8", "--questions", str(questions),
                            "--out", str(out), "--step-logs", "--", "--target", "tiny-llama", "--method", "pld",
                            "--max-len", "256", "--log-level", "warning"]) == 0
    report = json.loads((out / "serve_bench.json").read_text())
    assert report["servers"]["goodput"]["exit_code"] == 0 and report["servers"]["plain"]["exit_code"] == 0
    for policy in ("plain", "goodput"):
        levels = report["runs"][policy]
        assert [lv["concurrency"] for lv in levels] == [1, 2] and all(lv["failed"] == 0 for lv in levels)
        # two rounds of 3 requests each; the warm-up is not counted
        assert report["warmup"] == 2 and all(lv["requests"] == 6 for lv in levels)
        assert all(lv["output_tokens"] > 0 and lv["tau"] >= 1.0 and lv["ttft_s"]["p50"] > 0 for lv in levels)
        # the same 3 prompts again and again: the prefix cache supplies some of them
        assert all(0 < lv["cached_prompt_tokens"] < lv["prompt_tokens"] for lv in levels), levels
        for lv in levels:  # the pooled rate lies between the rounds' own
            assert len(lv["throughput_rounds"]) == 2 and lv["throughput_std"] >= 0
            assert min(lv["throughput_rounds"]) <= lv["throughput_tok_s"] * (1 + 1e-9)
            assert lv["throughput_tok_s"] <= max(lv["throughput_rounds"]) * (1 + 1e-9)
    assert (out / "serve_bench.png").stat().st_size > 0
    for policy in ("plain", "goodput"):  # every step of every request, the warm-up's included
        steps = [json.loads(ln) for ln in (out / f"steps-{policy}.jsonl").read_text().splitlines()]
        levels = report["runs"][policy]
        # a decoding row adds its accepted drafts + 1; each request's first token comes from its prefill
        requests = report["warmup"] + sum(lv["requests"] for lv in levels)
        added = sum(s["batch"] + s["accepted"] for s in steps)
        assert added + requests >= sum(lv["output_tokens"] for lv in levels)
        assert max(s["batch"] for s in steps) == 2 and sum(s["prefill_tokens"] for s in steps) > 0
        assert all(s["engine_ms"] > 0 and s["gap_ms"] >= 0 and s["after_ms"] >= 0 and s["t"] >= 0 for s in steps)
        arms = {s["arm"] for s in steps}
        if policy == "plain":  # no drafter, no controller
            assert arms == {None} and all(s["nodes"] == 0 for s in steps)
        else:
            assert arms and arms <= {"plain", "model", "full"}, arms
            # a decode step drafts exactly when the arm speculates
            assert all((s["nodes"] == 0) == (s["arm"] == "plain") for s in steps if s["batch"]), steps
    summary = report["step_logs"]  # the logs, by batch size: batches of 1 and 2 here
    assert [r["batch"] for r in summary["plain"]] == ["1", "2-3"] and summary["goodput"][0]["steps"] > 0
    assert all(r["speculating"] == 0 for r in summary["plain"])
    table = (out / "serve_bench.md").read_text()
    assert "## Where the step time went" in table and "| goodput | 2-3 |" in table
    assert "| goodput | 2 |" in table and "| plain | 1 |" in table and " ± " in table and "% |" in table


def test_serve_load_against_an_endpoint(server, tmp_path):
    from specdec.infer.bench import serve_load

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["Why?"]}))
    assert serve_load.main(["--endpoint", server[1] + "/v1", "--concurrency", "2", "--num-prompts", "2",
                            "--max-tokens", "4", "--questions", str(questions), "--api-key", KEY,
                            "--out", str(tmp_path)]) == 0
    level = json.loads((tmp_path / "serve_bench.json").read_text())["runs"]["endpoint"][0]
    assert level["requests"] == 2 and level["failed"] == 0


def test_serve_load_refuses_non_loopback_endpoints_and_bad_runs(tmp_path, capsys):
    from specdec.infer.bench.serve_load import BenchError, check_loopback, main

    assert check_loopback("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000"
    assert check_loopback("http://[::1]:9/") == "http://[::1]:9"
    for url in ("http://10.0.0.1:8000", "http://example.com/v1", "ftp://127.0.0.1/"):
        with pytest.raises(BenchError):
            check_loopback(url)
    assert main(["--endpoint", "http://192.168.1.5:8000", "--questions", os.devnull]) == 2
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["Why?"]}))
    for bad, why in ((["--policies", "plain,plain"], "repeat"), (["--policies", "fastest"], "unknown policies"),
                     (["--rounds", "0"], "--rounds")):  # refused before any server starts
        assert main(bad + ["--questions", str(questions), "--out", str(tmp_path)]) == 2
        assert why in capsys.readouterr().err


def test_torch_thread_runs_every_call_on_one_thread():
    """The server builds the engine and runs its loop on one TorchThread (two threads making
    torch calls get two OpenMP teams, which throttle each other on a small CPU)."""
    from specdec.infer.server.scheduler import TorchThread

    worker = TorchThread()
    first = worker.call(threading.get_ident)
    assert first != threading.get_ident() and worker.call(threading.get_ident) == first
    with pytest.raises(ZeroDivisionError):
        worker.call(lambda: 1 / 0)
    seen = []
    done = worker.submit(lambda: seen.append(threading.get_ident()))
    done.result(timeout=5)
    assert done.done() and seen == [first]


def test_build_app_decodes_on_the_thread_that_built_the_engine(server):
    app, _ = server
    scheduler = app.state.scheduler
    worker = scheduler._torch_thread  # build_app made the engine there (TorchThread.call)
    assert worker is not None and worker._thread.name == "specdec-engine" and worker._thread.is_alive()
    assert scheduler._loop_done is not None and not scheduler._loop_done.done()  # the loop runs there too


def test_a_negative_prefix_cache_is_refused_before_loading(capsys):
    from specdec.infer.server.cli import main

    assert main(["--prefix-cache-mb", "-1"]) == 2
    assert "--prefix-cache-mb must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--max-queue", "--default-max-tokens", "--max-prompt-tokens", "--max-body-bytes"])
def test_limits_that_would_refuse_every_request_are_refused_before_loading(flag, capsys, monkeypatch):
    from specdec.infer.server import cli, scheduler

    started = []  # the thread that would load the target
    monkeypatch.setattr(scheduler, "TorchThread", lambda *a, **k: started.append(1))
    assert cli.main([flag, "0", "--method", "plain"]) == 2
    assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err and not started


def test_drafter_options_reach_the_drafter(capsys):
    from specdec.infer.server.cli import main

    assert main(["--target", "tiny-llama", "--method", "pld", "--opt", "bogus=1"]) == 2
    assert "method 'pld' does not take that option" in capsys.readouterr().err


def test_an_unwritable_step_log_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    from specdec.infer.server import cli, scheduler

    started = []  # the thread that would load the target
    monkeypatch.setattr(scheduler, "TorchThread", lambda *a, **k: started.append(1))
    path = tmp_path / "missing" / "steps.jsonl"
    assert cli.main(["--step-log", str(path), "--method", "plain"]) == 2
    assert f"cannot write the step log {path}" in capsys.readouterr().err and not started


def test_a_taken_port_is_refused_before_loading(capsys, monkeypatch):
    from specdec.infer.server import cli, scheduler

    started = []  # the thread that would load the target
    monkeypatch.setattr(scheduler, "TorchThread", lambda *a, **k: started.append(1))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["--method", "plain", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err and not started


def test_browsers_get_cors_headers_from_allowed_origins_only(tiny_target):
    from starlette.testclient import TestClient

    from specdec.infer.server.cli import build_app

    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    for origins, allowed in [(("*",), "*"), (("http://ui.example",), "http://ui.example"), ((), None)]:
        app = build_app(tiny_target, "plain", max_batch=1, max_len=64, api_key=KEY, allowed_origins=origins)
        resp = TestClient(app).options("/v1/chat/completions", headers=preflight)  # no key: a preflight has none
        assert resp.headers.get("access-control-allow-origin") == allowed
        assert (resp.status_code == 200) == (allowed is not None)


def test_a_heads_own_target_is_served_without_target(tiny_target, tiny_target_dir, tmp_path):
    import argparse

    from specdec.heads import get_head_class
    from specdec.infer.server.cli import resolve_method

    get_head_class("mlp_speculator").from_target(tiny_target).save_pretrained(tmp_path / "head")
    args = argparse.Namespace(head=str(tmp_path / "head"), method=None, target=None)
    assert resolve_method(args) == ("mlp", str(tmp_path / "head")) and args.target == "smollm2-135m"
    (tmp_path / "head" / "recipe.yaml").write_text(f"target:\n  name: {tiny_target_dir}\n")
    args.target = None
    resolve_method(args)
    assert args.target == str(tiny_target_dir)
