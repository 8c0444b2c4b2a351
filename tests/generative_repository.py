"""Text-generation models for the serving tests: built by the factory itself, deployed under a test's name.

:func:`layout_generative_model` runs the real build (``model_factory.build.pipeline.build`` on a recipe with
``task = "text-generation"``: the builder's graph checked against transformers, generation.json, the tokenizer,
the golden continuations, config.pbtxt through Triton's protobuf) once per (model folder, precision), then
copies the packaged model under the name a test asks for and sets the serving parameters it tunes in
config.pbtxt (through the protobuf, as an operator would: the version's own copy and the model's). The references the tests compare with are here
too: greedy tokens of ``transformers`` and the first near-tie.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Sequence

from model_factory.backend.generation.sequence import NullMetrics

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
    """The GenerationSpec the build packages for ``hf_dir`` (for in-process runtime tests)."""
    from model_factory.backend.contract import GenerationSpec

    spec = GenerationSpec.from_json((_built(Path(hf_dir), "fp32") / "generation.json").read_text())
    return replace(spec, weights_bytes=dict(weights_bytes))


_BUILDS: dict[tuple[str, ...], Path] = {}


def _built(hf_dir: Path, precision: str, quantization: str = "", draft: str = "") -> Path:
    """The version folder the factory builds from ``hf_dir`` serving ``precision`` (built once per session);
    ``quantization``: more lines of the recipe's [quantization] table (``int8_method = "dynamic"``); ``draft``: a
    precision built too and packaged beside the served one as its speculative draft (the recipe's [serving])."""
    key = (str(Path(hf_dir).resolve()), precision, quantization, draft)
    if key in _BUILDS:
        return _BUILDS[key]
    from model_factory.build.pipeline import build
    from model_factory.recipe import load_recipe

    examples = Path(__file__).resolve().parents[1] / "model_factory" / "examples"
    root = Path(tempfile.mkdtemp(prefix=f"mf-gen-build-{precision}-"))
    atexit.register(shutil.rmtree, root, True)  # the session's builds are gone with it
    for f in ("calibration.txt", "heldout.txt"):
        shutil.copyfile(examples / f, root / f)
    from model_factory.recipe import read_hf_config

    positions = read_hf_config(Path(hf_dir))["max_position_embeddings"]  # GPT-2: its n_positions
    precisions = list(dict.fromkeys(["fp32", precision] + ([draft] if draft else [])))
    listed = ", ".join(f'"{p}"' for p in precisions)
    recipe = root / "llm.toml"
    recipe.write_text(f"""precisions = [{listed}]
[model]
name = "llm"
task = "text-generation"
[source]
kind = "huggingface"
path = "{Path(hf_dir).resolve()}"
[shapes]
max_context = {positions}
[quantization]
calibration_data = "calibration.txt"
heldout_data = "heldout.txt"
min_token_agreement = 0.01
max_perplexity_ratio = 100.0
{quantization}
[repository]
path = "repo"
serve = "{precision}"
""" + (f'[serving]\nspeculative = "draft"\nspeculative_draft = "{draft}"\n' if draft else ""))
    # Random weights: the serving tests and benchmarks need the graph, not a gate (min_accuracy 0 keeps every
    # precision the build makes; the gate itself is tested in tests/build).
    vdir = Path(build(load_recipe(recipe), min_accuracy=0.0).version_dir)
    _BUILDS[key] = vdir
    return vdir


def layout_generative_model(hf_dir: Path, onnx_dir: Path | None, repository: Path, name: str = "tiny_llm",
                            precision: str = "fp32", quantization: str = "", draft: str = "", **parameters) -> Path:
    """``<repository>/<name>``: the factory's build of ``hf_dir`` (serving ``precision``), with ``parameters``
    (contract.ModelParameters fields: memory_budget_mib, max_active_sequences, ...) set in its config.pbtxt;
    returns the version folder. ``onnx_dir`` is not used (the build exports the graph itself)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from model_factory.backend.contract import Files, ModelParameters, format_parameters

    built = _built(Path(hf_dir), precision, quantization, draft)
    model_dir = Path(repository) / name
    if model_dir.exists():
        shutil.rmtree(model_dir)
    shutil.copytree(built.parent, model_dir)
    config = model_config_pb2.ModelConfig()
    text_format.Parse((model_dir / Files.CONFIG).read_text(), config)
    config.name = name
    for key, value in format_parameters(replace(ModelParameters(), **parameters)).items():
        if key in parameters:
            config.parameters[key].string_value = value
    # The version's own configuration (signed with it) and the model's, a copy of the served version's.
    for path in (model_dir / built.name / Files.CONFIG, model_dir / Files.CONFIG):
        path.write_text(text_format.MessageToString(config))
    return model_dir / built.name


# --------------------------------------------------------------------------- references


def reference_greedy(hf_dir: Path, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                     near_tie: float = NEAR_TIE):
    """``transformers`` greedy continuations of exactly ``max_tokens`` (eos masked) and, for each, the first near-tie step (or None):
    where the FP32 top-two logits differ by less than ``near_tie`` (1e-3) and float rounding may pick either (a
    graph in half precision rounds more: its tests pass a wider margin)."""
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
                if float(top[0] - top[1]) < near_tie:
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


@contextmanager
def served_with_openai(repository: Path, **frontend_options: Any) -> Iterator[tuple[Any, Any]]:
    """(server, frontend): a real Triton on ``repository`` and the OpenAI frontend over its text-generation models
    and prompt templates;
    both stopped after, the server's exit checked."""
    from model_factory.serving.openai_api import OpenAIFrontend, generative_models
    from model_factory.serving.openai_prompts import prompt_models
    from model_factory.serving.server import ServerOptions, TritonServer

    server = TritonServer(repository, options=ServerOptions(0, 0, 0)).start()
    assert not server.load_errors, server.load_errors
    frontend = OpenAIFrontend(server.http_url, generative_models(repository, server.ready_models),
                              prompts=prompt_models(repository, server.ready_models), **frontend_options).start()
    yield server, frontend
    frontend.stop()
    assert server.stop() == 0, server.log_tail(30)


@contextmanager
def served_variants(hf_dir: Path, onnx_dir: Path | None, repository: Path,
                    variants: dict[str, dict[str, Any]]) -> Iterator[Any]:
    """A real Triton serving one model under several names, each with its own serving parameters
    (``layout_generative_model``'s keywords): the settings a test compares side by side; its exit checked after."""
    from model_factory.serving.server import ServerOptions, TritonServer

    for name, parameters in variants.items():
        layout_generative_model(hf_dir, onnx_dir, repository, name, **parameters)
    server = TritonServer(repository, options=ServerOptions(0, 0, 0)).start()
    assert not server.load_errors, server.load_errors
    yield server
    assert server.stop() == 0, server.log_tail(30)


def generate_ids(server: Any, model: str, body: dict) -> list[int]:
    """The output token ids of one request to Triton's generate endpoint (``prompt_ids`` in the body)."""
    import urllib.request

    req = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/generate",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    ids = out["output_ids"]
    return ids if isinstance(ids, list) else [ids]


def metric_sum(server: Any, name: str, model: str) -> float:
    """A ``model_factory_<name>`` metric of ``model`` on the server's /metrics, summed over its other labels."""
    import urllib.request

    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"model_factory_{name}{{") and f'model="{model}"' in line)


