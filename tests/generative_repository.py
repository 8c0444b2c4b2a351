"""A Triton repository holding one tiny text-generation model, laid out here for the serving tests.

TO BE REPLACED AT MERGE by gen31's packaging (the one function that lays out a generative version folder):
until it lands, this module is the only place that writes such a folder, so switching is one import. It lays
out what ``backend/contract.py`` defines::

    <repo>/<name>/config.pbtxt           Triton's protobuf: GENERATE_INPUTS / GENERATE_OUTPUTS, max_batch_size 0,
                                          model_transaction_policy { decoupled: true }, one KIND_CPU instance,
                                          parameters from contract.ModelParameters (task = text-generation, ...)
    <repo>/<name>/1/model.py             the shim every model-factory version has, and mf_backend/ (the backend)
    <repo>/<name>/1/model.onnx(.data)    onnxruntime-genai's builder output (fp32), or model.int4.onnx(.data)
    <repo>/<name>/1/generation.json      contract.GenerationSpec from the Hugging Face config
    <repo>/<name>/1/tokenizer/           tokenizer.json, tokenizer_config.json (with the chat template)

Also the references the tests compare with: greedy tokens of ``transformers`` and the first near-tie.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

NEAR_TIE = 1e-3


def build_onnx(hf_dir: Path, out: Path, precision: str = "fp32") -> Path:
    """onnxruntime-genai's model builder on ``hf_dir`` (CPU graph, GroupQueryAttention, shared KV buffers)."""
    out = Path(out)
    if not (out / "model.onnx").is_file():
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
                        "-p", precision, "-e", "cpu", "-c", str(out / "cache")], check=True, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def generation_spec(hf_dir: Path, weights_bytes: dict[str, int]):
    from model_factory.backend.contract import GenerationSpec, SamplingDefaults

    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    eos = cfg["eos_token_id"]
    tc = json.loads((Path(hf_dir) / "tokenizer_config.json").read_text())
    return GenerationSpec(
        family=cfg["model_type"], num_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads), head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"], max_context=cfg["max_position_embeddings"],
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]), bos_token_id=cfg.get("bos_token_id"),
        pad_token_id=cfg.get("pad_token_id"), weights_bytes=weights_bytes, defaults=SamplingDefaults(),
        chat_template=tc.get("chat_template"))


def _rename_onnx(src_dir: Path, dest: Path, name: str) -> None:
    """Copy the builder's model.onnx (+ model.onnx.data) as ``name`` (+ ``name.data``), the data reference fixed."""
    import onnx

    model = onnx.load(str(src_dir / "model.onnx"), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = name + ".data"
    onnx.save(model, str(dest / name))
    shutil.copyfile(src_dir / "model.onnx.data", dest / (name + ".data"))


def config_pbtxt(name: str, parameters) -> str:
    """config.pbtxt through Triton's protobuf, from the contract's generate I/O."""
    from model_factory.backend.contract import GENERATE_INPUTS, GENERATE_OUTPUTS, format_parameters
    from model_factory.build.repository import config_to_pbtxt

    def tensor(t, is_input):
        d = {"name": t.name, "data_type": t.data_type, "dims": list(t.dims)}
        if is_input and t.optional:
            d["optional"] = True
        return d

    config = {"name": name, "backend": "python", "max_batch_size": 0,
              "input": [tensor(t, True) for t in GENERATE_INPUTS],
              "output": [tensor(t, False) for t in GENERATE_OUTPUTS],
              "model_transaction_policy": {"decoupled": True},
              "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
              "parameters": {k: {"string_value": v} for k, v in format_parameters(parameters).items()}}
    return config_to_pbtxt(config)


def layout_generative_model(hf_dir: Path, onnx_dir: Path, repository: Path, name: str = "tiny_llm",
                            precision: str = "fp32", **parameters) -> Path:
    """Lay out ``<repository>/<name>`` from a Hugging Face folder and its built ONNX; returns the version folder.

    ``parameters``: contract.ModelParameters fields (memory_budget_mib, max_active_sequences, ...).
    """
    from model_factory.backend.contract import TEXT_GENERATION, Files, ModelParameters, onnx_file
    from model_factory.build.repository import _copy_backend

    model_dir = Path(repository) / name
    if model_dir.exists():
        shutil.rmtree(model_dir)
    vdir = model_dir / "1"
    vdir.mkdir(parents=True)
    _copy_backend(vdir)
    file = onnx_file(precision)
    _rename_onnx(Path(onnx_dir), vdir, file)
    weights = (vdir / file).stat().st_size + (vdir / (file + ".data")).stat().st_size
    spec = generation_spec(hf_dir, {precision: weights})
    (vdir / Files.GENERATION).write_text(spec.to_json())
    tok = vdir / Files.TOKENIZER_DIR
    tok.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(hf_dir) / f, tok / f)
    params = replace(ModelParameters(), task=TEXT_GENERATION, precision=precision, onnx_file=file,
                     vocab_size=spec.vocab_size, **parameters)
    (model_dir / Files.CONFIG).write_text(config_pbtxt(name, params))
    return vdir


# --------------------------------------------------------------------------- references


def reference_greedy(hf_dir: Path, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]):
    """``transformers`` greedy continuations of exactly ``max_tokens`` (eos masked) and, for each, the first near-tie step (or None):
    where the FP32 top-two logits differ by less than 1e-3 and float rounding may pick either."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.eval()
    out = []
    with torch.no_grad():
        for prompt, n in zip(prompts, max_tokens):
            # min_new_tokens = n: eos masked, as a request with min_tokens = max_tokens is served
            res = model.generate(torch.tensor([list(prompt)]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=0)
            tokens = res.sequences[0, len(prompt):].tolist()
            tie = None
            for step, logits in enumerate(res.scores):
                top = torch.topk(logits[0].float(), 2).values
                if float(top[0] - top[1]) < NEAR_TIE:
                    tie = step
                    break
            out.append((tokens, tie))
    return out


def agree_until_tie(got: Sequence[int], want: Sequence[int], tie: int | None) -> bool:
    """Tokens equal up to (not including) the first near-tie step, or all of them without one."""
    end = len(want) if tie is None else tie
    return list(got[:end]) == list(want[:end])


def write_continuations(vdir: Path, hf_dir: Path, prompts: Sequence[Sequence[int]], max_tokens: int,
                        min_agreement: float = 0.99) -> dict:
    """``acceptance/continuations.json`` (contract.Files.CONTINUATIONS) from transformers' greedy tokens."""
    from model_factory.backend.contract import Files

    ref = reference_greedy(hf_dir, prompts, [max_tokens] * len(prompts))
    data = {"max_tokens": max_tokens, "min_agreement": min_agreement,
            "prompts": [{"text": None, "prompt_ids": list(p), "tokens": t, "near_tie": tie}
                        for p, (t, tie) in zip(prompts, ref)]}
    folder = Path(vdir) / Files.ACCEPTANCE_DIR
    folder.mkdir(exist_ok=True)
    (folder / Files.CONTINUATIONS).write_text(json.dumps(data))
    return data
