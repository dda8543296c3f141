"""`specdec-bench --serve`: load-test an OpenAI-compatible endpoint at rising concurrency.

For each speculation policy (plain / always / threshold / thompson / goodput)
it starts ``specdec-serve`` with that policy on a free loopback port, or uses
one ``--endpoint`` (loopback only: this tool never sends load to another
machine), then runs closed-loop clients at each concurrency (1, 2, 4, ... 32)
with Spec-Bench prompts through streaming chat completions, and reports
throughput, TTFT and TPOT percentiles, τ and the mean budget chosen, as
JSON + Markdown + a PNG of throughput vs concurrency. Every level is bounded
in request count (``--num-prompts``) and time (``--level-timeout-s``).
``--rounds R`` repeats each level R times with the policies' servers all up and
taking turns, and pools the passes (plus each pass's throughput and their std).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from . import step_logs

POLICIES = ("plain", "always", "threshold", "thompson", "goodput")
ASSETS = Path(__file__).resolve().parent / "assets"


class BenchError(RuntimeError):
    pass


def check_loopback(url: str) -> str:
    """The endpoint's base URL (…/v1 stripped); refuse anything that is not this machine."""
    parsed = urlparse(url)
    host = parsed.hostname or ""
    if parsed.scheme not in ("http", "https"):
        raise BenchError(f"endpoint {url!r} must be an http(s) URL")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise BenchError(f"refusing to load-test {host!r}: only loopback endpoints (127.0.0.1, ::1, "
                         "localhost) are allowed")
    base = url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def load_prompts(path: str | None, count: int) -> list[str]:
    """First turns of Spec-Bench questions, round-robin over categories so few cover all."""
    if path is None:
        found = sorted(ASSETS.glob("*.jsonl")) if ASSETS.is_dir() else []
        if not found:
            raise BenchError(f"no Spec-Bench question file under {ASSETS}; pass --questions FILE")
        path = str(found[0])
    by_cat: dict[str, list[str]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                by_cat.setdefault(rec.get("category", ""), []).append(rec["turns"][0])
    # [a1, a2], [b1] -> a1, b1, a2
    order = [q for group in itertools.zip_longest(*by_cat.values()) for q in group if q is not None]
    if not order:
        raise BenchError(f"{path} holds no questions")
    return [order[i % len(order)] for i in range(count)]


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(round(q * (len(s) - 1))))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": sum(s) / len(s)}


async def one_request(client, base, model, prompt, max_tokens, headers) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    chunks, usage = 0, None
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            return {"ok": False, "status": resp.status_code, "error": (await resp.aread()).decode()[:300]}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                usage = data["usage"]
            for ch in data.get("choices", []):
                if ch.get("delta", {}).get("content"):
                    first = first or time.perf_counter()
                    chunks += 1
    end = time.perf_counter()
    tokens = (usage or {}).get("completion_tokens", chunks)
    return {"ok": True, "start": t0, "end": end, "ttft": (first or end) - t0, "tokens": tokens,
            "tpot": (end - first) / (tokens - 1) if first and tokens > 1 else None,
            "spec": (usage or {}).get("speculation"), "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "cached_tokens": ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")}


async def drive_level(base, model, prompts, concurrency, max_tokens, timeout_s, api_key=None):
    """Closed loop: ``concurrency`` clients each send the next prompt when their last one ends.
    -> (per-request results, wall seconds)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    todo = iter(prompts)
    results: list[dict] = []
    deadline = time.perf_counter() + timeout_s

    async def client_loop(client):
        for prompt in todo:
            if time.perf_counter() > deadline:
                return
            try:
                left = max(deadline - time.perf_counter(), 1.0)
                results.append(await asyncio.wait_for(
                    one_request(client, base, model, prompt, max_tokens, headers), left))
            except (asyncio.TimeoutError, httpx.HTTPError) as err:
                results.append({"ok": False, "error": repr(err)[:300]})

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s)) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return results, time.perf_counter() - t0


def summarize_level(concurrency: int, rounds: list[tuple[list[dict], float]]) -> dict:
    """One level over its rounds (each: the requests' results and the wall time): throughput =
    all tokens / all wall time, percentiles over every request; with several rounds, each
    round's throughput and their sample std too (this 2-core machine drifts by 10-20% over
    minutes, so one short pass per policy can rank two close policies either way)."""
    results = [r for res, _ in rounds for r in res]
    wall = sum(w for _, w in rounds)
    ok = [r for r in results if r["ok"]]
    spec = [r["spec"] for r in ok if r.get("spec")]
    steps = sum(s["decode_steps"] for s in spec)
    level = {"concurrency": concurrency, "requests": len(results), "failed": len(results) - len(ok),
             "wall_s": wall, "output_tokens": sum(r["tokens"] for r in ok),
             "throughput_tok_s": sum(r["tokens"] for r in ok) / wall if wall > 0 else 0.0,
             "ttft_s": percentiles([r["ttft"] for r in ok]),
             "tpot_s": percentiles([r["tpot"] for r in ok if r["tpot"] is not None]),
             # as the server's usage and the engine count it: accepted drafts + 1 per verification step
             "tau": sum(s["accepted_tokens"] + s["decode_steps"] for s in spec) / steps if steps else None,
             "mean_budget": sum(s["mean_budget"] * s["decode_steps"] for s in spec) / steps if steps else None,
             # what the server's prefix cache supplied (OpenAI's usage.prompt_tokens_details), if it says
             "prompt_tokens": _total(r.get("prompt_tokens") for r in ok),
             "cached_prompt_tokens": _total(r.get("cached_tokens") for r in ok),
             "errors": sorted({r.get("error", "")[:120] for r in results if not r["ok"]})[:3]}
    if len(rounds) > 1:
        per = [sum(r["tokens"] for r in res if r["ok"]) / w if w > 0 else 0.0 for res, w in rounds]
        mean = sum(per) / len(per)
        level["rounds"] = len(rounds)
        level["throughput_rounds"] = per
        level["throughput_std"] = (sum((x - mean) ** 2 for x in per) / (len(per) - 1)) ** 0.5
    return level


def _total(values) -> int | None:
    """The sum of the values reported (None where no request reported one)."""
    given = [v for v in values if v is not None]
    return sum(given) if given else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def without_option(args: list[str], name: str) -> list[str]:
    """``args`` minus every ``name VALUE`` / ``name=VALUE``."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


