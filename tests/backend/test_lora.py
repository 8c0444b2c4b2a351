"""The backend's LoRA room (generation/lora.py): the base graph rewritten with per-row adapter inputs, the adapter
table's slots under max_loras, and the refusal of an adapter built on another base.

The rewritten graph runs the session's tiny Llama (tests/conftest.py ``tiny_llm``) with random adapter pairs: a launch
of rows on the base and on two adapters gives each row what that row gives alone (one continuous batch, each row its
own product), slot 0 gives the packaged graph's logits exactly, and an adapter's row differs from the base's. That the
product is PEFT's is the build's check (tests/build/test_adapter_build.py) and the serving test's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from model_factory.backend.generation.causal_lm import CausalLM
from model_factory.backend.generation.kv_slots import KVSlots
from model_factory.backend.generation.lora import AdapterError, AdapterTable, Found, discover, prepare
from model_factory.backend.lora_contract import ADAPTER_SPEC, ADAPTER_WEIGHTS, AdapterSpec
from tests.generative_repository import generation_spec

MODULES = ["layers.0.attn.qkv_proj", "layers.1.mlp.down_proj"]


def _adapter(folder, name: str, shapes: dict, rank: int, seed: int, base_digests=None) -> Found:
    rng = np.random.default_rng(seed)
    arrays = {}
    for module, (fan_in, fan_out) in shapes.items():
        arrays[module + ".A"] = rng.normal(0, 0.5, (fan_in, rank)).astype(np.float32)
        arrays[module + ".B"] = rng.normal(0, 0.5, (rank, fan_out)).astype(np.float32)
    vdir = folder / name / "1"
    vdir.mkdir(parents=True)
    np.savez(vdir / ADAPTER_WEIGHTS, **arrays)
    spec = AdapterSpec(name, 1, "tiny_llm", 1, base_digests or {}, rank, tuple(sorted(shapes)),
                       (vdir / ADAPTER_WEIGHTS).stat().st_size)
    (vdir / ADAPTER_SPEC).write_text(spec.to_json())
    return Found(spec, vdir, None)


@pytest.fixture(scope="module")
def lora_model(tiny_llm, tmp_path_factory):
    hf, onnx_dir = tiny_llm
    spec = generation_spec(hf, {})
    graph = prepare(onnx_dir / "model.onnx", MODULES)  # its weights external: read from its folder
    model = CausalLM(onnx_dir / "model.onnx", threads=1, lora=graph)
    folder = tmp_path_factory.mktemp("adapters")
    found = [_adapter(folder, "a", graph.shapes, 4, 1), _adapter(folder, "b", {MODULES[1]: graph.shapes[MODULES[1]]}, 2, 2)]
    table = AdapterTable(found, {}, model.lora_shapes, max_loras=4)
    model.lora_table = table
    plain = CausalLM(onnx_dir / "model.onnx", threads=1)
    return spec, model, plain, table


def test_rows_of_the_base_and_two_adapters_in_one_launch_each_as_alone(lora_model) -> None:
    spec, model, plain, table = lora_model
    a, b = table.acquire("a"), table.acquire("b")
    prompts = [[5, 9, 200, 31], [5, 9, 200, 31], [5, 9, 200, 31, 17, 3]]
    rows = [0, a, b]
    slots = KVSlots(spec, 3, 1 << 28)
    together = model.prefill(prompts, slots.views(0, 3), adapters=rows)
    for r, (prompt, slot) in enumerate(zip(prompts, rows)):
        alone = KVSlots(spec, 1, 1 << 28)
        np.testing.assert_allclose(together[r], model.prefill([prompt], alone.views(0, 1), adapters=[slot])[0],
                                   rtol=1e-4, atol=1e-4)
    # Slot 0 is the packaged graph exactly; an adapter's row is not the base's.
    base = plain.prefill([prompts[0]], KVSlots(spec, 1, 1 << 28).views(0, 1))[0]
    np.testing.assert_allclose(together[0], base, rtol=1e-5, atol=1e-5)
    assert np.abs(together[1] - together[0]).max() > 1e-2
    # A decode step mixes them too: each row continues with its own adapter.
    step = model.decode([1, 2, 3], [len(p) for p in prompts], slots.views(0, 3), adapters=rows)
    assert step.shape == (3, together.shape[1]) and np.abs(step[1] - step[0]).max() > 1e-2
    table.release(a)
    table.release(b)


def test_a_launch_binds_only_the_slots_its_rows_use_and_masks_each_rows_others(lora_model, tmp_path) -> None:
    spec, model, plain, _ = lora_model
    found = [_adapter(tmp_path, n, model.lora_shapes, 2 + i, 10 + i) for i, n in enumerate(("p", "q", "r", "t"))]
    table = AdapterTable(found, {}, model.lora_shapes, max_loras=3)
    model.lora_table, kept = table, model.lora_table
    prompts = [[5, 9, 200, 31, 8]] * 3

    def each_as_alone(rows: list[int]) -> None:
        together = model.prefill(prompts, KVSlots(spec, 3, 1 << 28).views(0, 3), adapters=rows)
        for row, slot in enumerate(rows):
            alone = model.prefill([prompts[0]], KVSlots(spec, 1, 1 << 28).views(0, 1), adapters=[slot])[0]
            np.testing.assert_allclose(together[row], alone, rtol=1e-4, atol=1e-4)

    try:
        p, q, r = (table.acquire(n) for n in ("p", "q", "r"))
        mask, used = table.mask([r, 0, p, r])
        assert used == [p, r] and mask.shape == (4, 1, 2 * table.rank)  # q's slot between them is not bound
        assert mask[1].sum() == 0 and mask[0, 0, table.rank:].all() and not mask[0, 0, :table.rank].any()
        each_as_alone([r, 0, p])  # p and r are not neighbours: their pairs bound from a compact copy
        each_as_alone([q, r, 0])  # neighbours: a view of the stacks
        for slot in (p, q, r):
            table.release(slot)
        t = table.acquire("t")  # p, the least recently used, evicted: t written into its slot
        assert t == p
        r = table.acquire("r")
        each_as_alone([t, 0, r])  # the compact copy made again: its slot's contents changed
        np.testing.assert_array_equal(table._compact[MODULES[0]][0][:table.rank],
                                      table.stacks[MODULES[0]][0][(t - 1) * table.rank:t * table.rank])
        # A launch of base rows only binds no adapter columns: the packaged graph's logits.
        assert table.mask([0, 0])[0].shape == (2, 1, 0)
        base = model.prefill(prompts[:2], KVSlots(spec, 2, 1 << 28).views(0, 2), adapters=[0, 0])
        np.testing.assert_allclose(base, plain.prefill(prompts[:2], KVSlots(spec, 2, 1 << 28).views(0, 2)), rtol=1e-5,
                                   atol=1e-5)
        table.release(t)
        table.release(r)
    finally:
        model.lora_table = kept


def test_slots_are_loaded_and_evicted_under_max_loras(lora_model, tmp_path) -> None:
    _, model, _, _ = lora_model
    found = [_adapter(tmp_path, n, model.lora_shapes, 2, i) for i, n in enumerate(("x", "y"))]
    table = AdapterTable(found, {"z": "adapter z is not served: refused"}, model.lora_shapes, max_loras=1)
    x = table.acquire("x")
    with pytest.raises(AdapterError) as busy:
        table.acquire("y")  # the only slot is held by a running request
    assert busy.value.busy and "max_loras" in str(busy.value)
    table.release(x)
    y = table.acquire("y")  # x is idle: evicted, its slot reused
    assert y == x and table.loaded() == ("y",) and table.running() == ("y",)
    np.testing.assert_array_equal(table.pair(MODULES[0], y)[0], np.load(found[1].folder / ADAPTER_WEIGHTS)[MODULES[0] + ".A"])
    with pytest.raises(AdapterError) as unknown:
        table.acquire("nobody")
    assert unknown.value.unknown and "nobody" in str(unknown.value)
    with pytest.raises(AdapterError, match="adapter z is not served"):
        table.acquire("z")


def test_an_adapter_of_another_base_is_refused_by_name(tmp_path) -> None:
    repo = tmp_path / "repo"
    vdir = repo / "tiny_llm" / "1"
    vdir.mkdir(parents=True)
    (vdir / "model.onnx").write_bytes(b"this base")
    good = _adapter(repo, "ours", {MODULES[0]: (4, 4)}, 1, 0)
    spec = json.loads((good.folder / ADAPTER_SPEC).read_text())
    import hashlib

    # model.int4.onnx is not in this view (serve copies the served precision's weights): compared where present.
    spec["base_digests"] = {"model.onnx": hashlib.sha256(b"this base").hexdigest(), "model.int4.onnx": "0" * 64}
    (good.folder / ADAPTER_SPEC).write_text(json.dumps(spec))
    _adapter(repo, "theirs", {MODULES[0]: (4, 4)}, 1, 1,
             base_digests={"model.onnx": hashlib.sha256(b"another base").hexdigest()})
    _adapter(repo, "elsewhere", {MODULES[0]: (4, 4)}, 1, 2)
    other = json.loads((repo / "elsewhere" / "1" / ADAPTER_SPEC).read_text())
    (repo / "elsewhere" / "1" / ADAPTER_SPEC).write_text(json.dumps({**other, "base": "another_model"}))
    found, refused, modules = discover(vdir, None)
    assert [f.spec.name for f in found] == ["ours"] and modules == [MODULES[0]]
    assert set(refused) == {"theirs"}  # an adapter of another model is not this base's at all
    assert "adapter theirs was built for tiny_llm version 1 whose model.onnx differs" in refused["theirs"]
    assert "another base" in refused["theirs"]


def test_a_request_names_its_adapter_in_sampling_parameters() -> None:
    from model_factory.backend.contract import GenerationSpec
    from model_factory.backend.generation.requests import read_generate_request, request_inputs
    from model_factory.backend.generation.sampling import SamplingError

    spec = GenerationSpec(family="llama", num_layers=1, num_attention_heads=1, num_kv_heads=1, head_dim=4,
                          hidden_size=4, vocab_size=100, max_context=64, eos_token_ids=(2,))

    def sent(parameters: dict) -> dict:
        return {"prompt_ids": np.array([3, 4], dtype=np.int32),
                "sampling_parameters": np.array([json.dumps(parameters).encode()], dtype=np.object_)}

    req = read_generate_request(sent({"lora_name": "support", "max_tokens": 3}).get, None, spec, 64)
    assert req.adapter == "support" and req.params.max_tokens == 3
    # A rollout's shadow asks the candidate the same request, adapter included.
    assert read_generate_request(request_inputs(req).get, None, spec, 64).adapter == "support"
    assert read_generate_request(sent({}).get, None, spec, 64).adapter is None
    with pytest.raises(SamplingError, match="lora_name"):
        read_generate_request(sent({"lora_name": 7}).get, None, spec, 64)


def test_adapters_beside_an_int8_dynamic_base_are_refused_by_name_and_the_base_loads(tiny_llm, tmp_path) -> None:
    """INT8 dynamic's graph computes each projection with MatMulInteger (``.../MatMul_quant``): the rewrite finds no
    MatMul to add to, so the adapters are refused with why and the base loads without them (before, the rewrite's
    ValueError stopped the base's load)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from model_factory.backend.generation.lora import prepare_or_refuse

    _, onnx_dir = tiny_llm
    int8 = tmp_path / "model.int8.onnx"
    quantize_dynamic(str(onnx_dir / "model.onnx"), str(int8), weight_type=QuantType.QInt8)
    shapes = prepare(onnx_dir / "model.onnx", MODULES).shapes
    found = [_adapter(tmp_path / "adapters", "a", shapes, 2, 1)]
    refused: dict[str, str] = {}
    modules = list(MODULES)
    assert prepare_or_refuse(int8, found, refused, modules, "int8") is None
    assert found == [] and modules == []
    assert "adapter a is not served on this base's int8 graph" in refused["a"] and "Fix: " in refused["a"]
    table = AdapterTable(found, refused, {}, max_loras=4)
    with pytest.raises(AdapterError, match="int8 graph"):
        table.acquire("a")
    model = CausalLM(int8, threads=1, lora=None)  # the base as the stub then loads it
    assert model.lora_shapes == {}
    # The FP32 graph keeps them: rewritten.
    found, modules = [_adapter(tmp_path / "fp32", "a", shapes, 2, 1)], list(MODULES)
    assert prepare_or_refuse(onnx_dir / "model.onnx", found, {}, modules, "fp32").shapes == shapes
    assert len(found) == 1 and modules == MODULES


def test_the_factorys_weight_only_int4_graph_is_rewritten_as_its_fp32_graph(lora_model, tiny_llm, tmp_path) -> None:
    """The factory's weight-only INT8 / INT4 (lm_blockwise) names each projection ``.../MatMul_Q4`` (a MatMulNBits):
    the same modules and shapes as the FP32 graph, slot 0 the quantized graph's logits exactly, an adapter's row its
    own (before, no module was found there and the adapters stopped the base's load)."""
    from model_factory.build_engines.lm_blockwise import blockwise_graph

    spec, fp32_model, _, table = lora_model
    _, onnx_dir = tiny_llm
    int4, _ = blockwise_graph(onnx_dir / "model.onnx", tmp_path / "int4", 32, lambda names, head: set())
    prepared = prepare(int4, MODULES)
    assert prepared.shapes == fp32_model.lora_shapes
    model = CausalLM(int4, threads=1, lora=prepared)
    model.lora_table = table
    prompt = [5, 9, 200, 31]
    a = table.acquire("a")
    try:
        got = model.prefill([prompt, prompt], KVSlots(spec, 2, 1 << 28).views(0, 2), adapters=[0, a])
    finally:
        table.release(a)
    alone = CausalLM(int4, threads=1).prefill([prompt], KVSlots(spec, 1, 1 << 28).views(0, 1))[0]
    np.testing.assert_allclose(got[0], alone, rtol=1e-5, atol=1e-5)
    assert np.abs(got[1] - got[0]).max() > 1e-2


def _mixed_adapter(folder, name: str, shapes: dict, ranks: dict, seed: int) -> Found:
    """An adapter whose pairs have a rank of their own per module (as Gemma's packed qkv_proj: 3x the others)."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for module, (fan_in, fan_out) in shapes.items():
        arrays[module + ".A"] = rng.normal(0, 0.5, (fan_in, ranks[module])).astype(np.float32)
        arrays[module + ".B"] = rng.normal(0, 0.5, (ranks[module], fan_out)).astype(np.float32)
    vdir = folder / name / "1"
    vdir.mkdir(parents=True)
    np.savez(vdir / ADAPTER_WEIGHTS, **arrays)
    spec = AdapterSpec(name, 1, "tiny_llm", 1, {}, max(ranks.values()), tuple(sorted(shapes)),
                       (vdir / ADAPTER_WEIGHTS).stat().st_size)
    (vdir / ADAPTER_SPEC).write_text(spec.to_json())
    return Found(spec, vdir, None)


def test_each_projection_is_as_wide_as_its_widest_pair_and_gives_the_padded_tables_logits(lora_model, tiny_llm,
                                                                                           tmp_path) -> None:
    """Two adapters whose qkv_proj pairs are wider than their down_proj ones: the graph gets a mask per width
    (lora_mask for the widest, lora_mask.<w>), the table each module's own width; a launch of the base and both
    adapters gives each row what the one-width (padded) table gives."""
    from model_factory.backend.generation.lora import pair_ranks

    spec, padded_model, _plain, _ = lora_model
    _hf, onnx_dir = tiny_llm
    shapes = padded_model.lora_shapes
    found = [_mixed_adapter(tmp_path, "w", shapes, {MODULES[0]: 6, MODULES[1]: 2}, 31),
             _mixed_adapter(tmp_path, "v", shapes, {MODULES[0]: 3, MODULES[1]: 4}, 32)]
    ranks = pair_ranks(found)
    assert ranks == {MODULES[0]: 6, MODULES[1]: 4}
    graph = prepare(onnx_dir / "model.onnx", MODULES, ranks)
    narrow = CausalLM(onnx_dir / "model.onnx", threads=1, lora=graph)
    names = {i.name for i in narrow.session.get_inputs()}
    assert {"lora_mask", "lora_mask.4"} <= names
    table = AdapterTable(found, {}, narrow.lora_shapes, max_loras=2, ranks=narrow.lora_ranks)
    assert table.ranks == ranks and table.stacks[MODULES[1]][0].shape[0] == 2 * 4
    narrow.lora_table = table
    wide = CausalLM(onnx_dir / "model.onnx", threads=1, lora=prepare(onnx_dir / "model.onnx", MODULES))
    wide.lora_table = AdapterTable(found, {}, wide.lora_shapes, max_loras=2)
    assert wide.lora_table.ranks == {MODULES[0]: 6, MODULES[1]: 6}
    prompts = [[5, 9, 200, 31], [5, 9, 200, 31], [5, 9, 200, 31, 17, 3]]
    got = []
    for model in (narrow, wide):
        rows = [0, model.lora_table.acquire("w"), model.lora_table.acquire("v")]
        got.append(model.prefill(prompts, KVSlots(spec, 3, 1 << 28).views(0, 3), adapters=rows))
    np.testing.assert_allclose(got[0], got[1], rtol=1e-5, atol=1e-5)
    assert np.abs(got[0][1] - got[0][0]).max() > 1e-2 and np.abs(got[0][2] - got[0][1]).max() > 1e-2
