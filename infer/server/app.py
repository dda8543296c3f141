"""FastAPI routes of the OpenAI-compatible server: auth, errors, completions, streaming."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import (APIError, ChatRequest, CompletionRequest, chat_text, check_max_tokens, check_unsupported,
                       parse_request, sampling_fields)
from .scheduler import Draining, QueueFull, RequestHandle, Scheduler

log = logging.getLogger("specdec.serve")


@dataclass
class ServerConfig:
    model_name: str
    max_len: int  # context: prompt + completion tokens
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None  # default: max_len - 1
    default_max_tokens: int = 256  # chat requests without max_tokens (completions: OpenAI's 16)
    aliases: tuple[str, ...] = ()  # other names accepted for the model (the target's own name)
    allowed_origins: tuple[str, ...] = ()  # CORS: web pages that may call the API from a browser ("*": any)


def create_app(scheduler: Scheduler, tokenizer, config: ServerConfig, sampling_params_cls) -> FastAPI:
    """The app; ``sampling_params_cls`` is the engine's ``SamplingParams``."""

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.config = scheduler, config
    if config.allowed_origins:  # a browser's preflight (OPTIONS) is answered here, before auth and routes
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    metrics = scheduler.metrics
    key = config.api_key.encode() if config.api_key else None
    max_prompt = config.max_prompt_tokens or config.max_len - 1

    @app.exception_handler(APIError)
    async def _api_error(request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, err):  # unknown route, wrong method
        return JSONResponse(APIError(err.status_code, str(err.detail)).body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def _crash(request, err):
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=err)
        return JSONResponse(APIError(500, "internal server error", "server_error").body(), status_code=500)

    def authorize(request: Request) -> None:
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # compare_digest: the time taken does not reveal how much of the key matched
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")

    async def read_json(request: Request):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > config.max_body_bytes):
            raise APIError(413, f"request body larger than {config.max_body_bytes} bytes", code="body_too_large")
        body = bytearray()
        async for chunk in request.stream():  # bounded even when Content-Length lies or is absent
            body += chunk
            if len(body) > config.max_body_bytes:
                raise APIError(413, f"request body larger than {config.max_body_bytes} bytes",
                               code="body_too_large")
        try:
            data = json.loads(body.decode("utf-8"))
            # "\ud800" escapes decode to lone surrogates, which the tokenizer cannot take (a 500)
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeDecodeError as err:
            raise APIError(400, f"request body is not valid UTF-8: {err.reason} at byte {err.start}",
                           code="invalid_utf8")
        except UnicodeEncodeError as err:
            raise APIError(400, f"request body has an unpaired surrogate escape ({err.object[err.start]!r}) "
                           "in a string", code="invalid_utf8")
        except RecursionError:  # the parser recurses per level: [[[[...]]]] 1,000 deep overflows it
            raise APIError(400, "request body is not valid JSON: nested too deeply", code="invalid_json")
        except ValueError as err:
            raise APIError(400, f"request body is not valid JSON: {err}", code="invalid_json")
        return data

    def check_model(name: str) -> None:
        if name != config.model_name and name not in config.aliases:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {config.model_name!r}",
                           param="model", code="model_not_found")

    def check_prompt(ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        if len(ids) > max_prompt:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this server accepts at most {max_prompt}",
                           param=param, code="context_length_exceeded")
        vocab = len(tokenizer)
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param=param)

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=True)["input_ids"]

    def submit(prompt_ids, req, max_param, default_max, prefix) -> RequestHandle:
        fields = sampling_fields(req, default_max)
        max_tokens = check_max_tokens(getattr(req, max_param), max_param, len(prompt_ids), config.max_len,
                                      default_max)
        try:
            params = sampling_params_cls(max_tokens=max_tokens, **fields)
        except ValueError as err:  # the engine's own checks, should ours have missed one
            raise APIError(400, str(err))
        try:
            handle = scheduler.submit(prompt_ids, params, prefix)
        except QueueFull as err:
            raise APIError(429, f"server busy: {err}; retry later", "rate_limit_error", code="queue_full")
        except Draining:
            raise APIError(503, "the server is shutting down", "service_unavailable", code="draining")
        return handle

    # --- routes ------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        status = "draining" if scheduler.draining else "ok"
        return JSONResponse({"status": status}, status_code=503 if scheduler.draining else 200)

    @app.get("/metrics")
    async def prometheus(request: Request):
        authorize(request)
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "specdec", "max_model_len": config.max_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        req = parse_request(CompletionRequest, await read_json(request))
        check_model(req.model)
        check_unsupported(req)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        ids = await asyncio.to_thread(encode, prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt(ids, "prompt")
        handle = submit(ids, req, "max_tokens", 16, "cmpl")
        return await respond(request, handle, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        req = parse_request(ChatRequest, await read_json(request))
        check_model(req.model)
        check_unsupported(req)
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, f"model {config.model_name!r} has no chat template; use /v1/completions")
        # the deprecated max_tokens still works; errors name whichever field the client sent
        max_param = "max_tokens" if req.max_completion_tokens is None and req.max_tokens is not None \
            else "max_completion_tokens"
        messages = chat_text(req.messages)  # its own errors are not the template's
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=req.add_generation_prompt is not False,
                continue_final_message=bool(req.continue_final_message))
        except Exception as err:  # jinja templates raise on role orders they do not support
            raise APIError(400, f"the chat template rejected these messages: {err}", param="messages")
        ids = await asyncio.to_thread(lambda: tokenizer(text, add_special_tokens=False)["input_ids"])
        check_prompt(ids, "messages")
        handle = submit(ids, req, max_param, config.default_max_tokens, "chatcmpl")
        return await respond(request, handle, req, chat=True)

    # --- responses ---------------------------------------------------------------------
    def usage(handle: RequestHandle) -> dict:
        n = len(handle.prompt_ids)
        return {"prompt_tokens": n, "completion_tokens": handle.tokens, "total_tokens": n + handle.tokens,
                "prompt_tokens_details": {"cached_tokens": handle.cached_tokens},  # OpenAI's field
                "speculation": handle.speculation()}

    def record(handle, endpoint, outcome):
        ttft = None if handle.first_token_at is None else handle.first_token_at - handle.created
        metrics.on_finish(endpoint, outcome, len(handle.prompt_ids), handle.tokens,
                          time.monotonic() - handle.created, ttft, handle.cached_tokens)

    async def pieces(handle: RequestHandle):
        """(text, finish_reason or None) as tokens arrive (the engine applies stop strings and eos)."""
        async for delta in handle.deltas():
            if delta.error is not None:
                raise APIError(500, f"generation failed: {delta.error}", "server_error")
            if delta.finished:
                yield delta.text, "length" if delta.finish_reason == "length" else "stop"
            elif delta.text:
                yield delta.text, None

    async def respond(request: Request, handle, req, chat: bool):
        endpoint = "chat" if chat else "completions"
        base = {"id": handle.id, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": config.model_name}
        if req.stream:
            include_usage = bool((req.stream_options or {}).get("include_usage"))
            return StreamingResponse(sse(handle, base, chat, include_usage, endpoint),
                                     media_type="text/event-stream")
        parts, reason = [], None
        task = asyncio.ensure_future(collect(handle, parts))
        try:
            while not task.done():  # watch for the client leaving while we generate
                await asyncio.wait({task}, timeout=0.25)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    scheduler.abort(handle.id)
                    record(handle, endpoint, "disconnected")
                    return Response(status_code=499)
            reason = task.result()
        except APIError:
            record(handle, endpoint, "error")
            raise
        finally:
            if not task.done():
                task.cancel()
        record(handle, endpoint, "ok")
        content = "".join(parts)
        choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                   "finish_reason": reason} if chat else
                  {"index": 0, "text": content, "logprobs": None, "finish_reason": reason})
        return {**base, "choices": [choice], "usage": usage(handle)}

    async def collect(handle, parts) -> str:
        reason = None
        async for piece, reason in pieces(handle):
            parts.append(piece)
        return reason

    async def sse(handle, base, chat, include_usage, endpoint):
        base = {**base, "object": "chat.completion.chunk" if chat else "text_completion"}

        def chunk(piece, reason, first=False):
            if chat:
                delta = {"role": "assistant", "content": piece} if first else ({"content": piece} if piece else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": reason}
            body = {**base, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        outcome = "disconnected"
        try:
            if chat:
                yield chunk("", None, first=True)
            async for piece, reason in pieces(handle):
                yield chunk(piece, reason)
            if include_usage:
                yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage(handle)})}\n\n"
            yield "data: [DONE]\n\n"
            outcome = "ok"
        except APIError as err:  # headers are gone: report in-band, as OpenAI does
            outcome = "error"
            yield f"data: {json.dumps(err.body())}\n\n"
        finally:
            if not handle.finished:  # the client went away: free its slot
                scheduler.abort(handle.id)
            record(handle, endpoint, outcome)

    return app