# The zoo's families for the scheduler's equality tests (chunked, prefix hits, ...): each family's tiny model,
# and Mistral with a 16-token sliding window that chunks and prefixes reach past.
ZOO_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    f: (f, {}) for f in ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gpt2")}
ZOO_VARIANTS["mistral-window-16"] = ("mistral", {"sliding_window": 16})
_ZOO_FOLDERS: dict[str, Path] = {}


def zoo_engine(variant: str, tmp_path_factory: Any) -> tuple[Any, Any]:
    """(GenerationSpec, CausalLM) of ``variant``'s FP32 build (``ZOO_VARIANTS``): the model written and built once
    per session, whichever test asks first; a CausalLM of its own for each caller (one thread)."""
    import pytest

    from model_factory.backend.contract import Files, GenerationSpec
    from model_factory.backend.generation.causal_lm import CausalLM
    from tests.generative_models import make_causal_lm

    pytest.importorskip("onnxruntime_genai")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    family, changes = ZOO_VARIANTS[variant]
    if variant not in _ZOO_FOLDERS:
        hf = make_causal_lm(family, tmp_path_factory.mktemp(f"zoo-{variant}") / "hf")
        if changes:
            cfg = json.loads((hf / "config.json").read_text())
            cfg.update(changes)
            (hf / "config.json").write_text(json.dumps(cfg))
        _ZOO_FOLDERS[variant] = hf
    vdir = _built(_ZOO_FOLDERS[variant], "fp32")
    spec = GenerationSpec.from_json((vdir / Files.GENERATION).read_text())
    if changes.get("sliding_window"):
        assert spec.sliding_window == changes["sliding_window"]
    return spec, CausalLM(vdir / Files.ONNX, threads=1, pad_token_id=spec.pad_token_id or 0)


