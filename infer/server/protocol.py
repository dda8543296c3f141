"""OpenAI wire format: request validation and the error shape.

Everything a client sends is validated here into plain values; a bad field
raises ``APIError`` (rendered as ``{"error": {"message","type","param","code"}}``).
Types are strict (``"5"`` is not an integer), unsupported features (n > 1,
logprobs, tools, penalties) are refused rather than silently ignored.
"""
from __future__ import annotations

import re
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
from pydantic import ValidationError


class APIError(Exception):
    """An error returned to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


Number = Union[StrictInt, StrictFloat]


class _Common(BaseModel):
    # Unknown fields are ignored as OpenAI does (clients send e.g. `user`); known ones are strict.
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None  # extension (vLLM): 0 or -1 = off
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = 1
    stream: StrictBool | None = False
    stream_options: dict | None = None
    presence_penalty: Number | None = 0
    frequency_penalty: Number | None = 0
    logit_bias: dict | None = None
    ignore_eos: StrictBool | None = False  # extension (vLLM), for benchmarks
    stop_token_ids: list[StrictInt] | None = None  # extension (vLLM)
    # vLLM's other sampling extensions: named so that they are refused (check_unsupported), not
    # ignored as unknown fields are: a client moving from vLLM would get a different output silently
    repetition_penalty: Number | None = 1
    min_p: Number | None = 0
    min_tokens: StrictInt | None = 0
    use_beam_search: StrictBool | None = False
    include_stop_str_in_output: StrictBool | None = False


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool | None = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class ContentPart(BaseModel):
    # Any type passes here so that an image part gets "only text" (chat_text), not a schema error.
    model_config = ConfigDict(extra="ignore")
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    tools: list | None = None
    response_format: dict | None = None
    # extensions (vLLM): continue_final_message carries on the last (assistant) message's text
    add_generation_prompt: StrictBool | None = True
    continue_final_message: StrictBool | None = False


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object",
               type(None): "null"}


# pydantic names union branches in the error location ("str", "list[int]", "list[ContentPart]");
# matched whole, so that fields named like a type ("stream", "stream_options") are not taken for one
_TYPE_TAG = re.compile(r"(int|float|str|bool|none)|(list|dict|literal)\[.*\]")


def _is_type_tag(part) -> bool:
    return isinstance(part, str) and _TYPE_TAG.fullmatch(part) is not None


def _value_at(data, path):
    """The client's value at an error location (None where the path leaves the body)."""
    for key in path:
        try:
            data = data[key]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def parse_request(kind: type[BaseModel], data) -> BaseModel:
    """Validate a decoded JSON body; the error names the first bad field and what it expected."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return kind.model_validate(data)
    except ValidationError as err:
        errors = err.errors()
        first = errors[0]
        path = [p for p in first["loc"] if not _is_type_tag(p)]
        where = ".".join(str(p) for p in path) or "(body)"
        param = str(path[0]) if path else None
        if first["type"] == "missing":
            raise APIError(400, f"missing required field {where}", param=param, code="missing_required_parameter")
        # A union fails once per branch: list the accepted types instead of the first branch's message.
        at = next((i for i, p in enumerate(first["loc"]) if _is_type_tag(p)), None)
        union = first["loc"][:at]
        tags = [e["loc"][at] for e in errors if at is not None and len(e["loc"]) > at
                and e["loc"][:at] == union and _is_type_tag(e["loc"][at])]
        if len(tags) > 1:
            got = _JSON_TYPES.get(type(_value_at(data, union)), "value")
            msg = f"expected {' or '.join(dict.fromkeys(tags))}, got {got}"
        else:
            msg = first["msg"]
        raise APIError(400, f"invalid field {where}: {msg}", param=param, code="invalid_type")


def check_unsupported(req) -> None:
    """Refuse what this server cannot honour, naming the field."""
    if req.n not in (None, 1):
        raise APIError(400, "only n=1 is supported", param="n")
    if req.stream_options is not None and not req.stream:  # as OpenAI and vLLM answer it
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    checks = [("presence_penalty", req.presence_penalty not in (None, 0)),
              ("frequency_penalty", req.frequency_penalty not in (None, 0)),
              ("logit_bias", bool(req.logit_bias)),
              ("repetition_penalty", req.repetition_penalty not in (None, 1)),
              ("min_p", req.min_p not in (None, 0)),
              ("min_tokens", req.min_tokens not in (None, 0)),
              ("use_beam_search", bool(req.use_beam_search)),
              ("include_stop_str_in_output", bool(req.include_stop_str_in_output)),
              # completions' logprobs=0 still asks for the sampled tokens' own (chat's is a boolean)
              ("logprobs", req.logprobs is not None and req.logprobs is not False)]
    if isinstance(req, CompletionRequest):
        checks += [("echo", bool(req.echo)), ("best_of", req.best_of not in (None, 1)),
                   ("suffix", bool(req.suffix))]
    else:
        checks += [("tools", bool(req.tools)), ("top_logprobs", bool(req.top_logprobs)),
                   ("response_format", (req.response_format or {}).get("type", "text") != "text")]
    for name, bad in checks:
        if bad:
            raise APIError(400, f"{name} is not supported by this server", param=name)
    if isinstance(req, ChatRequest) and req.continue_final_message and req.add_generation_prompt is not False:
        raise APIError(400, "continue_final_message needs add_generation_prompt=false (as in vLLM): a reply "
                       "cannot both start a new message and carry on the last one", param="continue_final_message")


def sampling_fields(req, max_tokens_default: int, max_stop: int = 4) -> dict:
    """Checked sampling values (keyword arguments of ``SamplingParams``, less max_tokens)."""
    temperature = 1.0 if req.temperature is None else float(req.temperature)
    if not 0.0 <= temperature <= 2.0:
        raise APIError(400, f"temperature must be in [0, 2], got {temperature}", param="temperature")
    top_p = 1.0 if req.top_p is None else float(req.top_p)
    if not 0.0 < top_p <= 1.0:
        raise APIError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
    top_k = req.top_k or 0
    if top_k < -1:
        raise APIError(400, f"top_k must be -1, 0 (off) or positive, got {top_k}", param="top_k")
    if req.seed is not None and not -(2 ** 63) <= req.seed < 2 ** 63:
        raise APIError(400, "seed must fit in 64 bits", param="seed")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > max_stop or any(not s or len(s) > 256 for s in stop):
        raise APIError(400, f"stop takes at most {max_stop} non-empty strings of up to 256 characters",
                       param="stop")
    return dict(temperature=temperature, top_p=top_p, top_k=max(top_k, 0), seed=req.seed,
                stop=stop or None, stop_token_ids=req.stop_token_ids, ignore_eos=bool(req.ignore_eos))


def check_max_tokens(value: int | None, param: str, prompt_len: int, max_len: int, default: int) -> int:
    """The completion budget: positive and within what is left of the context."""
    room = max_len - prompt_len
    if room < 1:
        raise APIError(400, f"this model's maximum context length is {max_len} tokens, but the prompt has "
                       f"{prompt_len} tokens", code="context_length_exceeded")
    if value is None:
        return min(default, room)
    if value < 1:
        raise APIError(400, f"{param} must be at least 1, got {value}", param=param)
    if value > room:
        raise APIError(400, f"this model's maximum context length is {max_len} tokens; you requested "
                       f"{prompt_len + value} ({prompt_len} in the prompt, {value} for the completion)",
                       param=param, code="context_length_exceeded")
    return value


def _part_text(i: int, j: int, part: ContentPart) -> str:
    where = f"messages.{i}.content.{j}"
    if part.type != "text":
        raise APIError(400, f"{where}: only text content parts are supported, got type {part.type!r}",
                       param="messages", code="unsupported_content_type")
    if part.text is None:
        raise APIError(400, f"missing required field {where}.text", param="messages",
                       code="missing_required_parameter")
    return part.text


def chat_text(messages: list[ChatMessage]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        content = m.content if isinstance(m.content, str) or m.content is None else \
            "".join(_part_text(i, j, p) for j, p in enumerate(m.content))
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    return out
