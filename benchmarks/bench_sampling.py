"""What sampling costs a decode step over a 262k vocabulary: the backend's sampler against full-vocabulary sampling.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_sampling.py --version VERSION_DIR [--precision int8]
        [--streams 1,8,32] [--tokens 32] [--rounds 2] [--write]

Issue 49 asks for sampling over Gemma 3 270M's 262,144 tokens to be cheap. Every speed figure so far is greedy (an
argmax read in place); a request that samples (any ``temperature`` > 0; Gemma's own generation config samples with
top-k 64 and top-p 0.95) went through full-vocabulary sampling: a float64 copy of the row, ``np.partition`` for
top-k, a stable ``argsort`` of the whole row for top-p, a float64 CDF. This runs both on the backend's scheduler in
this process (the version's graph as the stub loads it: ``CausalLM``, 2 threads), ``S`` 128-token prompts of word
pieces submitted at once, ``--tokens`` tokens each (``min_tokens`` = ``max_tokens``, ``ignore_eos``), every stream
seeded (stream i: seed i), for each setting:

- ``greedy``: ``temperature`` 0 (the same code in both arms: the control);
- ``t1``: ``temperature`` 1 (what a client that sends only a temperature gets);
- ``gemma``: ``temperature`` 1, ``top_k`` 64, ``top_p`` 0.95 (Gemma 3's generation config);
- ``p09``: ``temperature`` 0.7, ``top_p`` 0.9 (a common client setting).

Arms: ``kernel`` the backend's ``Sampler`` as the stub serves it (``sampling.sample_token`` on the compiled draw,
``sampling_kernel``); ``numpy`` the same without the kernel (numpy's draw: float32 probabilities, a two-level inverse
CDF, top-k from the blocks' maxima, top-p by rejection; what the stub keeps where the kernel cannot be compiled);
``full`` the same ``Sampler`` with its draw replaced by :func:`full_vocabulary_draw` (the backend's draw before both,
kept here). Without top-p all three draw by the inverse CDF in token order with one uniform from the same seeded
generator, so their tokens agree until a draw lands within float rounding of a boundary; with top-p the backend's
draws are by rejection (more uniforms where a draw falls outside the nucleus), so the streams part at the first
rejection one of them makes (the distribution is checked in tests/backend/test_sampling_draw.py, on both draws).
Output tokens/s, and the time inside ``Sampler.choose`` per token (timed around each call). Arms alternate within
each round (the order reversed every other round).
The section between ``<!-- sampling:start -->`` and ``<!-- sampling:end -->`` is replaced.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks.results_file import publish, say  # noqa: E402

START, END = "<!-- sampling:start -->", "<!-- sampling:end -->"
SETTINGS = {"greedy": {"temperature": 0.0}, "t1": {"temperature": 1.0},
            "gemma": {"temperature": 1.0, "top_k": 64, "top_p": 0.95}, "p09": {"temperature": 0.7, "top_p": 0.9}}
ARMS = ("kernel", "numpy", "full")


def full_vocabulary_draw(x: np.ndarray, temperature: float, top_k: int, top_p: float, u: float) -> int:
    """The backend's draw before ``sample_token``: the whole row in float64, top-k by ``np.partition``, top-p by a
    stable argsort of the whole row, the CDF over the whole row."""
    x = np.array(x, dtype=np.float32, copy=True).astype(np.float64) / temperature
    if top_k and top_k < x.size:
        kth = np.partition(x, -top_k)[-top_k]
        x[x < kth] = -np.inf
    x -= np.max(x)
    probs = np.exp(x)
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sorted_probs = probs[order]
        cum = np.cumsum(sorted_probs) / sorted_probs.sum()
        keep = int(np.searchsorted(cum, top_p) + 1)
        cut = np.zeros_like(probs)
        cut[order[:keep]] = probs[order[:keep]]
        probs = cut
    cdf = np.cumsum(probs)
    return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), x.size - 1)


def run(lm, spec, tokenizer, prompts: list[list[int]], tokens: int, setting: dict, arm: str) -> dict:
    """The prompts on the scheduler with ``setting``'s sampling, the draw of ``arm``: tokens/s, choose ms / token."""
    from benchmarks.bench_decode_profile import scheduler_for
    from model_factory.backend.generation import sampling, sampling_kernel
    from model_factory.backend.generation.sampling import SamplingParams
    from model_factory.backend.generation.scheduler import Generation

    sched = scheduler_for(lm, spec, tokenizer, len(prompts), len(prompts[0]) + tokens, max_waiting=256)
    out: list[list[int]] = [[] for _ in prompts]
    spent = [0.0]
    choose, draw = sampling.Sampler.choose, sampling.Sampler._sample

    def timed_choose(self, *a, **k):
        t = time.perf_counter()
        try:
            return choose(self, *a, **k)
        finally:
            spent[0] += time.perf_counter() - t

    def full_draw(self, x):
        p = self.params
        return full_vocabulary_draw(x, p.temperature, p.top_k, p.top_p, self.rng.random())

    sampling.Sampler.choose = timed_choose
    if arm == "full":
        sampling.Sampler._sample = full_draw
    if arm == "kernel":
        why = sampling_kernel.load()
        if why:
            raise SystemExit(f"the kernel arm cannot run: {why}")
    else:
        sampling_kernel.unload()
    try:
        def sink(i):
            def emit(_gen, event):
                if event.token is not None:
                    out[i].append(event.token)
            return emit

        wall = time.perf_counter()
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, seed=i, **setting)
            sched.submit(Generation(list(prompt), params, sink(i)))
        while sched.has_work():
            sched.step()
        wall = time.perf_counter() - wall
    finally:
        sampling.Sampler.choose, sampling.Sampler._sample = choose, draw
        sampling_kernel.unload()
    made = sum(len(o) for o in out)
    return {"tps": made / wall, "tokens": made, "choose_ms": 1000 * spent[0] / max(made, 1), "ids": out}


