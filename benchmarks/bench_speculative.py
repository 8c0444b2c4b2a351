"""Speculative decoding by prompt lookup on and off: an extractive task (answers quoting a document in the prompt).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_speculative.py [--version-dir DIR] [--rounds 2] [--write]
    PYTHONPATH=. .venv/bin/python benchmarks/bench_speculative.py --draft int4 --version-dir DIR [--write]
    PYTHONPATH=. .venv/bin/python benchmarks/bench_speculative.py --served --version-dir DIR [--write]

With ``--draft PRECISION`` the drafts come from that precision's graph of the same version folder instead
(``speculative = "draft"``: generation/draft_model.py), and the draft graph decoding alone is timed beside (what
serving that precision instead would give, its tokens not FP32's); its own section (``speculative-draft-<p>``).

With ``--served`` the same workloads go through Triton and our OpenAI API instead (``/v1/completions``, the prompts as
token ids, greedy): the FP32 graph laid out twice in one repository with this checkout's backend, ``speculative``
off and ``prompt_lookup`` at this checkout's settings (written over the build's config.pbtxt, which may hold older
defaults), one server, our frontend; tokens from each response's
``usage``, the drafts from the server's ``/metrics``, the answers' texts compared; its own section
(``speculative-served``).

The real Gemma 3 270M (random weights quote nothing): the FP32 graph (``model.onnx``, float KV cache) of a packaged
version folder of the factory's build (``--version-dir``; default the gemma-bench build's, which keeps every
precision), on the backend's own scheduler in-process (``Scheduler`` over ``CausalLM`` and ``KVSlots``, 2 threads; no
Triton, no HTTP: what differs between the settings is the speculator alone). The documents are paragraphs of the
held-out text (``--data``: definitions of the Apache License 2.0), each followed by a question whose answer quotes
one definition; ``TOKENS`` greedy tokens each. Workloads, each on and off in alternating order round by round:

* **extractive, 1 stream**: ``ONE_STREAM`` of the requests one after another, each alone (the case issue 51's target names: >= 1.5x);
* **extractive, 8 streams**: the 8 requests at once (speculation drafts only while at most
  ``speculative_max_sequences`` sequences decode: does it turn itself off, and not regress?);
* **free text, 1 stream**: ``FREE`` prompts asking for a story (nothing to quote: what drafting costs where it does
  not pay).

Per workload and setting: output tokens/s (all tokens over the wall time), the tokens drafted, accepted and the
acceptance rate, and whether every request's tokens equal the same request's with speculation off. The section
between ``<!-- speculative:start -->`` and ``<!-- speculative:end -->`` is replaced.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from results_file import median_cell, publish, say, suffixed  # noqa: E402

START, END = "<!-- speculative:start -->", "<!-- speculative:end -->"
VERSION_DIR = Path("/work/gemma-cache/gemma-bench/work/builds/int8kv8/repo/gemma3/1")
DATA = Path("/work/gemma-cache/data/heldout.txt")
TOKENS, STREAMS = 64, 8
ONE_STREAM, FREE = 4, 2  # requests of the 1-stream workloads (extractive, free text)
SERVED = {"off": "gemma3-plain", "on": "gemma3-lookup"}  # --served: the model of each setting


def definitions(data: Path) -> list[str]:
    """The held-out text's definitions, one a line (``"Term" shall mean ...``)."""
    return [line.strip() for line in data.read_text().splitlines() if " shall mean " in line]


def workloads(tok, data: Path) -> dict[str, list[list[int]]]:
    """Prompt ids: ``extractive`` (a document of five definitions, a question quoting one of them) and ``free``."""
    defs = definitions(data)
    extractive = []
    for i in range(STREAMS):
        doc = [defs[(i + j) % len(defs)] for j in range(5)]
        term = doc[2].split('"')[1]
        text = ("Read the document and answer the question by quoting it.\n\nDocument:\n" + "\n".join(doc)
                + f"\n\nQuestion: How does the document define \"{term}\"? Quote its definition.\nAnswer: ")
        extractive.append([2] + tok.encode(text, add_special_tokens=False).ids)
    free = []
    for i in range(4):
        words = " ".join(defs[(3 * i + 1) % len(defs)].split()[:12])
        free.append([2] + tok.encode("Write a short story about a lawyer who loves the sea. " + words,
                                     add_special_tokens=False).ids)
    return {"extractive": extractive, "free": free}