class LocalServer:
    """``specdec-serve`` with one policy, in a subprocess on a free loopback port."""

    def __init__(self, policy: str, server_args: list[str], log_path: Path, startup_s: float = 300.0):
        self.port, self.log_path = free_port(), log_path
        if policy == "plain":  # the same server without its drafter (plain takes no head)
            server_args = without_option(server_args, "--head")
        cmd = [sys.executable, "-m", "specdec.infer.server.cli", *server_args]
        # after the user's arguments: argparse keeps the last value, so the policy always wins
        cmd += ["--method", "plain"] if policy == "plain" else ["--spec-policy", policy]
        self.cmd = cmd + ["--host", "127.0.0.1", "--port", str(self.port)]
        self.startup_s = startup_s
        self.base = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "w")  # a file, not a pipe: a chatty server never blocks on it
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.close()
                tail = self.log_path.read_text()[-2000:]
                raise BenchError(f"server exited with {self.proc.returncode} (log {self.log_path}):\n{tail}")
            try:
                if httpx.get(self.base + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise BenchError(f"server did not become healthy within {self.startup_s:.0f} s")

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # drains, then exits
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.exit_code = self.proc.returncode
        self.log.close()


def served_model(base: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(base + "/v1/models", headers=headers, timeout=10.0)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def write_report(report: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "serve_bench.json", out / "serve_bench.md", out / "serve_bench.png"]
    paths[0].write_text(json.dumps(report, indent=1))
    fmt = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731
    spread = lambda lv: f" ± {lv['throughput_std']:.1f}" if "throughput_std" in lv else ""  # noqa: E731
    cached = lambda lv: ("-" if lv.get("cached_prompt_tokens") is None or not lv.get("prompt_tokens")  # noqa: E731
                         else f"{100 * lv['cached_prompt_tokens'] / lv['prompt_tokens']:.0f}%")
    rounds = report.get("rounds", 1)
    lines = [f"# specdec-bench --serve ({report['model']}, max_tokens {report['max_tokens']})", "",
             *([f"{rounds} rounds per level, the policies taking turns; tok/s over all rounds ± the std of "
                "the rounds' own", ""] if rounds > 1 else []),
             "| policy | conc | req | fail | tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | τ | budget "
             "| prompt cached |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, levels in report["runs"].items():
        for lv in levels:
            ms = lambda d, k: None if d[k] is None else 1000 * d[k]  # noqa: E731
            lines.append(f"| {name} | {lv['concurrency']} | {lv['requests']} | {lv['failed']} | "
                         f"{fmt(lv['throughput_tok_s'])}{spread(lv)} | {fmt(ms(lv['ttft_s'], 'p50'))} | "
                         f"{fmt(ms(lv['ttft_s'], 'p99'))} | {fmt(ms(lv['tpot_s'], 'p50'))} | "
                         f"{fmt(ms(lv['tpot_s'], 'p99'))} | {fmt(lv['tau'], '{:.2f}')} | "
                         f"{fmt(lv['mean_budget'], '{:.1f}')} | {cached(lv)} |")
    if report.get("step_logs"):
        lines += ["", *step_logs.markdown(report["step_logs"])]
    paths[1].write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, levels in report["runs"].items():
        ax.plot([lv["concurrency"] for lv in levels], [lv["throughput_tok_s"] for lv in levels], marker="o",
                label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(report["concurrency"], [str(c) for c in report["concurrency"]])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"throughput vs concurrency: {report['model']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[2], dpi=120)
    plt.close(fig)
    return paths


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="specdec-bench --serve", description=__doc__.split("\n")[0])
    p.add_argument("--endpoint", help="an already running OpenAI-compatible server (loopback only)")
    p.add_argument("--policies", default=",".join(POLICIES), help="server runs to compare (ignored with --endpoint)")
    p.add_argument("--concurrency", default="1,2,4,8,16,32")
    p.add_argument("--num-prompts", type=int, default=0, help="requests per level (default 4 × concurrency, ≥ 16)")
    p.add_argument("--warmup", type=int, default=4,
                   help="requests sent to each server (2 at a time) before the measured levels, not counted: "
                        "a fresh server pays first-time costs (kernel set-up per shape, allocations)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1,
                   help="passes per level and policy, the policies taking turns (throughput over all passes, "
                        "plus each pass's and their std)")
    p.add_argument("--level-timeout-s", type=float, default=300.0, help="time bound of one concurrency level")
    p.add_argument("--questions", help="Spec-Bench question.jsonl (default: the shipped one)")
    p.add_argument("--model", help="model name to request (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"))
    p.add_argument("--out", default="runs/bench/serve")
    p.add_argument("--step-logs", action="store_true",
                   help="each server writes one JSON line per engine step to OUT/steps-POLICY.jsonl "
                        "(specdec-serve --step-log): where each policy's step time goes, side by side")
    p.add_argument("server_args", nargs=argparse.REMAINDER,
                   help="after `--`: arguments for specdec-serve (e.g. -- --target X --head DIR)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    server_args = [a for a in args.server_args if a != "--"]
    try:
        base = check_loopback(args.endpoint) if args.endpoint else None
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
        if not levels or min(levels) < 1 or max(levels) > 256:
            raise BenchError("--concurrency takes integers in 1..256")
        need = max(args.num_prompts or max(4 * c, 16) for c in levels)
        if args.warmup < 0:
            raise BenchError("--warmup takes a count >= 0")
        prompts = load_prompts(args.questions, need + args.warmup)
        warmup, prompts = prompts[need:], prompts[:need]  # warm-up prompts are not measured ones
        if args.rounds < 1:
            raise BenchError("--rounds takes a count >= 1")
        model = args.model
        if base:
            targets = [("endpoint", None)]
        else:
            targets = [(p.strip(), p.strip()) for p in args.policies.split(",") if p.strip()]
            bad = [p for _, p in targets if p not in POLICIES]
            if bad:
                raise BenchError(f"unknown policies {bad}; choose from {', '.join(POLICIES)}")
            if len({p for _, p in targets}) != len(targets):
                raise BenchError(f"policies repeat in {args.policies!r}: each runs once per round (see --rounds)")
        passes: dict[str, dict[int, list]] = {name: {c: [] for c in levels} for name, _ in targets}
        out = Path(args.out)
        log_path = lambda policy: out / f"steps-{policy}.jsonl"  # noqa: E731

        def step_log(policy: str) -> list[str]:  # a fresh file per run (the server appends)
            if not args.step_logs:
                return []
            log_path(policy).unlink(missing_ok=True)
            return ["--step-log", str(log_path(policy))]

        with contextlib.ExitStack() as stack:
            # Every policy's server is up at once and the policies take turns at each level (the
            # order rotating per round), so a slow spell of the machine hits all of them alike.
            servers = {name: stack.enter_context(LocalServer(policy, server_args + step_log(policy),
                                                             out / f"server-{policy}.log"))
                       for name, policy in targets if policy}
            urls = {name: servers[name].base if name in servers else base for name, _ in targets}
            for name, _ in targets:
                model = model or served_model(urls[name], args.api_key)
                if warmup:
                    asyncio.run(drive_level(urls[name], model, warmup, 2, args.max_tokens, args.level_timeout_s,
                                            args.api_key))
            for c in levels:
                n = args.num_prompts or max(4 * c, 16)
                for r in range(args.rounds):
                    for name, _ in targets[r % len(targets):] + targets[:r % len(targets)]:
                        res, wall = asyncio.run(drive_level(urls[name], model, prompts[:n], c, args.max_tokens,
                                                            args.level_timeout_s, args.api_key))
                        passes[name][c].append((res, wall))
                        one = summarize_level(c, [(res, wall)])
                        print(f"{name:>9} c={c:<3} {one['throughput_tok_s']:8.1f} tok/s  "
                              f"TTFT p50 {one['ttft_s']['p50'] or 0:.3f}s  τ {one['tau'] or 0:.2f}  "
                              f"failed {one['failed']}" + (f"  (round {r + 1})" if args.rounds > 1 else ""),
                              file=sys.stderr)
        runs = {name: [summarize_level(c, passes[name][c]) for c in levels] for name, _ in targets}
        servers = {name: {"command": s.cmd, "exit_code": s.exit_code, "log": str(s.log_path)}
                   for name, s in servers.items()}
        report = {"model": model, "max_tokens": args.max_tokens, "concurrency": levels, "warmup": len(warmup),
                  "rounds": args.rounds, "runs": runs, "servers": servers}
        if args.step_logs and servers:
            report["step_logs"] = {name: step_logs.summarize(log_path(policy)) for name, policy in targets
                                   if policy and log_path(policy).exists()}
        for path in write_report(report, out):
            print(path)
    except (BenchError, ValueError) as err:
        print(f"specdec-bench --serve: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