def main() -> int:
    from tokenizers import Tokenizer

    from benchmarks.bench_decode_profile import _engine, _prompts
    from benchmarks.harness.run_header import LoadReading, run_header

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", required=True, help="a built version folder (model.<precision>.onnx, generation.json)")
    ap.add_argument("--precision", default="int8")
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    vdir = Path(args.version)
    levels = [int(s) for s in args.streams.split(",")]
    settings = [s for s in args.settings.split(",") if s]
    load = LoadReading.begin()
    tokenizer = Tokenizer.from_file(str(vdir / "tokenizer" / "tokenizer.json"))
    tokenizer.no_padding()
    spec, lm = _engine(vdir, args.precision)
    bos = spec.bos_token_id if spec.bos_token_id is not None else 2
    results: dict = collections.defaultdict(list)
    problems: list[str] = []
    loads: list[float] = []
    try:
        for arm in ARMS:  # warm-up (the kernel compiled, if this host has not yet)
            run(lm, spec, tokenizer, _prompts(tokenizer, 2, 7, bos), 4, SETTINGS["t1"], arm)
        for r in range(args.rounds):
            for streams in levels:
                prompts = _prompts(tokenizer, streams, 1000 * r + streams, bos)
                for name in settings:
                    arms = list(ARMS) if (r + streams) % 2 == 0 else list(reversed(ARMS))
                    got = {}
                    for arm in arms:
                        got[arm] = run(lm, spec, tokenizer, prompts, args.tokens, SETTINGS[name], arm)
                        loads.append(os.getloadavg()[0])
                        if got[arm]["tokens"] != streams * args.tokens:
                            problems.append(f"round {r + 1} S={streams} {name} {arm}: {got[arm]['tokens']} tokens")
                        say(f"round {r + 1} S={streams} {name} {arm}: {got[arm]['tps']:.1f} tok/s, "
                            f"choose {got[arm]['choose_ms']:.3f} ms/token, load {loads[-1]:.1f}")
                    for arm in ARMS:
                        results[(streams, name, arm)].append(got[arm])
                    for other in ("numpy", "full"):
                        same = sum(a == b for a, b in zip(got["kernel"]["ids"], got[other]["ids"])) / streams
                        results[(streams, name, "same", other)].append({"same": same})
    finally:
        lm.close()
    lines = section(results, levels, settings, args, load, loads, problems, run_header)
    publish("\n".join(lines), HERE / "RESULTS.md", START, END, args.write)
    return 1 if problems else 0


