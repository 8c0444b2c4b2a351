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
    ({"model": "m", "prompt": 3}, 400, "prompt"), ({"model": "m", "prompt": "x", "n": 0}, 400, "n"),
    ({"model": "m", "prompt": "x", "n": 129}, 400, "n"), ({"model": "m", "prompt": "x", "n": 2.0}, 400, "n"),
    ({"model": "m", "prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
    ({"model": "m", "prompt": "x", "best_of": 3, "stream": True}, 400, "best_of"),
    ({"model": "m", "prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ({"model": "m", "prompt": "x", "logprobs": True}, 400, "logprobs"),
    ({"model": "m", "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"model": "m", "prompt": "x", "frequency_penalty": "1"}, 400, "frequency_penalty"),
    ({"model": "m", "prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ({"model": "m", "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"model": "m", "prompt": "x", "stop_token_ids": ["2"]}, 400, "stop_token_ids"),
    ({"model": "m", "prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
    ({"model": "m", "prompt": [1, 2], "echo": True, "stream": True}, 400, "echo"),
    ({"model": "m", "prompt": "x", "echo": "yes"}, 400, "echo"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"model": "m", "prompt": "x", "suffix": "tail"}, 400, "suffix"),
    ({"model": "m", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": "m", "prompt": "x", "stop": [1]}, 400, "stop"),
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


def test_the_sampling_fields_go_to_the_backend_in_sampling_parameters():
    import json

    call = completion_request(
        {"model": "m", "prompt": "hi", "n": 2, "logprobs": 3, "presence_penalty": 0.5, "frequency_penalty": 0,
         "logit_bias": {"7": -100}, "stop_token_ids": [9]}, MODELS)
    assert json.loads(call.body["sampling_parameters"]) == {"n": 2, "logprobs": 3, "presence_penalty": 0.5,
                                                            "logit_bias": {"7": -100.0}, "stop_token_ids": [9]}
    assert (call.n, call.best_of, call.logprobs) == (2, 2, 3)
    plain = completion_request({"model": "m", "prompt": "hi"}, MODELS)
    assert "sampling_parameters" not in plain.body and plain.logprobs is None and plain.n == 1
    best = completion_request({"model": "m", "prompt": "hi", "n": 2, "best_of": 4}, MODELS)
    assert json.loads(best.body["sampling_parameters"]) == {"n": 4, "logprobs": 0} and best.logprobs is None
    echo = completion_request({"model": "m", "prompt": "hi", "echo": True}, MODELS)
    assert echo.echo == "hi" and echo.body["exclude_input_in_output"] is True
    ids = completion_request({"model": "m", "prompt": [1, 2], "echo": True}, MODELS)
    assert ids.echo == "" and ids.body["exclude_input_in_output"] is False


def test_chat_logprobs_top_logprobs_and_max_completion_tokens():
    import json

    msgs = [{"role": "user", "content": "hi"}]
    call = chat_request({"model": "m", "messages": msgs, "logprobs": True, "top_logprobs": 4,
                         "max_completion_tokens": 7, "max_tokens": 99, "n": 3}, MODELS)
    assert call.logprobs == 4 and call.body["max_tokens"] == 7
    assert json.loads(call.body["sampling_parameters"]) == {"n": 3, "logprobs": 4}
    assert chat_request({"model": "m", "messages": msgs, "logprobs": True}, MODELS).logprobs == 0
    assert chat_request({"model": "m", "messages": msgs, "logprobs": False}, MODELS).logprobs is None
    for bad, param in [({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                       ({"logprobs": 2}, "logprobs"), ({"max_completion_tokens": 0}, "max_completion_tokens"),
                       ({"echo": True}, "echo"), ({"best_of": 2}, "best_of")]:
        with pytest.raises(OpenAIError) as info:
            chat_request({"model": "m", "messages": msgs, **bad}, MODELS)
        assert info.value.status == 400 and info.value.param == param


ENTRIES = [{"id": 5, "token": " the", "bytes": list(b" the"), "logprob": -0.5,
            "top": [{"id": 5, "token": " the", "bytes": list(b" the"), "logprob": -0.5},
                    {"id": 6, "token": " a", "bytes": list(b" a"), "logprob": -1.5}]},
           {"id": 9, "token": " cat", "bytes": list(b" cat"), "logprob": -2.0,
            "top": [{"id": 3, "token": " dog", "bytes": list(b" dog"), "logprob": -1.0}]}]


def test_logprobs_in_the_completions_and_chat_shapes_the_openai_client_reads():
    from openai.types.chat.chat_completion import ChatCompletion
    from openai.types.completion import Completion

    from model_factory.serving.openai_protocol import (best_choices, chat_logprobs, chat_response,
                                                       completion_logprobs, completion_response)

    shaped, end = completion_logprobs(ENTRIES, 3)
    assert shaped == {"tokens": [" the", " cat"], "token_logprobs": [-0.5, -2.0],
                      "top_logprobs": [{" the": -0.5, " a": -1.5}, {" dog": -1.0, " cat": -2.0}],
                      "text_offset": [3, 7]} and end == 11
    body = completion_response("m", [{"index": 0, "text": " the cat", "finish_reason": "length", "logprobs": shaped}],
                               2, 2)
    parsed = Completion.model_validate(body)
    assert parsed.choices[0].logprobs.token_logprobs == [-0.5, -2.0]
    chat = chat_response("m", [{"index": 0, "text": " the cat", "finish_reason": "stop",
                                "logprobs": chat_logprobs(ENTRIES)}], 2, 2)
    content = ChatCompletion.model_validate(chat).choices[0].logprobs.content
    assert [c.token for c in content] == [" the", " cat"] and content[1].top_logprobs[0].token == " dog"
    assert content[0].bytes == list(b" the")
    ranked = best_choices([{"index": 0, "cumulative_logprob": -3.0}, {"index": 1, "cumulative_logprob": -1.0},
                           {"index": 2, "cumulative_logprob": -2.0}], 2)
    assert [(c["index"], c["cumulative_logprob"]) for c in ranked] == [(0, -1.0), (1, -2.0)]


def test_an_adapters_name_goes_to_its_base_with_lora_name():
    import json

    models = {**MODELS, "support": ServedModel("support", CHAT_TEMPLATE, 2048, base="m", adapter="support")}
    call = completion_request({"model": "support", "prompt": "hi", "presence_penalty": 0.5}, models)
    assert call.model == "support" and call.triton_model == "m"  # answered under its name, sent to its base
    assert json.loads(call.body["sampling_parameters"]) == {"presence_penalty": 0.5, "lora_name": "support"}
    chat = chat_request({"model": "support", "messages": [{"role": "user", "content": "hi"}]}, models)
    assert chat.triton_model == "m" and json.loads(chat.body["sampling_parameters"]) == {"lora_name": "support"}
    base = completion_request({"model": "m", "prompt": "hi"}, models)
    assert base.triton_model == "m" and "sampling_parameters" not in base.body
    with pytest.raises(OpenAIError) as err:
        completion_request({"model": "nobody", "prompt": "hi"}, models)
    assert err.value.status == 404