class Counts:
    """The scheduler's metrics calls this benchmark reads: speculative drafts."""

    def __init__(self) -> None:
        self.drafts = self.drafted = self.accepted = 0

    def speculated(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.drafted += drafted
        self.accepted += accepted

    def __getattr__(self, name):  # every other call of NullMetrics: dropped
        return lambda *a, **k: None


def run(lm, spec, prompts: list[list[int]], at_once: bool, speculate: bool, k: int, draft=None) -> dict:
    from model_factory.backend.generation.kv_slots import KVSlots
    from model_factory.backend.generation.sampling import SamplingParams
    from model_factory.backend.generation.scheduler import Generation, Scheduler
    from model_factory.backend.generation.speculative import SpeculativeConfig, Speculator

    counts = Counts()
    sched = Scheduler(lm, KVSlots(spec, STREAMS, 1 << 34), None, spec.eos_token_ids, metrics=counts)
    if speculate:
        sched.speculator = Speculator(SpeculativeConfig(num_speculative_tokens=k), metrics=counts, draft=draft)
    params = SamplingParams(max_tokens=TOKENS)
    gens = []
    start = time.perf_counter()
    batches = [prompts] if at_once else [[p] for p in prompts]
    for batch in batches:
        gens += [sched.submit(Generation(list(p), params, lambda g, e: None)) for p in batch]
        while sched.has_work():
            sched.step()
    wall = time.perf_counter() - start
    out = sum(len(g.generated) for g in gens)
    return {"tokens/s": out / wall, "output tokens": out, "drafted": counts.drafted, "accepted": counts.accepted,
            "verifications": counts.drafts, "tokens": [g.generated for g in gens]}


@contextlib.contextmanager
def served(vdir: Path, max_context: int, work: Path, lookup: Any, spinning: str = "auto"):
    """Triton serving the FP32 graph of ``vdir`` twice (:data:`SERVED`: speculation off, prompt lookup with ``lookup``'s
    settings: a build's config.pbtxt may hold older defaults) and our OpenAI frontend over it; yields
    ``measure(prompts, at_once, speculate)``, :func:`run`'s result through the API (the answers' texts as its
    ``tokens``)."""
    from benchmarks.harness import gemma3
    from model_factory.serving.openai_api import OpenAIFrontend, generative_models
    from model_factory.serving.server import ServerOptions, TritonServer
    from tests.generative_repository import metric_sum

    repo = work / "repo-speculative-served"
    shutil.rmtree(repo, ignore_errors=True)
    for setting, model in SERVED.items():
        gemma3.layout_served(vdir, repo, model, "fp32", max_context, max_active_sequences=STREAMS, cpu_spinning=spinning,
                             **({"speculative": "prompt_lookup", "num_speculative_tokens": lookup.num_speculative_tokens,
                                 "prompt_lookup_max": lookup.prompt_lookup_max,
                                 "prompt_lookup_min": lookup.prompt_lookup_min} if setting == "on" else {}))
    server = TritonServer(repo, options=ServerOptions(0, 0, 0, startup_timeout_s=900)).start()
    try:
        assert not server.load_errors, server.load_errors
        with OpenAIFrontend(server.http_url, generative_models(repo, server.ready_models)) as fe:
            def counters(model: str) -> tuple[float, ...]:
                return tuple(metric_sum(server, f"spec_decode_num_{n}_total", model)
                             for n in ("drafts", "draft_tokens", "accepted_tokens"))

            def measure(prompts: list[list[int]], at_once: bool, speculate: bool) -> dict:
                model = SERVED["on" if speculate else "off"]
                before = counters(model)
                start = time.perf_counter()
                got = asyncio.run(_complete(fe.url, model, prompts, at_once))
                wall = time.perf_counter() - start
                time.sleep(1.5)  # the backend's metrics are flushed each second
                drafts, drafted, accepted = (b - a for a, b in zip(before, counters(model)))
                return {"tokens/s": sum(n for _, n in got) / wall, "output tokens": sum(n for _, n in got),
                        "drafted": int(drafted), "accepted": int(accepted), "verifications": int(drafts),
                        "tokens": [text for text, _ in got]}

            yield measure
    finally:
        server.stop()


async def _complete(url: str, model: str, prompts: list[list[int]], at_once: bool) -> list[tuple[str, int]]:
    """Each prompt's greedy answer through ``/v1/completions``: (text, completion tokens); one after another, or all at
    once."""
    import aiohttp

    async def one(session, prompt: list[int]) -> tuple[str, int]:
        body = {"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0}
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            answer = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"{model}: HTTP {resp.status}: {answer}")
        return answer["choices"][0]["text"], int(answer["usage"]["completion_tokens"])

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        if at_once:
            return list(await asyncio.gather(*(one(session, p) for p in prompts)))
        return [await one(session, p) for p in prompts]


def main() -> int:
    from tokenizers import Tokenizer

    from benchmarks.harness.run_header import LoadReading, run_header
    from model_factory.backend.contract import Files, GenerationSpec
    from model_factory.backend.generation.causal_lm import CausalLM

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version-dir", type=Path, default=VERSION_DIR)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-k", type=int, default=0, help="num_speculative_tokens (default: the method's, "
                    "contract.SPECULATIVE_TOKENS)")
    ap.add_argument("--section-suffix", default="", help="appended to the section's markers and title (a run on "
                    "another machine kept beside the first: --section-suffix epyc)")
    ap.add_argument("--draft", default="", help="a precision of the version folder whose graph drafts "
                    "(speculative = draft) instead of prompt lookup, e.g. int4")
    ap.add_argument("--served", action="store_true", help="through Triton and our OpenAI API (prompt lookup only)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-speculative"), help="--served: the repository's "
                    "parent folder")
    ap.add_argument("--spinning", default="auto", help="--served: both models' cpu_spinning (auto: off, their threads "
                    "outnumbering the cores; on: as one model served alone would)")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    if args.served and args.draft:
        ap.error("--served measures prompt lookup; --draft runs in-process")
    from model_factory.backend.contract import SPECULATIVE_TOKENS
    from model_factory.backend.generation.speculative import SpeculativeConfig

    args.k = args.k or SPECULATIVE_TOKENS["draft" if args.draft else "prompt_lookup"]
    lookup = SpeculativeConfig()
    vdir = args.version_dir
    spec = GenerationSpec.from_json((vdir / Files.GENERATION).read_text()).for_precision("fp32")
    lm = None if args.served else CausalLM(vdir / Files.ONNX, threads=2, pad_token_id=spec.pad_token_id or 0)
    draft = alone_lm = None
    if args.draft:
        from model_factory.backend.contract import onnx_file
        from model_factory.backend.generation.causal_lm import attention_kernel
        from model_factory.backend.generation.draft_model import load_draft
        from model_factory.backend.settings import parse_settings

        # The draft as the backend loads it for [serving] speculative = "draft" (its session never spins).
        settings = parse_settings({"name": "gemma3", "max_batch_size": 1, "parameters": {
            k: {"string_value": v} for k, v in {"speculative": "draft", "speculative_draft": args.draft}.items()}})
        draft = load_draft(vdir, None, settings, f"{vdir.name}/{Files.GENERATION}", 2, spec.max_context, None)
        # Served alone its session spins, as any served model's (cpu_spinning auto on these cores).
        alone_lm = CausalLM(vdir / onnx_file(args.draft), threads=2, pad_token_id=draft.spec.pad_token_id or 0,
                            int8_attention=attention_kernel("auto", draft.spec.kv_dtype))
        args.section_suffix = args.section_suffix or f"draft-{args.draft}"
    tok = Tokenizer.from_file(str(vdir / "tokenizer" / "tokenizer.json"))
    loads = workloads(tok, args.data)
    cases = {"extractive, 1 stream": (loads["extractive"][:ONE_STREAM], False),
             f"extractive, {STREAMS} streams": (loads["extractive"], True),
             "free text, 1 stream": (loads["free"][:FREE], False)}
    alone: dict[str, list[dict]] = {}  # --draft: the draft graph decoding alone, the 1-stream workloads
    runs: dict[tuple[str, str], list[dict]] = {}
    with contextlib.ExitStack() as stack:
        if args.served:
            args.section_suffix = args.section_suffix or "served"
            measure = stack.enter_context(served(vdir, spec.max_context, args.work,
                                                 SpeculativeConfig(num_speculative_tokens=args.k), args.spinning))
        else:
            def measure(prompts: list[list[int]], at_once: bool, speculate: bool) -> dict:
                return run(lm, spec, prompts, at_once, speculate, args.k, draft)
        say("warm-up")
        for speculate in (False, True) if args.served else (True,):
            measure(loads["free"][:1], False, speculate)
        load = LoadReading.begin()
        for r in range(args.rounds):
            for name, (prompts, at_once) in cases.items():
                for setting in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    got = measure(prompts, at_once, setting == "on")
                    runs.setdefault((name, setting), []).append(got)
                    say(f"round {r + 1} {name} {setting}: {got['tokens/s']:.2f} tokens/s, drafted {got['drafted']}, "
                        f"accepted {got['accepted']}")
                if alone_lm is not None and not at_once:
                    got = run(alone_lm, draft.spec, prompts, at_once, False, args.k)
                    alone.setdefault(name, []).append(got)
                    say(f"round {r + 1} {name} {args.draft} alone: {got['tokens/s']:.2f} tokens/s")
        load = load.finish()
    example = runs[("extractive, 1 stream", "off")][0]["tokens"][0]
    example = example if isinstance(example, str) else tok.decode(example)

    def cell(values: list[float]) -> str:
        return median_cell(values, 2)

    rows = []
    for name in cases:
        off, on = runs[(name, "off")], runs[(name, "on")]
        ratio = [a["tokens/s"] / b["tokens/s"] for a, b in zip(on, off)]
        same = all(a["tokens"] == b["tokens"] for a, b in zip(on, off))
        drafted, accepted = sum(x["drafted"] for x in on), sum(x["accepted"] for x in on)
        rate = f"{accepted / drafted:.2f}" if drafted else "–"
        rows.append(f"| {name} | {cell([x['tokens/s'] for x in off])} | {cell([x['tokens/s'] for x in on])} | "
                    f"**{cell(ratio)}x** | {on[0]['verifications']} | {on[0]['drafted']} / {on[0]['accepted']} | "
                    f"{rate} | {'yes' if same else '**no**'} |")
    start, end, title = suffixed(START, END, args.section_suffix)
    how = (f"`speculative = \"draft\"`, `speculative_draft = \"{args.draft}\"` (the {args.draft} graph of the same "
           f"version folder drafts greedily from its own KV slot), `num_speculative_tokens` {args.k}, "
           "`speculative_max_sequences` 1 (drafting only while one sequence decodes)" if args.draft else
           f"`speculative = \"prompt_lookup\"`, `num_speculative_tokens` {args.k} (at most: a match of n tokens drafts "
           "n + 1), "
           f"`prompt_lookup_max` {lookup.prompt_lookup_max}, `_min` {lookup.prompt_lookup_min}, "
           "`speculative_max_sequences` 1 (drafting only while one sequence decodes)")
    where = ("on the backend's scheduler in-process (2 threads; no Triton, no HTTP)" if not args.served else
             "served by Triton through our OpenAI API (`/v1/completions`, the prompts as token ids, `temperature` 0; "
             f"laid out twice in one repository with this checkout's backend, `{SERVED['off']}` with `speculative` "
             f"off and `{SERVED['on']}` with `prompt_lookup` as below, written over the build's config.pbtxt; both sessions' "
             f"2 threads on the 2 cores, `cpu_spinning` {args.spinning}); tokens from each response's `usage`, the drafts from the server's "
             "`/metrics`, the answers' texts compared")
    extra = []
    if alone:
        extra = ["", f"The {args.draft} graph decoding alone (plain decoding, its own tokens: what serving {args.draft} "
                 "instead gives), same prompts and rounds:", "",
                 f"| workload | {args.draft} alone tokens/s | FP32 with its drafts / {args.draft} alone | its tokens = FP32's |",
                 "| --- | ---: | ---: | --- |"]
        for name, got in alone.items():
            on = runs[(name, "on")]
            same = sum(a == b for g, o in zip(got, on) for a, b in zip(g["tokens"], o["tokens"]))
            total = sum(len(g["tokens"]) for g in got)
            extra.append(f"| {name} | {cell([x['tokens/s'] for x in got])} | "
                         f"{cell([o['tokens/s'] / g['tokens/s'] for o, g in zip(on, got)])}x | {same} of {total} answers |")
    section = "\n".join([
        start, f"## Speculative decoding by {'a draft graph' if args.draft else 'prompt lookup'}{title} "
        "(benchmarks/bench_speculative.py)", "",
        run_header("benchmarks/bench_speculative.py", load), "",
        f"Gemma 3 270M, the FP32 graph of `{vdir}` (the factory's build of the FP32 folder from the GGUF; float KV "
        f"cache, 512 positions), {where}. {TOKENS} greedy "
        f"tokens a request. Extractive: {STREAMS} prompts of 240-410 tokens, five definitions of the Apache License "
        f"2.0 and a question asking to quote one of them; at 1 stream the first {ONE_STREAM} sent one after another, "
        f"at {STREAMS} streams all {STREAMS} at once. Free text: {FREE} prompts asking for a story, one after another "
        "(the base model's stories repeat their own phrases: prompt lookup drafts those too). Speculation: "
        f"{how}. "
        f"{args.rounds} round(s), the settings in alternating order{', medians and ranges' if args.rounds > 1 else ''}"
        " (the load in the line above).", "",
        "| workload | off tokens/s | on tokens/s | on / off | verifications (round 1) | drafted / accepted "
        "(round 1) | acceptance rate (all rounds) | tokens = off's |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |", *rows, *extra, "",
        f"The first extractive answer (off): `{example[:300]!r}`", "", end])
    publish(section, HERE / "RESULTS.md", start, end, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
