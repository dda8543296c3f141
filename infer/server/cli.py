"""`specdec-serve`: the OpenAI-compatible server (continuous batching + adaptive speculation).

    specdec-serve                                   # smollm2-135m; eagle3 if a trained head is
                                                    # at runs/smollm2-135m/eagle3/final, else plain
    specdec-serve --target DIR --head HEAD --method eagle3 --spec-policy goodput --port 8000

Binds 127.0.0.1 unless --host says otherwise. With --api-key (or SPECDEC_API_KEY)
every endpoint but /health wants `Authorization: Bearer KEY`. SIGTERM (or Ctrl+C)
stops taking requests (503), lets the running ones finish, then exits; a second
Ctrl+C exits at once.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from pathlib import Path

from specdec.infer.dtypes import AUTO_DECODING_HELP, DTYPE_CHOICES

DEFAULT_HEAD = Path("runs/smollm2-135m/eagle3/final")
log = logging.getLogger("specdec.serve")


def server_grid(top, spec_nodes=None, spec_depth: int | None = None, spec_topk: int | None = None) -> list:
    """The controller's budget levels: ``spec_nodes`` (default: powers of two under ``top``, the
    drafter's own or the device's tree budget, then ``top``'s nodes) spread as ``budget_grid`` does.
    A level of ``top``'s size is ``top`` itself unless depth or width were given: ``budget_grid``
    would make it a chain (12 nodes over 12 levels, one child each), and EAGLE-3's tuned 4-node
    top-3 tree drafted at tau 1.64 where its chain did at 1.44 (16 Spec-Bench first turns, bf16)."""
    from .controller import budget_grid

    if spec_nodes is None:
        spec_nodes = [0] + [n for n in (2, 4, 8, 16, 32, 64, 128) if n < top.max_nodes] + [top.max_nodes]
    grid = budget_grid(spec_nodes, max_depth=spec_depth or top.max_depth, topk=spec_topk or top.topk)
    if spec_depth is None and spec_topk is None:
        grid = [top if level.max_nodes == top.max_nodes else level for level in grid]
    return grid


def build_app(target, method: str = "plain", head=None, *, dtype=None, device="cpu", max_batch: int = 8,
              max_len: int | None = None, policy: str = "goodput", spec_nodes=None, spec_depth: int | None = None,
              spec_topk: int | None = None, fixed_nodes: int | None = None, disable_batch_size: int = 8,
              cost_profile: str | None = None, max_queue: int = 256, served_model_name: str | None = None,
              api_key: str | None = None, max_body_bytes: int = 1 << 20, max_prompt_tokens: int | None = None,
              default_max_tokens: int = 256,
              prefill_chunk: int | None = 512, prefix_cache_mb: float = 1024, drafter_opts: dict | None = None,
              step_log: str | None = None, allowed_origins: tuple[str, ...] = ()):
    """Engine + controller + scheduler + FastAPI app for ``target`` (a Target or a name).

    The budget grid (``spec_nodes`` / ``spec_depth`` / ``spec_topk``) defaults to the drafter's
    (or the device's) default tree budget as its top level, with powers of two below it.
    ``step_log``: a file to append one JSON line per engine step to (``StepLog``).
    """
    from specdec.infer.drafters import make_drafter
    from specdec.infer.engine import Engine, SamplingParams
    from specdec.infer.dtypes import dtype_name
    from specdec.infer.target import Target, load_target

    from .app import ServerConfig, create_app
    from .controller import ConfidenceTap, make_controller
    from .costmodel import CostModel, default_prior
    from .metrics import ServerMetrics
    from .scheduler import Scheduler, StepLog, TorchThread

    if dtype is not None:  # one concrete dtype for the target and the engine
        dtype = dtype_name(dtype, device, decoding=True)
    steps = StepLog(step_log) if step_log else None  # opened first: a bad path fails before loading

    def build_engine():
        nonlocal target
        if not isinstance(target, Target):
            target = load_target(target, dtype=dtype or "float32", device=device)
        # dtype None: the engine runs a loaded target in the target's own dtype
        drafter = make_drafter(method, target, head=head, **(drafter_opts or {}))
        if drafter is not None:  # lets the controller read each tree's confidence (its scores)
            drafter = ConfidenceTap(drafter)
        return Engine(target, drafter, max_batch=max_batch, max_len=max_len, dtype=dtype, device=device,
                      prefill_chunk=prefill_chunk, prefix_cache_bytes=int(prefix_cache_mb * 2**20))

    torch_thread = TorchThread()  # every torch call on one thread (see TorchThread)
    engine = torch_thread.call(build_engine)
    drafter = engine.drafter
    controller = None
    if drafter is not None:
        grid = server_grid(engine.default_budget, spec_nodes, spec_depth, spec_topk)
        cost = (CostModel.load(cost_profile) if cost_profile and Path(cost_profile).exists()
                else CostModel(prior=default_prior(device)))
        controller = make_controller(policy, grid=grid, cost=cost, fixed_nodes=fixed_nodes,
                                     disable_batch_size=disable_batch_size)
    name = served_model_name or target.name
    metrics = ServerMetrics()
    scheduler = Scheduler(engine, controller, metrics, max_batch=max_batch, max_queue=max_queue,
                          torch_thread=torch_thread, step_log=steps)
    config = ServerConfig(model_name=name, max_len=engine.max_len, api_key=api_key, max_body_bytes=max_body_bytes,
                          max_prompt_tokens=max_prompt_tokens, default_max_tokens=default_max_tokens,
                          aliases=(target.name,), allowed_origins=tuple(allowed_origins))
    app = create_app(scheduler, target.tokenizer, config, SamplingParams)
    app.state.method, app.state.controller = method, controller
    return app


def make_server(app, host: str = "127.0.0.1", port: int = 8000, drain_timeout_s: float = 60.0,
                log_level: str = "info"):
    """A uvicorn server whose first SIGTERM/SIGINT drains the scheduler before exiting."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            scheduler = app.state.scheduler
            if scheduler.draining:  # second signal: stop now
                self.should_exit = self.force_exit = True
                return
            scheduler.begin_drain()
            log.info("signal %s: draining %d in-flight requests (up to %.0f s)", sig, scheduler.active,
                     drain_timeout_s)
            threading.Thread(target=self._exit_when_idle, daemon=True).start()

        def _exit_when_idle(self):
            deadline = time.monotonic() + drain_timeout_s
            while app.state.scheduler.active > 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            self.should_exit = True

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            access_log=log_level == "debug")
    return DrainingServer(config)


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on, found before the model loads (uvicorn finds out
    only once it has): the port taken, the host not this machine's."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no problem
            sock.bind((host, port))
    except OSError as err:
        return f"cannot listen on {host}:{port}: {err.strerror or err}"
    return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="specdec-serve", description=__doc__.split("\n")[0])
    p.add_argument("--target", default=None, help="embedded name, HF folder, .gguf or hub id "
                                                  "(default: the --head's own target, else smollm2-135m)")
    p.add_argument("--head", help=f"trained head folder (default: {DEFAULT_HEAD} if it exists)")
    p.add_argument("--method", help="plain, a head method (eagle3, medusa, ...) or pld/lookahead/...; "
                   "default: the head's own method with a head, else plain")
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES,
                   help=f"target dtype; {AUTO_DECODING_HELP} (default: %(default)s)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $SPECDEC_API_KEY)")
    p.add_argument("--allowed-origins", default="*", metavar="ORIGINS",
                   help="CORS: comma-separated origins whose web pages may call the API from a browser, "
                        "'' for none (default: %(default)s, any, as vLLM)")
    p.add_argument("--served-model-name", help="model id clients ask for (default: the target's name)")
    p.add_argument("--max-batch", type=int, default=16, help="sequences decoded together (KV slots)")
    p.add_argument("--max-len", type=int, default=None,
                   help="context per slot: prompt + completion tokens (default: 2048, or the target's "
                        "max_position_embeddings if fewer; more than that is refused)")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests before 429")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="prompt tokens prefilled per step, so long prompts do not stall running requests")
    p.add_argument("--prefix-cache-mb", type=float, default=1024,
                   help="memory for prefilled prompts' K/V: a prompt that starts like an earlier one (a shared "
                        "system prompt, the next turn of a chat) reuses that prefix instead of prefilling it "
                        "again, as vLLM's and SGLang's prefix caching do (0: off; default 1024)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--max-prompt-tokens", type=int, help="longer prompts get 400 (default: max-len - 1)")
    p.add_argument("--default-max-tokens", type=int, default=256, help="chat completions without max_tokens")
    p.add_argument("--spec-policy", default="goodput", choices=["goodput", "always", "threshold", "thompson"])
    p.add_argument("--spec-nodes", help="budget grid: draft nodes per request, e.g. 0,2,4,8,16 "
                   "(default: powers of two up to the drafter's default tree budget)")
    p.add_argument("--spec-depth", type=int, help="deepest draft level of the grid (default: the drafter's)")
    p.add_argument("--spec-topk", type=int, help="widest branching of the grid (default: the drafter's)")
    p.add_argument("--spec-budget", type=int, help="nodes for always/threshold (default: the grid's largest)")
    p.add_argument("--spec-disable-batch-size", type=int, default=8, help="threshold: plain at this batch size")
    p.add_argument("--cost-profile", help="JSON step-cost model: loaded if present, saved on exit")
    p.add_argument("--step-log", metavar="FILE",
                   help="append one JSON line per engine step to FILE: its time split (gap, plan, engine, "
                        "after), batch, tokens verified, draft nodes, accepted drafts and the policy's arm, "
                        "to see where a policy wins or loses time")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="drafter option (repeatable), as specdec-generate's, e.g. --method rest "
                        "--opt datastore=DIR (a datastore from specdec-data datastore)")
    p.add_argument("--drain-timeout-s", type=float, default=60.0)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def resolve_method(args) -> tuple[str, str | None]:
    from specdec.infer.drafters import default_method, default_target
    from specdec.infer.target import DEFAULT_TARGET

    head = args.head
    args.target = default_target(args.target, head)
    if head is None and args.method in (None, "eagle3") and args.target == DEFAULT_TARGET and DEFAULT_HEAD.is_dir():
        head = str(DEFAULT_HEAD)
    method = args.method or default_method(head)
    return method, head


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    method, head = resolve_method(args)
    try:
        nodes = tuple(int(x) for x in args.spec_nodes.split(",") if x.strip()) if args.spec_nodes else None
    except ValueError:
        print(f"specdec-serve: --spec-nodes wants integers like 0,2,4,8, got {args.spec_nodes!r}", file=sys.stderr)
        return 2
    from specdec.infer.generate import parse_opts

    drafter_opts = parse_opts(args.opt, prog="specdec-serve")
    if args.prefix_cache_mb < 0:
        print(f"specdec-serve: --prefix-cache-mb must be >= 0 (0: off), got {args.prefix_cache_mb}", file=sys.stderr)
        return 2
    # Below 1 these refuse every request, and the client is told it sent something wrong
    # (--default-max-tokens 0: "max_tokens must be >= 1" to a chat request that sent none).
    for flag in ("max_queue", "default_max_tokens", "max_prompt_tokens", "max_body_bytes"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            print(f"specdec-serve: --{flag.replace('_', '-')} must be >= 1, got {value}", file=sys.stderr)
            return 2
    problem = port_problem(args.host, args.port)
    if problem:
        print(f"specdec-serve: {problem} (another server there? choose --port)", file=sys.stderr)
        return 2
    from specdec.infer.target import resolve_device

    try:
        app = build_app(args.target, method, head, dtype=args.dtype, device=resolve_device(args.device), max_batch=args.max_batch,
                        max_len=args.max_len, policy=args.spec_policy, spec_nodes=nodes, spec_depth=args.spec_depth,
                        spec_topk=args.spec_topk, fixed_nodes=args.spec_budget,
                        disable_batch_size=args.spec_disable_batch_size, cost_profile=args.cost_profile,
                        max_queue=args.max_queue, served_model_name=args.served_model_name, api_key=args.api_key,
                        max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                        default_max_tokens=args.default_max_tokens,
                        prefill_chunk=args.prefill_chunk, prefix_cache_mb=args.prefix_cache_mb,
                        step_log=args.step_log, drafter_opts=drafter_opts,
                        allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()))
    except (ValueError, RuntimeError, OSError) as err:
        print(f"specdec-serve: {err}", file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach it can use it", args.host)
    log.info("serving %s (method %s, policy %s) on http://%s:%d", app.state.config.model_name, method,
             args.spec_policy if app.state.controller else "-", args.host, args.port)
    make_server(app, args.host, args.port, args.drain_timeout_s, args.log_level).run()
    if args.cost_profile and app.state.controller is not None:
        app.state.controller.cost.save(args.cost_profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
