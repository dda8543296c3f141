"""Continuous batching: one background thread drives the Engine step by step.

All torch work happens on that thread (``TorchThread``: the engine is built there too).
The asyncio side talks to it through a thread-safe command queue (``submit`` / ``abort``); results come back as
``Delta`` objects put on each request's ``asyncio.Queue`` with
``loop.call_soon_threadsafe``. Between two engine steps the thread admits
waiting requests into free slots (the engine prefills them in chunks inside
``step``, so a long prompt does not stall the running ones), drops aborted
ones, and asks the speculation controller for this step's budgets.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import queue
import threading
import time
from collections import deque
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field

from .controller import ConfidenceTap, SpeculationController, StepObservation
from .metrics import ServerMetrics

# How often the controller's fitted models reach /metrics: refitting the cost model and pooling
# the acceptance rates every step cost ~0.2 ms (~1% of a batch-4 step); scrapes come every
# few seconds.
MODEL_METRICS_PERIOD_S = 0.5

log = logging.getLogger("specdec.serve")


class QueueFull(Exception):
    """More requests are waiting than the queue allows (HTTP 429)."""


class Draining(Exception):
    """The server is shutting down and takes no new requests (HTTP 503)."""


@dataclass
class Delta:
    """New tokens (and the text they complete) of one request from one engine step."""

    token_ids: list[int]
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    accepted: int = 0  # draft tokens accepted in this step
    error: str | None = None
    cached_tokens: int = 0  # on the finishing delta: prompt tokens the prefix cache supplied
    decoded: bool = False  # a verification step made it (not the prefill's first token): counts for tau


@dataclass
class RequestHandle:
    """The asyncio side's view of one request."""

    id: str
    prompt_ids: list[int]
    params: object  # SamplingParams
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    tokens: int = 0
    accepted: int = 0  # draft tokens accepted over the request
    decode_steps: int = 0  # verification steps; the prefill's first token is none (see ``speculation``)
    budget_nodes: int = 0  # sum of draft nodes chosen for it, for the mean budget
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    finished: bool = False

    async def deltas(self):
        """Yield this request's deltas until (and including) the finishing one."""
        while not self.finished:
            delta: Delta = await self.queue.get()
            if delta.token_ids:
                self.first_token_at = self.first_token_at or time.monotonic()
                self.tokens += len(delta.token_ids)
            if delta.decoded:
                self.decode_steps += 1
                self.accepted += delta.accepted
            self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
            self.finished = delta.finished
            yield delta

    def speculation(self) -> dict:
        """tau as the engine's ``Request.stats`` (and so ``specdec-generate``) counts it: tokens per
        verification step, accepted drafts + 1 each, the prefill's first token left out."""
        steps = max(self.decode_steps, 1)
        return {"accepted_tokens": self.accepted, "decode_steps": self.decode_steps,
                "tau": round((self.accepted + self.decode_steps) / steps, 4) if self.decode_steps else 1.0,
                "mean_budget": round(self.budget_nodes / steps, 3)}


class StepLog:
    """``specdec-serve --step-log FILE``: one JSON line per engine step, saying where its time went
    (``gap_ms``: since the previous step ended, i.e. commands, admission and any idle wait;
    ``plan_ms``: the controller's choice; ``engine_ms``, of which ``decode_ms`` decoding; ``after_ms``:
    feedback, deltas and metrics) and what was decided (``batch``, ``prefill_tokens``, ``tokens``
    verified, draft ``nodes`` chosen, ``accepted`` drafts, the policy's ``arm``). Two servers' logs on
    the same load say whether a policy loses in the engine or around it. Written on the engine
    thread, flushed about once a second."""

    FLUSH_S = 1.0

    def __init__(self, path: str):
        try:
            self._file = open(path, "a", encoding="utf-8")
        except OSError as err:
            raise OSError(f"cannot write the step log {path}: {err.strerror or err}") from err
        self._start = self._flushed = time.monotonic()

    def write(self, record: dict) -> None:
        now = time.monotonic()
        self._file.write(json.dumps({"t": round(now - self._start, 4), **record}) + "\n")
        if now - self._flushed >= self.FLUSH_S:
            self._file.flush()
            self._flushed = now

    def close(self) -> None:
        self._file.close()


