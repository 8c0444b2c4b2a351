"""The OpenAI front's structured outputs and tool calls, as pure functions: ``response_format`` / ``guided_*`` into
the backend's ``guided`` object, ``tools`` / ``tool_choice`` into a grammar or the chat template, the output parsed
back into ``tool_calls`` (Hermes / Qwen blocks, bare JSON, a forced call), streamed deltas, and the 400s."""

from __future__ import annotations

import json

import pytest

from model_factory.serving.openai_errors import OpenAIError
from model_factory.serving.openai_guided import guided_request
from model_factory.serving.openai_protocol import chat_request, completion_request
from model_factory.serving.openai_tools import ToolStream, tool_message, tool_plan


class Served:
    chat_template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
                     "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")


MODELS = {"m": Served()}
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "g"}}]
MSG = [{"role": "user", "content": "hi"}]


def _extra(call) -> dict:
    return json.loads(call.body.get("sampling_parameters", "{}"))


def test_response_format_and_guided_fields_become_the_backends_guided_object():
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}
    assert guided_request({"response_format": rf}) == ({"json": SCHEMA}, "response_format")
    assert guided_request({"response_format": {"type": "json_object"}})[0] == {"json_object": True}
    assert guided_request({"response_format": {"type": "text"}}) == (None, None)
    assert guided_request({"guided_json": json.dumps(SCHEMA)})[0] == {"json": SCHEMA}
    assert guided_request({"guided_choice": ["a", "b"]}) == ({"choice": ["a", "b"]}, "guided_choice")
    assert guided_request({"guided_regex": "[0-9]+"})[0] == {"regex": "[0-9]+"}
    assert guided_request({"guided_grammar": "start: \"a\""})[0] == {"grammar": "start: \"a\""}
    call = chat_request({"model": "m", "messages": MSG, "response_format": rf}, MODELS)
    assert _extra(call)["guided"] == {"json": SCHEMA} and call.guided_param == "response_format"
    call = completion_request({"model": "m", "prompt": "p", "guided_choice": ["a"]}, MODELS)
    assert _extra(call)["guided"] == {"choice": ["a"]}


def test_vllm_structured_outputs_maps_onto_the_same_guided_object_as_guided_fields():
    assert guided_request({"structured_outputs": {"json": SCHEMA}}) == ({"json": SCHEMA}, "structured_outputs")
    assert guided_request({"structured_outputs": {"json": json.dumps(SCHEMA)}})[0] == {"json": SCHEMA}
    assert guided_request({"structured_outputs": {"regex": "[0-9]+"}})[0] == {"regex": "[0-9]+"}
    assert guided_request({"structured_outputs": {"choice": ["a", "b"]}})[0] == {"choice": ["a", "b"]}
    assert guided_request({"structured_outputs": {"grammar": "start: \"a\""}})[0] == {"grammar": "start: \"a\""}
    assert guided_request({"structured_outputs": {"json_object": True}})[0] == {"json_object": True}
    # vLLM's options are taken (nothing to change: one engine, compact JSON, closed objects); None / false unasked
    both = {"choice": ["a"], "json_object": False, "regex": None, "disable_fallback": True,
            "disable_any_whitespace": False, "disable_additional_properties": True}
    assert guided_request({"structured_outputs": both})[0] == {"choice": ["a"]}
    for given in ({"guided_choice": ["a"]}, {"structured_outputs": {"choice": ["a"]}}):
        for call in (chat_request({"model": "m", "messages": MSG, **given}, MODELS),
                     completion_request({"model": "m", "prompt": "p", **given}, MODELS)):
            assert _extra(call)["guided"] == {"choice": ["a"]} and call.guided_param == next(iter(given))