class EndsAt:
    """A generative runtime (``CausalLM``'s prefill and decode), its logits made to choose end-of-sequence as the
    ``n``-th generated token of a ``prompt``-token prompt (a text that ends before the ``max_tokens`` its client asked
    for), in a decode or a resumed prefill (tests/backend/test_kv_blocks.py, benchmarks/bench_paged_kv.py)."""

    def __init__(self, model, eos: int, prompt: int, n: int) -> None:
        self.model, self.eos, self.end = model, eos, prompt + n - 1  # the tokens held when that row is computed

    def _ending(self, logits, totals):
        import numpy as np

        out = np.array(logits, copy=True)
        for row, total in enumerate(totals):
            if total == self.end:
                out[row][..., self.eos] = 1e9
        return out

    def prefill(self, prompts, views, past=None, **kw):
        logits = self.model.prefill(prompts, views, past=past, **kw)
        return self._ending(logits, [len(p) + (past[i] if past else 0) for i, p in enumerate(prompts)])

    def decode(self, tokens, lengths, views, **kw):
        return self._ending(self.model.decode(tokens, lengths, views, **kw), [n + 1 for n in lengths])


class SpeculationCounts(NullMetrics):
    """A scheduler's metrics that count speculative decoding's verifications (``drafts``), the tokens drafted and
    those accepted (every other report dropped)."""

    def __init__(self) -> None:
        self.drafts, self.drafted, self.accepted = 0, 0, 0

    def speculated(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.drafted += drafted
        self.accepted += accepted


def run_to_end(sched: Any, check: Any = lambda: None, limit: int = 20_000) -> int:
    """Step an in-process scheduler until it has no work, ``check()`` after each step; returns the most sequences
    that ran at once. Fails the test if it has not finished after ``limit`` steps."""
    peak = 0
    for _ in range(limit):
        if not sched.has_work():
            return peak
        sched.step()
        peak = max(peak, len(sched.running))
        check()
    raise AssertionError("the scheduler did not finish")


def int8_kernel_engine(hf_dir: Path) -> tuple[Any, Any]:
    """(GenerationSpec, CausalLM) of ``hf_dir``'s INT4 build with the INT8 KV cache, its attention on the factory's
    kernel (one thread); the test is skipped where the kernel is not used (no C++ compiler, no AVX2)."""
    import shutil

    import pytest

    from model_factory.backend.contract import Files, GenerationSpec, onnx_file
    from model_factory.backend.generation import int8_attention as ia
    from model_factory.backend.generation.causal_lm import CausalLM

    if not (os.environ.get("CXX") or shutil.which("g++")) or "avx2" not in ia._cpu_flags().split():
        pytest.skip("no C++ compiler or no AVX2: the kernel is not used here")
    vdir = _built(hf_dir, "int4", 'kv_cache = "int8"')
    spec = GenerationSpec.from_json((vdir / Files.GENERATION).read_text()).for_precision("int4")
    assert spec.kv_dtype == "int8"
    return spec, CausalLM(vdir / onnx_file("int4"), threads=1, int8_attention="kernel")