def section(results, levels, settings, args, load, loads, problems, run_header) -> list[str]:
    def cell(values: list[float], fmt: str) -> str:
        mid = fmt.format(statistics.median(values))
        return mid if len(values) == 1 else f"{mid} ({fmt.format(min(values))}-{fmt.format(max(values))})"

    lines = [START, "## What sampling costs over a 262k vocabulary (`sampling`)", "",
             run_header("benchmarks/bench_sampling.py", load.finish()), "",
             f"`{args.version}` at `{args.precision}` on the backend's scheduler in-process (`CausalLM`, 2 threads; no "
             f"Triton, no HTTP); 128-token prompts (`<bos>` and 127 word pieces), {args.tokens} output tokens a stream "
             "(min_tokens = max_tokens, ignore_eos), all streams at once, stream i seeded i; medians (ranges) over "
             f"{args.rounds} rounds, the arms alternating; load average during the runs {min(loads):.1f}-"
             f"{max(loads):.1f}. Settings: " + "; ".join(f"`{k}` " + ", ".join(f"{a} {b}" for a, b in v.items())
                                                        for k, v in SETTINGS.items() if k in settings) + ". "
             "Arms: `kernel` the backend's draw as the stub serves it (`sampling.sample_token` on the compiled "
             "`kernels/sampling.cc`: a pass for the 256-token blocks' maxima, a pass for their sums of the weights in "
             "play, top-p's check over the blocks that reach the drawn logit); `numpy` the same draw in numpy (float32 "
             "probabilities, a two-level inverse CDF, top-k from the blocks' maxima, top-p by rejection; kept where "
             "the kernel cannot be compiled); `full` full-vocabulary sampling (the draw before both: float64 row, "
             "`np.partition`, a stable argsort of the whole row for top-p). `choose` is the time in `Sampler.choose` "
             "per output token.", "",
             "| streams | setting | kernel tokens/s | numpy tokens/s | full tokens/s | kernel / numpy | "
             "kernel / full | choose ms / token: kernel | numpy | full | same tokens as numpy | as full |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for streams in levels:
        for name in settings:
            arms = {arm: results[(streams, name, arm)] for arm in ARMS}
            ratio = {other: [a["tps"] / b["tps"] for a, b in zip(arms["kernel"], arms[other])]
                     for other in ("numpy", "full")}
            lines.append(
                f"| {streams} | {name} | " + " | ".join(cell([x["tps"] for x in arms[a]], "{:.1f}") for a in ARMS)
                + f" | **{cell(ratio['numpy'], '{:.2f}x')}** | {cell(ratio['full'], '{:.2f}x')} | "
                + " | ".join(cell([x["choose_ms"] for x in arms[a]], "{:.3f}") for a in ARMS) + " | "
                + " | ".join(cell([x["same"] for x in results[(streams, name, "same", o)]], "{:.0%}")
                             for o in ("numpy", "full")) + " |")
    lines += ["", "The last two columns: the share of streams whose tokens are the same as the kernel's in the other "
              "arm. Without top-p every arm draws by the inverse CDF with one uniform from the same seeded generator "
              "(the kernel's float32 sums and exponential, numpy's, and float64 move a boundary by rounding, and a "
              "stream differs from the first draw that lands there); with top-p the backend's rejection takes another "
              "uniform after a draw outside the nucleus (the kernel orders ties by the logits, numpy by the rounded "
              "probabilities), so a stream parts there (the distribution itself is tested in "
              "tests/backend/test_sampling_draw.py, on both draws). The `int8` "
              "precision (INT8 dynamic) quantizes each launch's activations with one scale, so once two streams "
              "differ their batch-mates' logits may too.",
              "Every stream made its tokens." if not problems else "Problems: " + "; ".join(problems), END]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