class TorchThread:
    """The one thread that makes every torch call of the server: loading, and then the engine loop.

    Each thread that runs torch ops gets its own OpenMP team; with two teams on a 2-core CPU
    libgomp throttles its spinning and every parallel region waits on a futex wake-up
    (measured: a decode loop on a second thread after loading on the main one ran at 26 tok/s
    instead of 41; everything on one thread, whichever, 42). ``call(fn)`` runs fn there and
    returns its result (or raises its error); ``submit(fn)`` starts fn there and returns its
    ``concurrent.futures.Future``.
    """

    def __init__(self, name: str = "specdec-engine"):
        self._jobs: queue.Queue = queue.Queue()
        # A daemon thread (unlike a ThreadPoolExecutor's): a step stuck at exit cannot hold it up.
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            fn, future = self._jobs.get()
            try:
                future.set_result(fn())
            except BaseException as err:  # handed to the caller
                future.set_exception(err)

    def submit(self, fn) -> Future:
        future: Future = Future()
        self._jobs.put((fn, future))
        return future

    def call(self, fn):
        return self.submit(fn).result()


class Scheduler:
    """Owns the engine loop (on a ``TorchThread``), the waiting queue and the per-step controller call."""

    def __init__(self, engine, controller: SpeculationController | None, metrics: ServerMetrics,
                 max_batch: int, max_queue: int = 256, idle_poll_s: float = 0.5,
                 torch_thread: TorchThread | None = None, step_log: StepLog | None = None):
        self.engine, self.controller, self.metrics = engine, controller, metrics
        self.max_batch, self.max_queue, self.idle_poll_s = max_batch, max_queue, idle_poll_s
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0  # submitted but not yet holding a slot (guarded by _lock)
        self._waiting: deque[RequestHandle] = deque()  # engine thread only
        self._running: dict[str, RequestHandle] = {}  # engine thread only
        self._ids = itertools.count()
        self._torch_thread = torch_thread  # where the engine was built (None: a new one at start)
        self._loop_done: Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        self.active = 0  # submitted and not finished (read by the drain logic)
        self._model_metrics_due = 0.0  # time.monotonic() of the next controller-model update
        self.step_log = step_log
        self._step_end = time.perf_counter()  # when the last step's bookkeeping ended (for the step log)

    # --- asyncio side ------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._torch_thread = self._torch_thread or TorchThread()
        self._loop_done = self._torch_thread.submit(self._run)

    def submit(self, prompt_ids: list[int], params, prefix: str = "cmpl") -> RequestHandle:
        if self.draining:
            raise Draining("the server is shutting down")
        with self._lock:
            if self._pending >= self.max_queue:
                raise QueueFull(f"{self._pending} requests are already waiting (limit {self.max_queue})")
            self._pending += 1
            self.active += 1
        handle = RequestHandle(f"{prefix}-{next(self._ids)}-{time.time_ns() % 10**9:09d}", prompt_ids, params)
        self._commands.put(("add", handle))
        return handle

    def abort(self, rid: str) -> None:
        """Free a request's slot (client gone, or a stop string seen on the text side)."""
        self._commands.put(("abort", rid))

    def begin_drain(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.active > 0:
            if deadline is not None and time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def stop(self, timeout: float = 30.0) -> None:
        if self._loop_done is not None and not self._loop_done.done():
            self._commands.put(("stop", None))
            futures.wait([self._loop_done], timeout)

    # --- engine thread -----------------------------------------------------------------
    def _send(self, handle: RequestHandle, delta: Delta) -> None:
        if delta.finished:
            with self._lock:
                self.active -= 1
        self._loop.call_soon_threadsafe(handle.queue.put_nowait, delta)

    def _finish(self, handle: RequestHandle, reason: str, error: str | None = None) -> None:
        self._send(handle, Delta([], "", True, reason, error=error))

    def _run(self) -> None:
        while True:
            idle = not self._running and not self._waiting
            try:
                cmd = self._commands.get(timeout=self.idle_poll_s) if idle else self._commands.get_nowait()
            except queue.Empty:
                cmd = None
            stop = False
            while cmd is not None:  # apply every command that arrived since the last step
                stop |= self._apply(*cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if stop:
                break
            try:
                self._admit()
                self.metrics.on_queue(len(self._waiting), len(self._running))
                if self._running:
                    self._step()
            except Exception:  # fail the batch, keep the server alive for the next requests
                log.exception("engine step failed; aborting %d running requests", len(self._running))
                self._fail_running("internal error while decoding")
        for handle in list(self._running.values()) + list(self._waiting):
            self._finish(handle, "abort", "the server stopped")
        if self.step_log is not None:
            self.step_log.close()

    def _apply(self, kind: str, arg) -> bool:
        if kind == "stop":
            return True
        if kind == "add":
            self._waiting.append(arg)
        elif kind == "abort":
            handle = self._running.pop(arg, None)
            if handle is not None:
                self.engine.abort(arg)
                self._release(arg)
                self._finish(handle, "abort")
            else:
                for h in list(self._waiting):
                    if h.id == arg:
                        self._waiting.remove(h)
                        with self._lock:
                            self._pending -= 1
                        self._finish(h, "abort")
        return False

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_batch:
            handle = self._waiting.popleft()
            with self._lock:
                self._pending -= 1
            try:
                self.engine.add_request(handle.id, handle.prompt_ids, handle.params)
            except Exception as err:  # a request the engine refuses must not stop the others
                log.warning("request %s refused by the engine: %s", handle.id, err)
                self._finish(handle, "error", str(err))
                continue
            self._running[handle.id] = handle

    def _release(self, rid: str) -> None:
        if self.controller is not None:
            self.controller.release(rid)

    def _fail_running(self, why: str) -> None:
        for rid, handle in list(self._running.items()):
            del self._running[rid]
            try:
                self.engine.abort(rid)
                self._release(rid)
            except Exception:
                log.exception("cleanup of %s after a failed step also failed", rid)
            self._finish(handle, "error", why)

    def _step(self) -> None:
        rids = list(self._running)
        t_plan = time.perf_counter()
        budgets = self.controller.plan(rids) if self.controller is not None else None
        t0 = time.perf_counter()
        outputs = self.engine.step(budgets)
        wall = time.perf_counter() - t0
        stats = self.engine.last_step
        obs = observation(stats, wall)
        tap = self.engine.drafter
        if isinstance(tap, ConfidenceTap):
            by_slot = tap.take()
            slot_of = {rid: getattr(r, "slot", None) for rid, r in getattr(self.engine, "running", {}).items()}
            obs.confidence = {rid: by_slot[slot_of[rid]] for rid in obs.accepted if slot_of.get(rid) in by_slot}
        if self.controller is not None and obs.batch_size:
            self.controller.observe(obs)
        used = getattr(stats, "budgets", None) or {}
        new_tokens = 0
        for out in outputs:
            handle = self._running.get(out.request_id)
            if handle is None:
                continue  # aborted in the meantime
            ids = list(out.new_token_ids)
            new_tokens += len(ids)
            if out.request_id in used:
                handle.budget_nodes += used[out.request_id].max_nodes
            delta = Delta(ids, out.new_text, out.finished, out.finish_reason if out.finished else None,
                          accepted=obs.accepted.get(out.request_id, 0),
                          cached_tokens=int(out.stats.get("cached_prompt_tokens", 0)) if out.finished else 0,
                          decoded=out.request_id in obs.accepted)
            if out.finished:
                self._running.pop(out.request_id)
                self._release(out.request_id)
            self._send(handle, delta)
        ctl, rates, cost = self.controller, None, None
        if ctl is not None and time.monotonic() >= self._model_metrics_due:
            self._model_metrics_due = time.monotonic() + MODEL_METRICS_PERIOD_S
            rates, cost = ctl.acceptance.pooled_rates(), ctl.cost.coefficients()
        nodes = [b.max_nodes for b in used.values()]
        self.metrics.on_step(
            obs.batch_size, obs.seconds, new_tokens, len(obs.accepted), sum(obs.accepted.values()), nodes,
            rates, cost)
        if self.step_log is not None:
            end = time.perf_counter()
            ms = lambda s: round(1e3 * s, 3)  # noqa: E731
            self.step_log.write({
                "gap_ms": ms(t_plan - self._step_end), "plan_ms": ms(t0 - t_plan), "engine_ms": ms(wall),
                "decode_ms": ms(obs.decode_seconds), "after_ms": ms(end - t0 - wall), "batch": obs.batch_size,
                "prefill_tokens": obs.prefill_tokens, "tokens": obs.tokens, "nodes": sum(nodes),
                "accepted": sum(obs.accepted.values()), "arm": ctl.last_arm if ctl is not None else None})
            self._step_end = end


def observation(stats, wall: float) -> StepObservation:
    """Engine.last_step -> what the controller learns from (the engine's own timing if it has one)."""
    budgets = dict(getattr(stats, "budgets", None) or {})  # request id -> TreeBudget actually used
    return StepObservation(
        batch_size=int(stats.batch_size),
        # what the verification computed: the engine pads every row to the widest tree
        tokens=int(getattr(stats, "tokens_computed", 0) or stats.tokens_verified),
        seconds=float(stats.seconds or wall),
        accepted=dict(stats.accepted),
        verified=dict(getattr(stats, "verified", None) or {}),
        drafted={r: b.max_depth for r, b in budgets.items()},
        prefill_tokens=int(getattr(stats, "prefill_tokens", 0)),
        decode_seconds=float(getattr(stats, "decode_seconds", 0.0)),
        groups=len({b for b in budgets.values() if b.max_nodes > 0}))
