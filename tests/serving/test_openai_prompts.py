"""The OpenAI front's translation of a request naming a prompt template into its base model's request
(``serving/openai_prompts.py``): the fields from ``fields`` or the user's message, the system text, the schema as a
strict ``response_format``, the defaults under the request's own values, and each refusal naming its field. Served on
the real server in tests/integration/test_prompt_serving.py."""

from __future__ import annotations

import pytest

from model_factory.serving.openai_errors import OpenAIError
from model_factory.serving.openai_prompts import base_request, read_definition
from model_factory.serving.prompt_acceptance import accept_prompt

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["bug", "question"]}}, "required": ["label"]}
DEFINITION = {"name": "triage", "version": 1, "base": {"model": "lm", "version": 1, "digests": {}},
              "system": "You triage tickets.", "template": "Ticket: {{ ticket }}", "fields": ["ticket"],
              "schema": SCHEMA, "defaults": {"max_tokens": 48, "temperature": 0.0}}


def test_fields_fill_the_template_under_the_system_text_with_the_schema_and_defaults() -> None:
    out = base_request({"model": "triage", "fields": {"ticket": "it broke"}, "temperature": 0.7}, DEFINITION, True)
    assert out["model"] == "lm"
    assert out["messages"] == [{"role": "system", "content": "You triage tickets."},
                               {"role": "user", "content": "Ticket: it broke"}]
    assert out["response_format"] == {"type": "json_schema",
                                      "json_schema": {"name": "triage", "schema": SCHEMA, "strict": True}}
    assert out["max_tokens"] == 48 and out["temperature"] == 0.7  # the request's own value wins
    assert "fields" not in out


def test_a_one_field_template_takes_the_last_user_message_and_keeps_earlier_turns() -> None:
    turns = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": [{"type": "text", "text": "it broke"}]}]
    out = base_request({"model": "triage", "messages": turns, "max_completion_tokens": 9}, DEFINITION, True)
    assert out["messages"] == [{"role": "system", "content": "You triage tickets."}, *turns[:2],
                               {"role": "user", "content": "Ticket: it broke"}]
    assert "max_tokens" not in out  # max_completion_tokens is the request's own limit
    completion = base_request({"model": "triage", "prompt": "it broke"}, DEFINITION, False)
    assert completion["prompt"] == "You triage tickets.\n\nTicket: it broke"


@pytest.mark.parametrize("req, param, words", [
    ({"fields": {}}, "fields", "reads field 'ticket'"),
    ({"fields": {"ticket": "x", "tier": "gold"}}, "fields", "field 'tier' is not read"),
    ({"fields": "x"}, "fields", "must be an object"),
    ({"messages": [{"role": "system", "content": "be rude"}, {"role": "user", "content": "x"}]}, "messages",
     "sets the system text"),
    ({"fields": {"ticket": "x"}, "response_format": {"type": "json_object"}}, "response_format", "fixes its output"),
    ({"fields": {"ticket": "x"}, "tools": [{"type": "function"}]}, "tools", "fixes its output"),
])
def test_each_refusal_is_a_400_naming_its_field(req: dict, param: str, words: str) -> None:
    with pytest.raises(OpenAIError) as err:
        base_request({"model": "triage", **req}, DEFINITION, True)
    assert err.value.status == 400 and err.value.param == param and words in err.value.message, err.value.message


def test_a_template_of_several_fields_needs_them_as_fields() -> None:
    two = {**DEFINITION, "template": "{{ ticket }} / {{ tier }}", "fields": ["ticket", "tier"]}
    with pytest.raises(OpenAIError) as err:
        base_request({"model": "triage", "messages": [{"role": "user", "content": "x"}]}, two, True)
    assert err.value.param == "fields" and "'ticket', 'tier'" in err.value.message
    out = base_request({"model": "triage", "fields": {"ticket": "a", "tier": "b"}}, two, True)
    assert out["messages"][-1]["content"] == "a / b"


def test_a_prompt_model_that_cannot_answer_is_a_503() -> None:
    with pytest.raises(OpenAIError) as err:
        read_definition(400, '{"error": "Request for unknown model"}', "triage")
    assert err.value.status == 503 and err.value.retry_after_s
    assert read_definition(200, '{"outputs": [{"data": ["{\\"template\\": \\"x\\"}"]}]}', "t") == {"template": "x"}


