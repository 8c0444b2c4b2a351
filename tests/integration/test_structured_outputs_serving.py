"""Structured outputs and tool calls on the real Triton server, driven by the ``openai`` client unchanged on the
session's random-weight tiny Llama (``tiny_llm``): whatever the weights, a ``response_format`` json_schema answer
passes the schema's validator every time (greedy and sampled, several prompts, streamed, ``n`` choices), a named
``tool_choice`` comes back as ``tool_calls`` the client parses with arguments valid against the function's schema,
``guided_choice`` / ``guided_regex`` and vLLM's ``structured_outputs`` hold, the generate endpoint takes ``guided`` in ``sampling_parameters``, and a
schema the engine cannot compile is a 400 naming the construct."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from tests.generative_repository import layout_generative_model, served_with_openai

pytestmark = pytest.mark.integration
pytest.importorskip("llguidance", reason="llguidance (extra serve) is the grammar engine")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "tiny_llm"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "kind": {"enum": ["person", "robot"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2}},
    "required": ["name", "age", "kind", "tags"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a", "b"], "additionalProperties": False}}}]
PROMPTS = ["Describe a person.", "Who are you?", "Permission is hereby granted", "Tell me about the license"]


@pytest.fixture(scope="module")
def served(tiny_llm, tmp_path_factory):
    hf, onnx_dir = tiny_llm
    repo = tmp_path_factory.mktemp("structured-repo")
    layout_generative_model(hf, onnx_dir, repo, MODEL, memory_budget_mib=256, max_active_sequences=8,
                            max_waiting_sequences=64)
    with served_with_openai(repo) as (server, frontend):
        yield server, frontend


@pytest.fixture(scope="module")
def client(served):
    import openai

    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="unused", max_retries=0, timeout=180)


def _schema_format(schema=PERSON):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_response_format_json_schema_validates_every_time_greedy_and_sampled(client):
    for i, prompt in enumerate(PROMPTS):
        for kw in ({}, {"temperature": 1.0, "seed": i}):
            r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=200, response_format=_schema_format(), **kw)
            choice = r.choices[0]
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_schema_streamed_with_n_choices_and_on_completions(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A person"}], max_tokens=200, stream=True, n=3,
        temperature=1.0, seed=7, response_format=_schema_format()))
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    assert sorted(texts) == [0, 1, 2]
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)
    r = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=200, extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    obj = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Any JSON"}],
                                         max_tokens=300, response_format={"type": "json_object"},
                                         extra_body={"top_k": 5}, temperature=0.7, seed=1)
    if obj.choices[0].finish_reason == "stop":  # any object may be longer than max_tokens
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_a_named_tool_choice_answers_tool_calls_the_client_parses(client):
    forced = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                           max_tokens=120, tools=TOOLS, tool_choice=forced, temperature=1.0, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                                 max_tokens=120, tools=TOOLS, tool_choice=forced, stream=True))
    deltas = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    jsonschema.validate(json.loads("".join(d.function.arguments or "" for d in deltas)), WEATHER)
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]


def test_tool_choice_required_without_parallel_calls_makes_one_valid_call(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Add 2 and 3"}],
                                       max_tokens=150, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert r.choices[0].finish_reason == "tool_calls"
    # auto on a template that takes no tools: the random model writes no call, a normal message comes back
    auto = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                          tools=TOOLS)
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].finish_reason in ("stop", "length")


def test_guided_choice_and_regex(client):
    choices = ["alpha", "beta", "gamma delta"]
    for seed in range(3):
        r = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=20, temperature=1.0, seed=seed,
                                      extra_body={"guided_choice": choices})
        assert r.choices[0].text in choices and r.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick"}], max_tokens=20,
                                          extra_body={"guided_choice": choices})
    assert chat.choices[0].message.content in choices
    r = client.completions.create(model=MODEL, prompt="Code:", max_tokens=30,
                                  extra_body={"guided_regex": r"[A-Z]{3}-[0-9]{2,4}"})
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2,4}", r.choices[0].text)


def test_vllms_structured_outputs_through_extra_body(client):
    """vLLM >= 0.10's clients: ``extra_body={"structured_outputs": {...}}`` on both endpoints, the same grammars as
    ``guided_*``; beside ``response_format`` it is a 400 naming both, and an unknown key a 400 naming the key."""
    import openai

    choices = ["alpha", "beta", "gamma delta"]
    for seed in range(2):
        r = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=20, temperature=1.0, seed=seed,
                                      extra_body={"structured_outputs": {"choice": choices}})
        assert r.choices[0].text in choices and r.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a person."}],
                                          max_tokens=200, temperature=1.0, seed=4,
                                          extra_body={"structured_outputs": {"json": PERSON,
                                                                             "disable_any_whitespace": True}})
    assert chat.choices[0].finish_reason == "stop", chat.choices[0].message.content
    jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)
    # completions with n = 2, as test_gemma3_structured_serving sends it (and bench_structured --served, streamed)
    r = client.completions.create(model=MODEL, prompt="Describe a person.", max_tokens=200, n=2, temperature=1.0,
                                  seed=7, extra_body={"structured_outputs": {"json": PERSON}})
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), PERSON)
    r = client.completions.create(model=MODEL, prompt="Code:", max_tokens=30,
                                  extra_body={"structured_outputs": {"regex": r"[A-Z]{3}-[0-9]{2,4}"}})
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2,4}", r.choices[0].text)
    with pytest.raises(openai.BadRequestError, match="response_format and structured_outputs") as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=8,
                                       response_format={"type": "json_object"},
                                       extra_body={"structured_outputs": {"choice": choices}})
    assert info.value.body["param"] == "structured_outputs"
    with pytest.raises(openai.BadRequestError, match="unknown key 'jsn'"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=8,
                                  extra_body={"structured_outputs": {"jsn": PERSON}})


def test_a_chat_template_given_at_serve_time_renders_the_chat(served, tmp_path):
    """``serve --chat-template MODEL=FILE``'s path: a second frontend on the same server with the file's template
    (``openai_chat_template``) answers a greedy chat exactly as completions answer the prompt that template renders,
    the prompt's token count the same; the model's own template renders another prompt."""
    import openai

    from model_factory.serving.openai_api import OpenAIFrontend, generative_models
    from model_factory.serving.openai_chat_template import apply_chat_templates, parse_chat_template_options
    from model_factory.serving.openai_protocol import render_chat

    server, _ = served
    path = tmp_path / "qa.jinja"
    path.write_text("{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:")
    own = generative_models(server.repository, server.ready_models)
    models, _, _, logged = apply_chat_templates(own, {}, parse_chat_template_options([f"{MODEL}={path}"]))
    assert str(path) in logged[MODEL]
    messages = [{"role": "user", "content": "Tell me about the license"}]
    assert render_chat(own[MODEL].chat_template, messages) != render_chat(models[MODEL].chat_template, messages)
    frontend = OpenAIFrontend(server.http_url, models).start()
    try:
        client = openai.OpenAI(base_url=frontend.url + "/v1", api_key="unused", max_retries=0, timeout=180)
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        done = client.completions.create(model=MODEL, prompt="Q: Tell me about the license\nA:", max_tokens=12,
                                         temperature=0)
    finally:
        frontend.stop()
    assert chat.choices[0].message.content == done.choices[0].text
    assert chat.usage.prompt_tokens == done.usage.prompt_tokens


def test_the_generate_endpoint_takes_guided_in_sampling_parameters(served):
    server, _ = served
    body = {"text_input": "Pick one", "max_tokens": 20, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"guided": {"choice": ["yes", "no"]}})}
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/{MODEL}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    out = json.loads(urllib.request.urlopen(req, timeout=120).read())
    assert out["text_output"] in ("yes", "no")


def test_a_schema_the_engine_cannot_compile_is_a_400_naming_the_construct(client):
    import openai

    bad = {"type": "object", "properties": {"a": {"type": "string"}}, "if": {"required": ["a"]}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=8,
                                       response_format=_schema_format(bad))
    assert info.value.status_code == 400 and '"if"' in info.value.message
    assert info.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=8,
                                       tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})


def test_langchain_with_structured_output(served):
    pytest.importorskip("langchain_openai", reason="langchain-openai is not installed (extra test)")
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=10)
        age: int = Field(ge=0, le=120)

    llm = ChatOpenAI(model=MODEL, base_url=served[1].url + "/v1", api_key="unused", max_tokens=120, max_retries=0)
    for method in ("function_calling", "json_schema"):
        person = llm.with_structured_output(Person, method=method).invoke("Describe a person")
        assert isinstance(person, Person)


def test_vllm_triton_backends_guided_decoding_through_grpc_streaming_and_generate(served):
    """Triton's own clients, as vLLM's Triton backend is called: ``sampling_parameters`` ``guided_decoding`` (a JSON
    schema, with vLLM's ``backend`` key) through tritonclient's gRPC stream, ``structured_outputs`` (its JSON text)
    through the generate endpoint; both answers follow their grammar."""
    import threading

    import numpy as np
    import tritonclient.grpc as grpcclient

    server = served[0]
    results: list = []
    done = threading.Event()

    def on_response(result, error):
        results.append((result, error))
        if error is not None or result.as_numpy("finish_reason")[0].decode():
            done.set()

    DTYPES = {"BYTES": np.object_, "INT32": np.int32, "BOOL": np.bool_}

    def tensor(name, value, dtype):
        t = grpcclient.InferInput(name, [len(value)], dtype)
        t.set_data_from_numpy(np.asarray(value, dtype=DTYPES[dtype]))
        return t

    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=on_response)
    try:
        params = {"guided_decoding": {"json": PERSON, "backend": "xgrammar"}, "temperature": 1.0, "seed": 5}
        client.async_stream_infer(MODEL, [
            tensor("text_input", [b"Describe a person."], "BYTES"), tensor("max_tokens", [200], "INT32"),
            tensor("stream", [True], "BOOL"), tensor("exclude_input_in_output", [True], "BOOL"),
            tensor("sampling_parameters", [json.dumps(params).encode()], "BYTES")])
        assert done.wait(180)
    finally:
        client.stop_stream()
        client.close()
    assert all(error is None for _, error in results), results
    text = "".join(r.as_numpy("text_output")[0].decode() for r, _ in results)
    assert results[-1][0].as_numpy("finish_reason")[0].decode() == "stop", text
    jsonschema.validate(json.loads(text), PERSON)

    body = {"text_input": "Pick one.", "max_tokens": 16, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"structured_outputs": json.dumps({"regex": "[a-c]{2}-[0-9]{2}"})})}
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/{MODEL}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    out = json.loads(urllib.request.urlopen(req, timeout=120).read())
    assert re.fullmatch("[a-c]{2}-[0-9]{2}", out["text_output"]), out
