"""The grammar engines side by side (how structured outputs' engine was chosen: docs/generation.md): the time to
build an engine's view of a vocabulary, to compile a JSON schema, and to compute one token's mask, llguidance
against xgrammar, over a 16,384-token and a 262,144-token (Gemma 3's size) vocabulary.

    .venv/bin/python benchmarks/bench_grammar_engines.py llguidance|xgrammar

No hub here, so the vocabularies are made: the 256 bytes, the words and punctuation of the machine's license texts
(with and without a leading space), JSON's punctuation pairs, then pieces of those words until the size is reached.
The document (``DOC``, valid against ``SCHEMA``) is tokenized greedily; each of its tokens is checked allowed by the
mask before the matcher takes it. Prints one line per vocabulary (not written to RESULTS.md: xgrammar is not among
the project's dependencies; install it by hand, ``pip install --no-deps xgrammar apache-tvm-ffi`` beside torch).
"""
import json, random, re, sys, time, statistics
from pathlib import Path
import numpy as np

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "kind": {"enum": ["person", "company", "other"]}, "score": {"type": "number"}},
    "required": ["name", "age", "email", "tags", "address", "kind", "score"], "additionalProperties": False}
DOC = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engine"],
       "address": {"city": "London", "zip": "12345"}, "kind": "person", "score": 9.5}


def vocab(size):
    words = set()
    for p in sorted(Path("/usr/share/common-licenses").glob("*")):
        if p.is_file():
            for w in re.findall(r"\w+|[^\w\s]+", p.read_text(errors="ignore")):
                words.add(w)
    words = sorted(words)
    rng = random.Random(0)
    toks = [bytes([b]) for b in range(256)]
    seen = set(toks)
    for w in words:
        for t in (w.encode(), b" " + w.encode()):
            if t not in seen:
                seen.add(t); toks.append(t)
    punct = [b'{"', b'":', b'",', b'"}', b', "', b'": "', b'["', b'"]', b'},', b'{\n', b'\n}', b'  ', b'    ']
    for t in punct:
        if t not in seen:
            seen.add(t); toks.append(t)
    while len(toks) < size - 1:
        w = words[rng.randrange(len(words))].encode()
        i = rng.randrange(len(w)); j = rng.randrange(i + 1, len(w) + 1)
        t = (b" " if rng.random() < 0.5 else b"") + w[i:j] + (words[rng.randrange(len(words))][:3].encode() if rng.random() < 0.5 else b"")
        if t not in seen:
            seen.add(t); toks.append(t)
    toks = toks[: size - 1] + [b"<eos>"]
    return toks


def greedy_encode(toks):
    index = {t: i for i, t in enumerate(toks[:-1])}
    longest = max(len(t) for t in toks)

    def enc(s):
        b = s if isinstance(s, bytes) else s.encode()
        out, i = [], 0
        while i < len(b):
            for L in range(min(longest, len(b) - i), 0, -1):
                t = index.get(b[i:i + L])
                if t is not None:
                    out.append(t); i += L; break
        return out
    return enc


def run_llg(toks, text_ids):
    import llguidance, llguidance.numpy as lnp

    enc = greedy_encode(toks)
    class Wrap:
        eos_token_id = len(toks) - 1; bos_token_id = None; tokens = toks; special_token_ids = [len(toks) - 1]
        def __call__(self, s): return enc(s)
    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrap()))
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    m = llguidance.LLMatcher(tok, grammar)
    t_compile = time.perf_counter() - t0
    assert not m.is_error(), m.get_error()
    mask = lnp.allocate_token_bitmask(1, len(toks))
    times = []
    for t in text_ids:
        s = time.perf_counter(); lnp.fill_next_token_bitmask(m, mask, 0); times.append(time.perf_counter() - s)
        assert (mask[0, t // 32] >> (t % 32)) & 1, ("rejected", t)
        assert m.consume_token(t), m.get_error()
    return t_tok, t_compile, times


def run_xgr(toks, text_ids):
    import xgrammar as xgr, torch
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(toks, vocab_type=xgr.VocabType.RAW, vocab_size=len(toks), stop_token_ids=[len(toks) - 1])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    cg = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    t_compile = time.perf_counter() - t0
    m = xgr.GrammarMatcher(cg)
    mask = xgr.allocate_token_bitmask(1, len(toks))
    times = []
    for t in text_ids:
        s = time.perf_counter(); m.fill_next_token_bitmask(mask, 0); times.append(time.perf_counter() - s)
        assert (int(mask[0, t // 32]) >> (t % 32)) & 1, ("rejected", t)
        assert m.accept_token(t)
    return t_tok, t_compile, times


if __name__ == "__main__":
    which = sys.argv[1]
    for size in (16384, 262144):
        toks = vocab(size)
        ids = greedy_encode(toks)(json.dumps(DOC, separators=(",", ":")))
        fn = run_llg if which == "llguidance" else run_xgr
        t_tok, t_c, times = fn(toks, ids)
        ms = [t * 1e3 for t in times]
        print(f"{which} vocab={size}: tokenizer {t_tok*1e3:.0f} ms, schema compile {t_c*1e3:.1f} ms, mask per token "
              f"p50 {statistics.median(ms):.3f} ms mean {statistics.mean(ms):.3f} max {max(ms):.2f} ms over {len(ms)} tokens", flush=True)