def test_acceptance_renders_the_template_and_compiles_the_schema(tmp_path) -> None:
    import json

    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "prompt.json").write_text(json.dumps(DEFINITION))
    assert accept_prompt(tmp_path, "1", None)["passed"]
    (tmp_path / "1" / "prompt.json").write_text(json.dumps({**DEFINITION, "fields": []}))
    verdict = accept_prompt(tmp_path, "1", None)
    assert not verdict["passed"] and "'ticket'" in verdict["reason"]
    pytest.importorskip("llguidance")
    bad = {**DEFINITION, "schema": {"type": "object", "if": {"type": "object"}}}
    (tmp_path / "1" / "prompt.json").write_text(json.dumps(bad))
    verdict = accept_prompt(tmp_path, "1", None)
    assert not verdict["passed"] and "does not compile" in verdict["reason"], verdict


def test_a_prompt_on_a_base_whose_pinned_files_differ_is_refused_by_name(tmp_path, monkeypatch) -> None:
    """The pins are enforced where a prompt would start: ``pin_problem`` names the prompt, the base, the files that
    differ and the fix; ``serve``'s verified start refuses such a prompt (and serves the rest); a base version whose
    pinned files are the same (weights rebuilt, template and tokenizer kept) fits."""
    from model_factory.build.prompt import package_prompt
    from model_factory.recipe.prompt import load_prompt_recipe
    from model_factory.serving import verified_start
    from model_factory.serving.openai_prompts import ServedPrompt, pin_problem, prompt_models
    from prompt_recipes import fake_base, write_prompt_recipe

    base = fake_base(tmp_path / "repo")
    package_prompt(load_prompt_recipe(write_prompt_recipe(tmp_path)))
    assert prompt_models(tmp_path / "repo", ["triage", "base_lm"]) == {"triage": ServedPrompt("triage", "base_lm", "")}
    assert pin_problem(tmp_path / "repo", "base_lm") == ""  # not a prompt
    (base / "2" / "tokenizer").mkdir(parents=True)  # the base rebuilt, its template and tokenizer the same: it fits
    (base / "2" / "generation.json").write_text('{"chat_template": "x"}')
    (base / "2" / "tokenizer" / "tokenizer.json").write_text("{}")
    assert pin_problem(tmp_path / "repo", "triage") == ""
    (base / "2" / "generation.json").write_text('{"chat_template": "y"}')  # another chat template
    why = pin_problem(tmp_path / "repo", "triage")
    assert why.startswith("prompt triage v1 was written for base_lm v1, and the base_lm served here (v2) has another "
                          "generation.json (sha256 differs"), why
    assert "Fix: build the prompt on base_lm v2" in why
    assert prompt_models(tmp_path / "repo", ["triage"])["triage"].pinned == why

    class Stop(Exception):
        pass

    def server(repository, models, *args, **kwargs):  # where serve would start Triton: what it was asked to load
        raise Stop(models)

    checks = verified_start.MachineChecks(("base_lm", "triage"), {}, {}, {})
    monkeypatch.setattr(verified_start, "check_on_this_machine", lambda *a, **k: checks)
    monkeypatch.setattr(verified_start, "TritonServer", server)
    with pytest.raises(Stop) as stopped:
        verified_start.start_verified_server(tmp_path / "repo", verified_start.ServerOptions(0, 0, 0), None, True)
    assert stopped.value.args[0] == ("base_lm",)


def test_a_rollout_checks_a_prompt_version_against_the_base_version_serve_serves(tmp_path) -> None:
    """``pin_problem`` as a rollout asks it: the prompt version it would switch to, on the base version the running
    ``serve`` serves (not the newest folder ``config.pbtxt`` names); a base that serve does not serve is refused by
    name."""
    from model_factory.build.prompt import package_prompt
    from model_factory.recipe.prompt import load_prompt_recipe
    from model_factory.serving.openai_prompts import pin_problem
    from prompt_recipes import fake_base, write_prompt_recipe

    base = fake_base(tmp_path / "repo")
    package_prompt(load_prompt_recipe(write_prompt_recipe(tmp_path)))
    (base / "2" / "tokenizer").mkdir(parents=True)  # a newer base with another chat template, not served yet
    (base / "2" / "generation.json").write_text('{"chat_template": "y"}')
    (base / "2" / "tokenizer" / "tokenizer.json").write_text("{}")
    assert pin_problem(tmp_path / "repo", "triage", 1, {"base_lm": 1, "triage": 1}) == ""
    why = pin_problem(tmp_path / "repo", "triage", 1, {"base_lm": 2})
    assert why.startswith("prompt triage v1 was written for base_lm v1, and the base_lm served here (v2) has another "
                          "generation.json"), why
    assert pin_problem(tmp_path / "repo", "triage", 1, {"other": 1}).startswith(
        "prompt triage v1 runs on base_lm, which this serve does not serve. Fix: serve base_lm v1 beside it")
