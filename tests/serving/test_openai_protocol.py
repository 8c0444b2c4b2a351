"""The OpenAI request translation and chat templates, without a server."""

from __future__ import annotations

import pytest

from model_factory.serving.openai_api import ServedModel
from model_factory.serving.openai_protocol import (OpenAIError, chat_request, completion_request, render_chat,
                                                   triton_error)
from tests.generative_models import CHAT_TEMPLATE

MODELS = {"m": ServedModel("m", CHAT_TEMPLATE, 2048)}


def test_completion_body_uses_the_generate_names():
    call = completion_request({"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0.5, "stop": "x",
                               "stream": True, "stream_options": {"include_usage": True}, "top_k": 3}, MODELS)
    assert call.stream and call.include_usage
    assert call.body == {"exclude_input_in_output": True, "text_input": "hi", "max_tokens": 5, "temperature": 0.5,
                         "top_k": 3, "stop": ["x"], "stream": True}
    assert completion_request({"model": "m", "prompt": [1, 2]}, MODELS).body["prompt_ids"] == [1, 2]
    assert completion_request({"model": "m", "prompt": ["hi"]}, MODELS).body["max_tokens"] == 16


@pytest.mark.parametrize("req, status, param", [
    ({"prompt": "x"}, 400, "model"), ({"model": "zz", "prompt": "x"}, 404, "model"),
    ({"model": "m", "prompt": 3}, 400, "prompt"), ({"model": "m", "prompt": "x", "n": 3}, 400, "n"),
    ({"model": "m", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": "m", "prompt": "x", "stop": [1]}, 400, "stop"),
    ({"model": "m", "prompt": "x", "echo": True}, 400, "echo"),
])
def test_bad_requests_name_the_parameter(req, status, param):
    with pytest.raises(OpenAIError) as info:
        completion_request(req, MODELS)
    assert info.value.status == status and info.value.param == param


def test_chat_applies_the_template_with_the_assistant_turn_open():
    call = chat_request({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
                        MODELS)
    assert call.body["text_input"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    for bad in (None, [], [{"content": "x"}], [{"role": "user", "content": 5}]):
        with pytest.raises(OpenAIError, match="messages"):
            render_chat(CHAT_TEMPLATE, bad)
    with pytest.raises(OpenAIError, match="no chat template"):
        render_chat(None, [{"role": "user", "content": "x"}])


def test_triton_errors_map_to_openai_statuses():
    busy = triton_error(400, "server busy: 3 requests already wait for KV cache memory; retry after 2 s")
    assert busy.status == 503 and busy.retry_after_s == 2.0
    bad = triton_error(400, "top_p=2.0 must be in (0, 1]")
    assert bad.status == 400 and bad.param == "top_p"
    assert triton_error(500, "boom").status == 502
