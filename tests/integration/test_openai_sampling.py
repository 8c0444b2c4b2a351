"""The OpenAI sampling API on the real Triton server, driven by the ``openai`` client unchanged: logprobs
(completions and chat, streamed and not), n choices (greedy: identical; seeded: reproducible), best_of, echo,
presence / frequency penalties, logit_bias, stop_token_ids, stream_options.include_usage, and their refusals.
One server for the module, serving the session's random-weight tiny Llama (``tiny_llm``)."""

from __future__ import annotations

import math

import pytest

from tests.generative_repository import layout_generative_model, served_with_openai

pytestmark = pytest.mark.integration

MODEL = "tiny_llm"
PROMPT = "Permission is hereby granted"


@pytest.fixture(scope="module")
def served(tiny_llm, tmp_path_factory):
    hf, onnx_dir = tiny_llm
    repo = tmp_path_factory.mktemp("sampling-repo")
    layout_generative_model(hf, onnx_dir, repo, MODEL, memory_budget_mib=256, max_active_sequences=8,
                            max_waiting_sequences=64)
    with served_with_openai(repo) as (server, frontend):
        yield server, frontend, hf


@pytest.fixture(scope="module")
def client(served):
    import openai

    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(served):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(served[2] / "tokenizer.json"))


def _greedy(client, **kw):
    return client.completions.create(model=MODEL, prompt=PROMPT, **{"max_tokens": 8, **kw})


def test_completion_logprobs_streamed_and_not_parsed_by_the_client(client):
    r = _greedy(client, logprobs=3, extra_body={"min_tokens": 8})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 3 <= len(top) <= 4
        assert math.isclose(value, max(top.values()), abs_tol=1e-5)  # greedy: the chosen token is the likeliest
        assert top[chosen] == value
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, logprobs=3, stream=True,
                                            extra_body={"min_tokens": 8}))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert _greedy(client).choices[0].logprobs is None


def test_chat_logprobs_with_top_logprobs_streamed_and_not(client):
    messages = [{"role": "user", "content": "Say something"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, logprobs=True, top_logprobs=4,
                                       extra_body={"min_tokens": 6})
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 4 and c.logprob <= 0 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob for c in content)
    assert all(math.isclose(c.logprob, c.top_logprobs[0].logprob, abs_tol=1e-5) for c in content)
    assert all(isinstance(c.bytes, list) for c in content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, logprobs=True,
                                                 stream=True, extra_body={"min_tokens": 6}))
    streamed = [c.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content]
    assert streamed == pytest.approx([c.logprob for c in content], abs=1e-6)


def test_n_three_greedy_identical_seeded_reproducible_streamed_indexed(client):
    r = _greedy(client, n=3, extra_body={"min_tokens": 8})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 1 and r.choices[0].text == _greedy(
        client, extra_body={"min_tokens": 8}).choices[0].text
    assert r.usage.completion_tokens == 24

    def sampled():
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, n=3, temperature=1.0, seed=5,
                                         extra_body={"min_tokens": 16})

    a, b = sampled(), sampled()
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # each choice its own seed
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, n=3, temperature=1.0, seed=5,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"min_tokens": 16}))
    texts = {i: "" for i in range(3)}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert [texts[i] for i in range(3)] == [c.text for c in a.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 48
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_completion_tokens=5, extra_body={"min_tokens": 5})
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content


def test_best_of_returns_n_of_the_generated_and_counts_them_all(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=1, best_of=3, temperature=1.0, seed=9,
                                  extra_body={"min_tokens": 6})
    assert len(r.choices) == 1 and r.choices[0].index == 0 and r.choices[0].logprobs is None
    assert r.usage.completion_tokens == 18
    scored = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=3, temperature=1.0, seed=9,
                                       logprobs=0, extra_body={"min_tokens": 6})
    best = max(scored.choices, key=lambda c: sum(c.logprobs.token_logprobs))
    assert r.choices[0].text == best.text  # the same three sequences (same seeds), the likeliest kept


def test_penalties_change_the_output_and_logit_bias_forces_a_token(client, tok):
    plain = _greedy(client, max_tokens=24, extra_body={"min_tokens": 24}).choices[0].text
    for field in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        assert _greedy(client, max_tokens=24, extra_body={"min_tokens": 24}, **field).choices[0].text != plain
    forced = 300
    r = _greedy(client, logit_bias={str(forced): 100}, logprobs=0, extra_body={"min_tokens": 8})
    word = tok.decode([forced], skip_special_tokens=False)
    assert r.choices[0].logprobs.tokens == [word] * 8


def test_echo_stop_token_ids_and_max_completion_tokens(client):
    base = _greedy(client, logprobs=0, extra_body={"min_tokens": 8})
    echoed = _greedy(client, echo=True, extra_body={"min_tokens": 8})
    assert echoed.choices[0].text == PROMPT + base.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, echo=True, stream=True,
                                            extra_body={"min_tokens": 8}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, echo=True)
    assert len(ids.choices[0].text) > 0
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=3, extra_body={"min_tokens": 3})
    assert chat.usage.completion_tokens == 3


def test_stop_token_ids_end_the_choice(client, served):
    import json
    import urllib.request

    server = served[0]
    body = {"text_input": PROMPT, "max_tokens": 8, "min_tokens": 8, "exclude_input_in_output": True}
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/{MODEL}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    ids = json.loads(urllib.request.urlopen(req, timeout=60).read())["output_ids"]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"stop_token_ids": [ids[2]]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == ids.index(ids[2]) + 1


def test_bad_values_are_refused_with_400_naming_them(client):
    import openai

    for kwargs, param in [({"echo": True, "logprobs": 1}, "echo"), ({"logit_bias": {"999999": 5}}, "logit_bias"),
                          ({"n": 2, "best_of": 1}, "best_of"), ({"logprobs": 6}, "logprobs"),
                          ({"presence_penalty": -3}, "presence_penalty"),
                          ({"extra_body": {"stop_token_ids": [10**7]}}, "stop_token_ids")]:
        with pytest.raises(openai.BadRequestError) as info:
            _greedy(client, **kwargs)
        assert param in str(info.value), (param, info.value)


def test_the_stub_samples_on_the_compiled_kernel_where_the_host_compiles_it(served):
    """The seeded sampled requests above drew through the stub's sampler; its load line says which draw: the factory's
    kernel (compiled on this host), or numpy's and why not."""
    from model_factory.backend.generation.int8_attention import compile_problem

    log = served[0].log_file.read_text(errors="replace")
    want = "the factory kernel (libmf_sampling.so)" if compile_problem() is None else "the sampling kernel is not used"
    want = f"sampling: {want}"
    assert f"{MODEL} generates with" in log and want in log, log[-3000:]
