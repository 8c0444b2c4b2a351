"""The LM head at the asked positions only: the rewritten graph gives the builder's graph's logits at those
positions (prefill of right-padded prompts, batched decode, every position for teacher-forced scoring), its
logits hold only the positions asked, and a graph it cannot rewrite is refused with the reason."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai (extra export) builds the generative graphs")


@pytest.fixture(scope="module")
def graphs(tiny_llm, tmp_path_factory):
    """(hf folder, the builder's graph, the same graph rewritten, the packaged GenerationSpec)."""
    from model_factory.build_engines.logits_positions import select_logits_positions
    from tests.generative_repository import generation_spec

    hf, onnx_dir = tiny_llm
    rewritten = tmp_path_factory.mktemp("positions") / "graph"
    shutil.copytree(onnx_dir, rewritten)
    assert select_logits_positions(rewritten / "model.onnx") is True
    assert select_logits_positions(rewritten / "model.onnx") is False  # already rewritten: left as it is
    return hf, onnx_dir / "model.onnx", rewritten / "model.onnx", generation_spec(hf, {})


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, 400, int(length)))) for length in rng.integers(5, 40, n)]


def test_the_rewritten_graph_serves_the_same_logits(graphs):
    from model_factory.backend.generation.causal_lm import CausalLM
    from model_factory.backend.generation.kv_slots import KVSlots

    _, whole, rewritten, spec = graphs
    prompts = _prompts(4)
    out = {}
    for name, path in (("whole", whole), ("rewritten", rewritten)):
        model = CausalLM(path, threads=1)
        assert model.selects_positions is (name == "rewritten")
        slots = KVSlots(spec, 4, 1 << 28, max_context=128)
        first = model.prefill(prompts, slots.views(0, 4))  # right-padded to the longest: each row's last token
        tokens = [int(t) for t in first.argmax(-1)]
        second = model.decode(tokens, [len(p) for p in prompts], slots.views(0, 4))
        slots.clear()
        every = model.position_logits(prompts[0], slots.views(0, 1))
        out[name] = (first, second, every)
    for a, b in zip(out["whole"], out["rewritten"]):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    assert out["whole"][2].shape[0] == len(prompts[0])  # teacher-forced: every position


def test_kept_bindings_give_the_logits_of_fresh_ones_step_after_step(graphs):
    """The engine keeps one I/O binding per KV view (rebinding only ids, mask, positions and a new logits array):
    eight decode steps, the batch shrinking midway as the scheduler's does, equal to fresh bindings bit for bit,
    and the logits a step returned untouched by the later steps."""
    from model_factory.backend.generation.causal_lm import CausalLM
    from model_factory.backend.generation.kv_slots import KVSlots

    _, _, rewritten, spec = graphs
    kept, fresh = CausalLM(rewritten, threads=1), CausalLM(rewritten, threads=1)
    fresh._vocab = None  # every step binds everything again, as before bindings were kept
    assert kept._vocab == spec.vocab_size
    prompts = _prompts(3, seed=1)
    runs = {}
    for name, model in (("kept", kept), ("fresh", fresh)):
        slots = KVSlots(spec, 3, 1 << 28, max_context=96)
        logits = [model.prefill(prompts, slots.views(0, 3))]
        when_made = [logits[0].copy()]
        lengths = [len(p) for p in prompts]
        for step in range(8):
            rows = 3 if step < 4 else 2  # the third sequence ends: the batch is the first two slots
            tokens = [int(t) for t in logits[-1][:rows].argmax(-1)]
            logits.append(model.decode(tokens, lengths[:rows], slots.views(0, rows)))
            when_made.append(logits[-1].copy())
            lengths = [n + 1 for n in lengths]
        runs[name] = when_made, logits
    for a, b in zip(runs["kept"][0], runs["fresh"][0]):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(*runs["kept"]):  # what each step returned is still what it computed
        np.testing.assert_array_equal(a, b)
    assert len(kept._bindings) == 2 and not fresh._bindings  # one per views object: (0, 3) and (0, 2)


def test_the_head_runs_only_on_the_asked_positions(graphs):
    import onnxruntime as ort

    from model_factory.backend.contract import LOGITS, LOGITS_POSITIONS

    _, _, rewritten, spec = graphs
    sess = ort.InferenceSession(str(rewritten), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.asarray([[5, 6, 7, 8], [9, 10, 11, 0]], np.int64),
             "attention_mask": np.asarray([[1, 1, 1, 1], [1, 1, 1, 0]], np.int64),
             LOGITS_POSITIONS: np.asarray([[3], [2]], np.int64)}
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values."):
            feeds[i.name] = np.zeros((2, spec.num_kv_heads, 8, spec.head_dim), np.float32)
    logits = sess.run([LOGITS], feeds)[0]
    assert logits.shape[:2] == (2, 1)
    feeds[LOGITS_POSITIONS] = np.asarray([[0, 1, 2, 3], [0, 1, 2, 2]], np.int64)
    every = sess.run([LOGITS], feeds)[0]
    assert every.shape[:2] == (2, 4)
    np.testing.assert_allclose(every[0, 3], logits[0, 0], atol=1e-5)  # row 0's token 3, asked alone or with all
    np.testing.assert_allclose(every[1, 2], logits[1, 0], atol=1e-5)  # row 1's last real token (padded after it)
    np.testing.assert_allclose(every[1, 3], every[1, 2], atol=0)  # a position asked twice: the same row twice


def test_the_build_runner_reads_both_graphs_alike(graphs):
    from model_factory.build_engines.lm_graph import DecoderRunner

    _, whole, rewritten, spec = graphs
    prompt = _prompts(1, seed=3)[0]
    a, b = (DecoderRunner(p, 96, spec.head_dim, threads=1) for p in (whole, rewritten))
    np.testing.assert_allclose(a.logits(prompt), b.logits(prompt), atol=1e-5)
    assert a.greedy(prompt, 12) == b.greedy(prompt, 12)
    assert a.token_nll(prompt)[1] == b.token_nll(prompt)[1] == len(prompt) - 1


def test_the_build_runners_batched_decode_launch_gives_each_row_the_one_row_logits(graphs):
    """DecoderRunner.decode_launch (the gate's speed at many streams): one launch of several rows after the same
    cached zeros gives every row the logits a one-row step gives, on both graphs."""
    from model_factory.build_engines.lm_graph import DecoderRunner

    _, whole, rewritten, spec = graphs
    for path in (whole, rewritten):
        runner = DecoderRunner(path, 32, spec.head_dim, threads=1)
        seconds, logits = runner.decode_launch(5, 12)
        one = DecoderRunner(path, 32, spec.head_dim, threads=1)._step([1], 12, last_only=True)[-1]
        assert seconds > 0 and logits.shape == (5, one.shape[-1])
        for row in logits:
            np.testing.assert_allclose(row, one, atol=1e-4)
        with pytest.raises(ValueError, match="exceed max_context"):
            runner.decode_launch(2, 32)


def test_a_graph_without_a_normalized_lm_head_is_refused(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    from model_factory.build_engines.logits_positions import select_logits_positions
    from model_factory.errors import FactoryError

    weight = helper.make_tensor("w", TensorProto.FLOAT, [4, 6], [0.1] * 24)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["logits"])], "head",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 6])], [weight])
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    before = path.read_bytes()
    with pytest.raises(FactoryError, match="normalized hidden state.*Fix:"):
        select_logits_positions(path)
    assert path.read_bytes() == before  # nothing half-written