@pytest.mark.parametrize("so, message", [
    ({"jsn": SCHEMA}, "unknown key 'jsn'"),
    ({"choice": ["a"], "backend": "xgrammar"}, "unknown key 'backend'"),
    ({"regex": "a", "whitespace_pattern": " *"}, "whitespace_pattern is not supported"),
    ({"structural_tag": "{}"}, "structural_tag is not supported"),
    ({}, "exactly one of json, regex, choice, grammar, json_object, got none"),
    ({"regex": "a", "choice": ["a"]}, "got regex and choice"),
    ({"json": "{nope"}, "structured_outputs.json is not JSON"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
    ({"json_object": "yes"}, "structured_outputs.json_object must be true"),
    ({"regex": "a", "disable_fallback": "no"}, "disable_fallback must be true or false"),
    ("json", "must be an object"),
])
def test_bad_structured_outputs_are_400s_naming_the_key(so, message):
    for call in (lambda: chat_request({"model": "m", "messages": MSG, "structured_outputs": so}, MODELS),
                 lambda: completion_request({"model": "m", "prompt": "p", "structured_outputs": so}, MODELS)):
        with pytest.raises(OpenAIError, match=message) as info:
            call()
        assert info.value.status == 400 and info.value.param == "structured_outputs"


def test_structured_outputs_beside_another_format_is_a_400_naming_both():
    rf = {"type": "json_object"}
    for other in ({"response_format": rf}, {"guided_regex": "a"}):
        with pytest.raises(OpenAIError, match=f"{next(iter(other))} and structured_outputs|"
                                              f"structured_outputs and {next(iter(other))}") as info:
            chat_request({"model": "m", "messages": MSG, "structured_outputs": {"choice": ["a"]}, **other}, MODELS)
        assert info.value.status == 400
    with pytest.raises(OpenAIError, match="tool_choice='required' and structured_outputs"):
        chat_request({"model": "m", "messages": MSG, "tools": TOOLS, "tool_choice": "required",
                      "structured_outputs": {"regex": "a"}}, MODELS)


@pytest.mark.parametrize("req, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "response_format"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{nope"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "h"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_structured_requests_are_400s_naming_the_field(req, param):
    with pytest.raises(OpenAIError) as info:
        chat_request({"model": "m", "messages": MSG, **req}, MODELS)
    assert info.value.status == 400 and info.value.param == param


def test_tools_are_a_chat_parameter():
    with pytest.raises(OpenAIError, match="chat"):
        completion_request({"model": "m", "prompt": "p", "tools": TOOLS}, MODELS)


def test_a_named_or_required_call_is_generated_under_a_grammar_auto_goes_to_the_template():
    named = chat_request({"model": "m", "messages": MSG, "tools": TOOLS,
                          "tool_choice": {"type": "function", "function": {"name": "f"}}}, MODELS)
    assert _extra(named)["guided"] == {"json": SCHEMA} and "TOOLS" not in named.body["text_input"]
    required = tool_plan({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}).guided()["json"]
    assert required["type"] == "array" and required["maxItems"] == 1 and len(required["items"]["anyOf"]) == 2
    assert required["items"]["anyOf"][1]["properties"]["arguments"] == {"type": "object", "properties": {}}
    auto = chat_request({"model": "m", "messages": MSG, "tools": TOOLS}, MODELS)
    assert "guided" not in _extra(auto) and auto.body["text_input"].startswith("TOOLS:f;g;")
    assert tool_plan({"tools": TOOLS, "tool_choice": "none"}) is None and tool_plan({}) is None


def test_tool_calls_parsed_from_hermes_blocks_bare_json_and_forced_calls():
    auto = tool_plan({"tools": TOOLS})
    text = 'Sure.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call><tool_call>{"name": "g", "arguments": {}}'
    content, calls = auto.parse(text)
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert [c.name for c in auto.parse('[{"name": "g", "parameters": {}}]')[1]] == ["g"]
    assert auto.parse('{"name": "unknown", "arguments": {}}') == ('{"name": "unknown", "arguments": {}}', [])
    assert auto.parse("just words") == ("just words", [])
    one = tool_plan({"tools": TOOLS, "parallel_tool_calls": False})
    assert len(one.parse(text)[1]) == 1
    message, finish = tool_message(tool_plan({"tools": TOOLS, "tool_choice": {"type": "function",
                                                                             "function": {"name": "f"}}}),
                                   '{"x":3}', "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x":3}'}
    assert tool_message(auto, "hello", "length") == ({"role": "assistant", "content": "hello"}, "length")


def test_streamed_tool_call_deltas():
    named = ToolStream(tool_plan({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}}))
    first = named.feed(0, '{"x":', None)
    assert first[0][0]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x":'}
    assert named.feed(0, "2}", "stop") == [({"tool_calls": [{"index": 0, "function": {"arguments": "2}"}}]}, None),
                                           ({}, "tool_calls")]
    required = ToolStream(tool_plan({"tools": TOOLS, "tool_choice": "required"}))
    assert required.feed(0, '[{"name":"g",', None) == []
    out = required.feed(0, '"arguments":{}}]', "stop")
    assert out[0][0]["tool_calls"][0]["function"]["name"] == "g" and out[-1] == ({}, "tool_calls")
    auto = ToolStream(tool_plan({"tools": TOOLS}))
    assert auto.feed(1, "plain", "length") == [({"content": "plain"}, "length")]


def test_an_assistant_turn_with_tool_calls_and_a_tool_result_render():
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                                       "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    call = chat_request({"model": "m", "messages": messages}, MODELS)
    assert "tool: 42" in call.body["text_input"]
