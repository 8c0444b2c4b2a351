"""``serve --chat-template [MODEL=]FILE``: the file loaded and compiled in the chat sandbox (its sha256 kept), a file
that does not parse refused with the file and line, the models it overrides (a named one and its adapters, or every
one), the prompt templates on an overridden base refused by name, and the CLI's refusals before any server starts."""

from __future__ import annotations

import hashlib

import pytest
from click.testing import CliRunner

from model_factory.errors import FactoryError
from model_factory.serving.openai_api import ServedModel
from model_factory.serving.openai_chat_template import (apply_chat_templates, load_chat_template,
                                                         parse_chat_template_options, template_digest)
from model_factory.serving.openai_prompts import ServedPrompt
from model_factory.serving.openai_protocol import chat_request, render_chat

TURNS = ("{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
         "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
         "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture
def turns(tmp_path):
    path = tmp_path / "turns.jinja"
    path.write_text(TURNS)
    return path


def test_a_template_file_is_loaded_with_its_sha256_and_renders_the_chat(turns):
    template = load_chat_template(turns)
    assert template.text == TURNS and template.path == turns
    assert template.sha256 == hashlib.sha256(turns.read_bytes()).hexdigest() == template_digest(TURNS)
    assert render_chat(template.text, MSG) == "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"


@pytest.mark.parametrize("text, where", [
    ("{% for m in messages %}{{ m.content }}\n{% endfor", "line 2"),
    ("a\nb\n{{ messages[0].content }\nc", "line 3"),
    ("{% if x %}never closed", "line 1"),
])
def test_a_file_that_does_not_parse_is_refused_with_the_file_and_line(tmp_path, text, where):
    bad = tmp_path / "bad.jinja"
    bad.write_text(text)
    with pytest.raises(FactoryError, match=rf"--chat-template {bad}, {where}: .*Fix:"):
        load_chat_template(bad)


def test_unreadable_empty_and_non_utf8_files_are_refused(tmp_path):
    with pytest.raises(FactoryError, match="cannot be read"):
        load_chat_template(tmp_path / "missing.jinja")
    (tmp_path / "empty.jinja").write_text(" \n")
    with pytest.raises(FactoryError, match="is empty"):
        load_chat_template(tmp_path / "empty.jinja")
    (tmp_path / "latin.jinja").write_bytes(b"caf\xe9 {{ x }}")
    with pytest.raises(FactoryError, match="not UTF-8"):
        load_chat_template(tmp_path / "latin.jinja")


def test_options_name_a_model_or_every_model(turns, tmp_path):
    odd = tmp_path / "a=b.jinja"  # a file whose name holds '=' is a bare FILE
    odd.write_text("{{ messages[0].content }}")
    options = parse_chat_template_options([f"gemma={turns}", str(odd)])
    assert options["gemma"].text == TURNS and options[""].path == odd
    with pytest.raises(FactoryError, match="given twice for gemma"):
        parse_chat_template_options([f"gemma={turns}", f"gemma={odd}"])


def test_the_overridden_models_their_adapters_and_the_prompts_refused(turns):
    models = {"gemma": ServedModel("gemma"), "gemma-sql": ServedModel("gemma-sql", base="gemma", adapter="gemma-sql"),
              "llama": ServedModel("llama", chat_template="{{ messages }}")}
    prompts = {"extract": ServedPrompt("extract", "gemma"), "summary": ServedPrompt("summary", "llama")}
    out, kept, refused, logged = apply_chat_templates(models, prompts, {"gemma": load_chat_template(turns)})
    assert out["gemma"].chat_template == TURNS and out["gemma-sql"].chat_template == TURNS
    assert out["llama"] == models["llama"] and set(logged) == {"gemma", "gemma-sql"}
    assert hashlib.sha256(TURNS.encode()).hexdigest() in logged["gemma"] and "own (sha256 none)" in logged["gemma"]
    assert list(kept) == ["summary"] and list(refused) == ["extract"]
    assert "prompt extract pins gemma's chat template" in refused["extract"] and str(turns) in refused["extract"]
    # the chat endpoint renders with the override, where the model's own (none) was a 400
    call = chat_request({"model": "gemma", "messages": MSG}, out)
    assert call.body["text_input"].endswith("<start_of_turn>model\n")
    every, kept, refused, logged = apply_chat_templates(models, prompts, {"": load_chat_template(turns)})
    assert all(m.chat_template == TURNS for m in every.values()) and not kept and set(refused) == set(prompts)
    assert f"own (sha256 {template_digest('{{ messages }}')})" in logged["llama"]
    with pytest.raises(FactoryError, match="names mistral, which this serve does not serve"):
        apply_chat_templates(models, prompts, {"mistral": load_chat_template(turns)})
    assert apply_chat_templates(models, prompts, {}) == (models, prompts, {}, {})


def test_serve_refuses_a_bad_template_or_one_without_the_openai_port_before_starting(tmp_path, turns):
    from model_factory.cli.factory import serve

    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    runner = CliRunner()
    res = runner.invoke(serve, ["--allow-unsigned", "--openai-port", "0", "--chat-template", str(bad), str(tmp_path)])
    assert res.exit_code != 0 and f"--chat-template {bad}, line 1" in res.output, res.output
    res = runner.invoke(serve, ["--allow-unsigned", "--chat-template", str(turns), str(tmp_path)])
    assert res.exit_code != 0 and "Fix: add --openai-port" in res.output, res.output
