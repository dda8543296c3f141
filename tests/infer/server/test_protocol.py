"""Request validation of the OpenAI wire format (infer/server/protocol.py), without a server."""
from __future__ import annotations

import pytest

from specdec.infer.server.protocol import (APIError, ChatRequest, CompletionRequest, chat_text,
                                           check_unsupported, parse_request)


def _refused(kind, body) -> APIError:
    with pytest.raises(APIError) as err:
        parse_request(kind, {"model": "m", **body})
    assert err.value.status == 400
    return err.value


@pytest.mark.parametrize("field,value", [("stream", "yes"), ("stream_options", 5)])
def test_a_field_named_like_a_type_is_still_named(field, value):
    # "stream" starts like the union tag "str": it was dropped from the location ("invalid field (body)")
    err = _refused(CompletionRequest, {"prompt": "x", field: value})
    assert err.param == field and err.message.startswith(f"invalid field {field}:")


def test_a_union_error_says_the_type_of_the_value_that_failed():
    err = _refused(ChatRequest, {"messages": [{"role": "user", "content": 5}]})
    assert err.param == "messages"
    assert "messages.0.content" in err.message and err.message.endswith("got integer")  # not the list's "array"
    err = _refused(CompletionRequest, {"prompt": 5})
    assert err.param == "prompt" and err.message.endswith("got integer")


def test_non_text_content_parts_are_refused_by_name():
    req = parse_request(ChatRequest, {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]})
    with pytest.raises(APIError) as err:
        chat_text(req.messages)
    assert err.value.param == "messages" and "messages.1.content.0" in err.value.message
    assert "only text" in err.value.message and "image_url" in err.value.message
    assert chat_text(req.messages[:1]) == [{"role": "user", "content": "ab"}]


@pytest.mark.parametrize("kind,value,refused", [(CompletionRequest, 0, True), (CompletionRequest, 2, True),
                                                (CompletionRequest, None, False), (ChatRequest, True, True),
                                                (ChatRequest, False, False)])
def test_any_logprobs_request_is_refused_not_ignored(kind, value, refused):
    body = {"prompt": "x"} if kind is CompletionRequest else {"messages": [{"role": "user", "content": "x"}]}
    req = parse_request(kind, {"model": "m", **body, "logprobs": value})
    if not refused:
        check_unsupported(req)
        return
    with pytest.raises(APIError) as err:  # logprobs=0 was answered with "logprobs": null
        check_unsupported(req)
    assert err.value.param == "logprobs"


@pytest.mark.parametrize("field,value", [("repetition_penalty", 1.2), ("min_p", 0.05), ("min_tokens", 4),
                                         ("use_beam_search", True), ("include_stop_str_in_output", True)])
def test_vllm_sampling_extensions_that_change_the_output_are_refused_not_ignored(field, value):
    req = parse_request(CompletionRequest, {"model": "m", "prompt": "x", field: value})
    with pytest.raises(APIError) as err:  # as unknown fields they were dropped without a word
        check_unsupported(req)
    assert err.value.param == field


def test_stop_token_ids_reach_the_sampling_params():
    from specdec.infer.server.protocol import sampling_fields

    req = parse_request(ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                      "stop_token_ids": [7, 9], "repetition_penalty": 1, "min_p": 0})
    check_unsupported(req)  # the neutral values pass
    assert sampling_fields(req, 16)["stop_token_ids"] == [7, 9]


def test_continuing_the_final_message_needs_no_generation_prompt():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    check_unsupported(parse_request(ChatRequest, {**body, "continue_final_message": True,
                                                  "add_generation_prompt": False}))
    with pytest.raises(APIError) as err:
        check_unsupported(parse_request(ChatRequest, {**body, "continue_final_message": True}))
    assert err.value.param == "continue_final_message"
