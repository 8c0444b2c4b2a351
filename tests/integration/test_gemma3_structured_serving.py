"""The real Gemma 3 270M (the session's one build, ``gemma3_build`` in tests/conftest.py: INT8 served) on the real
Triton server behind the OpenAI frontend, its schema-constrained answers driven by the ``openai`` client unchanged:
``response_format`` json_schema (chat, and completions through ``extra_body``), ``guided_json``, vLLM's
``structured_outputs`` (``extra_body``, chat and completions), a named tool call and
a ``required`` one parse against their schemas every time, greedy and sampled; the grammar engine's view of the
tokenizer covers Gemma's whole 262,144-token vocabulary (a token among its last ids allowed where the grammar wants
it).

Gemma 3 270M is a pretrained model and its GGUF carries no chat template, so the build's ``generation.json`` has
none and the chat endpoint answers 400 for it (``use /v1/completions``): here the frontend is given Gemma's turn
format (``<start_of_turn>user ... <end_of_turn>``), as an operator gives vLLM ``--chat-template``, to reach the chat
paths (tools are chat's only)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("llguidance", reason="llguidance (extra serve) is the grammar engine")
jsonschema = pytest.importorskip("jsonschema")

GEMMA_TURNS = ("{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
               "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
               "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "occupation": {"enum": ["engineer", "teacher", "doctor", "artist", "other"]},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
    "required": ["name", "age", "occupation", "hobbies"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": {
             "type": "object", "properties": {"query": {"type": "string", "maxLength": 40}},
             "required": ["query"], "additionalProperties": False}}}]
PROMPTS = ["Describe a person who lives in Paris.", "Write a JSON record for a retired teacher.",
           "Permission is hereby granted, free of charge, to any person", "Who wrote the Apache License?"]
SAMPLING = ({}, {"temperature": 1.0, "seed": 3}, {"temperature": 0.8, "top_p": 0.9, "seed": 11})


@pytest.fixture(scope="module")
def gemma(gemma3_build):
    """(model name, version folder) of the session's Gemma build."""
    recipe, result = gemma3_build
    return recipe.name, result.version_dir


@pytest.fixture(scope="module")
def served(gemma):
    from model_factory.serving.openai_api import OpenAIFrontend, generative_models
    from model_factory.serving.server import ServerOptions, TritonServer

    name, version_dir = gemma
    repository = version_dir.parent.parent
    server = TritonServer(repository, options=ServerOptions(0, 0, 0)).start()
    assert not server.load_errors, server.load_errors
    models = generative_models(repository, server.ready_models)
    assert models[name].chat_template is None  # the GGUF's: none (a pretrained model)
    models[name] = replace(models[name], chat_template=GEMMA_TURNS)
    frontend = OpenAIFrontend(server.http_url, models).start()
    yield server, frontend
    frontend.stop()
    assert server.stop() == 0, server.log_tail(30)


@pytest.fixture(scope="module")
def client(served):
    import openai

    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="unused", max_retries=0, timeout=600)


def test_the_grammar_view_covers_gemmas_whole_vocabulary(gemma):
    """llguidance's view of the version's tokenizer.json is as wide as the logits (262,144), and a token among the
    vocabulary's last ids is allowed where the grammar wants its text."""
    import numpy as np
    from tokenizers import Tokenizer

    from model_factory.backend.contract import Files, GenerationSpec
    from model_factory.backend.generation.structured.engines import load_engine
    from model_factory.backend.generation.structured.grammar import (Grammars, allowed_tokens, mask_words,
                                                                     parse_guided)

    _, version_dir = gemma
    spec = GenerationSpec.from_json((version_dir / Files.GENERATION).read_text())
    tokenizer_json = (version_dir / "tokenizer" / "tokenizer.json").read_text()
    assert spec.vocab_size == 262144
    engine = load_engine(tokenizer_json, spec.vocab_size, spec.eos_token_ids)
    tok = Tokenizer.from_str(tokenizer_json)
    assert tok.get_vocab_size(with_added_tokens=True) <= spec.vocab_size
    # a high id whose text is a word (the ids above 256,000 are special: images, unused): one token the grammar of
    # that word must allow at its start
    high = next(i for i in range(256000, 200000, -1) if (t := tok.decode([i])).isalpha() and len(t) >= 2)
    word = tok.decode([high])
    matcher = Grammars(engine).compile(parse_guided({"choice": [word]})).matcher()
    row = np.zeros(mask_words(spec.vocab_size), dtype=np.int32)
    matcher.fill_mask(row)
    allowed = allowed_tokens(row, spec.vocab_size)
    assert allowed.size == spec.vocab_size and allowed[high], (high, word)
    assert not allowed[spec.eos_token_ids[0]]


def test_response_format_json_schema_answers_parse_every_time(client, gemma):
    name, _ = gemma
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for prompt in PROMPTS:
        for kw in SAMPLING:
            r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=160, response_format=fmt, **kw)
            choice = r.choices[0]
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), PERSON)
    for extra in ({"response_format": fmt}, {"guided_json": PERSON}):
        r = client.completions.create(model=name, prompt=PROMPTS[2], max_tokens=160, n=2, temperature=1.0, seed=5,
                                      extra_body=extra)
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice.text
            jsonschema.validate(json.loads(choice.text), PERSON)


def test_vllms_structured_outputs_json_answers_parse_every_time(client, gemma):
    """vLLM >= 0.10's own field, as its clients send it (``extra_body={"structured_outputs": {"json": schema}}``), on
    chat and completions, greedy and sampled: every answer of the 262k-vocabulary model parses and validates."""
    name, _ = gemma
    extra = {"structured_outputs": {"json": PERSON}}
    for prompt in PROMPTS[:2]:
        for kw in SAMPLING:
            r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=160, extra_body=extra, **kw)
            choice = r.choices[0]
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), PERSON)
    r = client.completions.create(model=name, prompt=PROMPTS[2], max_tokens=160, n=2, temperature=1.0, seed=7,
                                  extra_body=extra)
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), PERSON)


def test_a_named_tool_call_and_a_required_one_parse_every_time(client, gemma):
    name, _ = gemma
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for prompt in ("What will the weather be in Oslo this week?", "Is it going to rain in Lima tomorrow?"):
        for kw in SAMPLING:
            r = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": prompt}], max_tokens=120, tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw)
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
            call = choice.message.tool_calls[0]
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)
            r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=200, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, **kw)
            calls = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
            for call in calls:
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_langchains_with_structured_output_by_both_methods(served, gemma):
    """LangChain's ``ChatOpenAI(...).with_structured_output`` unchanged: a named tool (``function_calling``) and
    ``response_format`` json_schema (``json_schema``), each answer a valid instance of the pydantic model."""
    pytest.importorskip("langchain_openai", reason="langchain-openai is not installed (extra test)")
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)
        population_millions: int = Field(ge=0, le=50)

    llm = ChatOpenAI(model=gemma[0], base_url=served[1].url + "/v1", api_key="unused", max_tokens=120, max_retries=0,
                     temperature=0)
    for method in ("function_calling", "json_schema"):
        out = llm.with_structured_output(City, method=method, include_raw=True).invoke("Tell me about Lisbon.")
        assert out["parsing_error"] is None and isinstance(out["parsed"], City), out
