"""Running a text-generation ONNX graph at build time: greedy continuations, logits and perplexity.

The graph has the engine I/O the contract defines (``backend/contract.py``, "shared-slots"): each layer's
past and present keys/values are ONE preallocated buffer ``[1, kv_heads, max_context, head_dim]`` bound to
both (ONNX Runtime I/O binding), and the mask's row sum is the sequence's length. The build uses it to check
the export against ``transformers``, to score reduced precisions and to write the golden continuations; the
backend has its own, batched runtime (gen32), which these checks do not replace.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from model_factory.backend.contract import ATTENTION_MASK, INPUT_IDS, LOGITS, LOGITS_POSITIONS, past_name, present_name

# Top-two FP32 logits closer than this: from that step on, tokens may differ by float rounding alone.
NEAR_TIE = 1e-3


@dataclass(frozen=True)
class GraphShape:
    """What the runner needs to know of the graph: layers and the KV buffer's geometry."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: Any = np.float32


def graph_shape(session: Any, head_dim: int | None = None) -> GraphShape:
    """Layers, kv heads and head dim from a session's ``past_key_values.<i>.key`` inputs.

    The builder leaves the head dim symbolic (``kv_cache_dim``): then ``head_dim`` must be given.
    """
    pasts = [i for i in session.get_inputs() if i.name.startswith("past_key_values.") and i.name.endswith(".key")]
    if not pasts:
        raise ValueError("the graph has no past_key_values inputs: not a text-generation graph")
    shape = pasts[0].shape
    dim = shape[3] if isinstance(shape[3], int) else head_dim
    if dim is None:
        raise ValueError("the graph's head dim is symbolic: give head_dim")
    dtype = {"tensor(float16)": np.float16, "tensor(int8)": np.int8}.get(pasts[0].type, np.float32)
    return GraphShape(len(pasts), int(shape[1]), int(dim), dtype)


def head_dim_of(hf_config: dict) -> int:
    """The attention head size of a Hugging Face decoder config."""
    dim = hf_config.get("head_dim")
    return int(dim) if isinstance(dim, int) and dim > 0 else int(hf_config["hidden_size"]) // int(
        hf_config["num_attention_heads"])


class DecoderRunner:
    """One sequence at a time through a shared-slot decoder graph (CPU, ONNX Runtime)."""

    def __init__(self, onnx_path: Path | bytes, max_context: int, head_dim: int, threads: int | None = None,
                 feeds: dict[str, np.ndarray] | None = None, data_folder: Path | None = None) -> None:
        """``onnx_path``: the graph's file, or its bytes (a graph rewritten in memory: ``lora``); ``feeds``: more
        inputs bound at every step (a LoRA graph's adapter stacks and row); ``data_folder``: where the bytes'
        external weights lie (a packaged graph rewritten without reading its weights in)."""
        from model_factory.build_engines.ort_session import onnxruntime_session

        self.session = onnxruntime_session(onnx_path if isinstance(onnx_path, bytes) else Path(onnx_path),
                                           threads=threads, data_folder=data_folder)
        self.feeds = dict(feeds or {})
        self.shape = graph_shape(self.session, head_dim)
        self.max_context = int(max_context)
        self.selects_positions = any(i.name == LOGITS_POSITIONS for i in self.session.get_inputs())
        kv = (1, self.shape.num_kv_heads, self.max_context, self.shape.head_dim)
        self._cache = {(i, k): np.zeros(kv, self.shape.kv_dtype) for i in range(self.shape.num_layers)
                       for k in ("key", "value")}

    def cached(self, layer: int, kind: str) -> np.ndarray:
        """The KV buffer of ``layer``'s ``kind`` ("key" or "value"): ``[1, kv_heads, max_context, head_dim]``, its
        first rows those of the last sequence run."""
        return self._cache[(layer, kind)]

    def _step(self, ids: Sequence[int], cached: int, last_only: bool = False) -> np.ndarray:
        """Feed ``ids`` after ``cached`` tokens already in the slot; logits [len(ids), vocab] (float32), or
        [1, vocab] for the last position alone (``last_only``: the LM head runs on that position only)."""
        if cached + len(ids) > self.max_context:
            raise ValueError(f"{cached + len(ids)} tokens exceed max_context {self.max_context}")
        positions = np.asarray([[len(ids) - 1]] if last_only else [list(range(len(ids)))], np.int64)
        io = self._bound([list(ids)], cached, positions, self._cache)
        self.session.run_with_iobinding(io)
        # Only the logits are read: copy_outputs_to_cpu() would also copy every KV buffer (the presents).
        logits = np.asarray(io.get_outputs()[0].numpy()[0], np.float32)
        return logits if self.selects_positions else logits[positions[0]]

    def _bound(self, ids: list[list[int]], cached: int, positions: np.ndarray,
               cache: dict[tuple[int, str], np.ndarray]) -> Any:
        """An I/O binding of one launch: ``ids`` [rows, new] after ``cached`` tokens of each row in ``cache``'s
        buffers (past and present the same memory), ``positions`` the logits asked for."""
        io = self.session.io_binding()
        io.bind_cpu_input(INPUT_IDS, np.asarray(ids, np.int64))
        io.bind_cpu_input(ATTENTION_MASK, np.ones((len(ids), cached + len(ids[0])), np.int64))
        if self.selects_positions:
            io.bind_cpu_input(LOGITS_POSITIONS, positions)
        for name, value in self.feeds.items():
            io.bind_cpu_input(name, value)
        io.bind_output(LOGITS, "cpu")  # bound first: get_outputs() returns outputs in binding order
        for (layer, kind), buf in cache.items():
            shape = list(buf.shape)
            io.bind_input(past_name(layer, kind), "cpu", 0, buf.dtype, shape, buf.ctypes.data)
            io.bind_output(present_name(layer, kind), "cpu", 0, buf.dtype, shape, buf.ctypes.data)
        return io

    def decode_launch(self, rows: int, cached: int, repeats: int = 3) -> tuple[float, np.ndarray]:
        """(the best of ``repeats`` timings in seconds, the last logits [rows, vocab]) of one decode launch of ``rows``
        sequences, one new token each after ``cached`` tokens (KV of zeros, its own buffers): the step a server
        runs while ``rows`` streams decode, timed after one untimed launch."""
        import time

        if cached + 1 > self.max_context:
            raise ValueError(f"{cached + 1} tokens exceed max_context {self.max_context}")
        kv = (rows, self.shape.num_kv_heads, self.max_context, self.shape.head_dim)
        cache = {key: np.zeros(kv, self.shape.kv_dtype) for key in self._cache}
        io = self._bound([[1]] * rows, cached, np.zeros((rows, 1), np.int64), cache)
        best = float("inf")
        for i in range(repeats + 1):
            start = time.perf_counter()
            self.session.run_with_iobinding(io)
            if i:
                best = min(best, time.perf_counter() - start)
        return best, np.asarray(io.get_outputs()[0].numpy()[:, -1], np.float32)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """The logits of every position of ``ids`` in one prefill (a fresh sequence)."""
        return self._step(ids, 0)

    def greedy(self, prompt: Sequence[int], new_tokens: int, suppress: Sequence[int] = ()) -> list[int]:
        """``new_tokens`` greedy tokens after ``prompt`` (``suppress``: ids never chosen, e.g. eos, as min_new_tokens)."""
        out: list[int] = []
        logits = self._step(prompt, 0, last_only=True)[-1]
        cached = len(prompt)
        for _ in range(new_tokens):
            if suppress:
                logits = logits.copy()
                logits[list(suppress)] = -np.inf
            token = int(np.argmax(logits))
            out.append(token)
            if len(out) == new_tokens:
                break
            logits = self._step([token], cached, last_only=True)[-1]
            cached += 1
        return out

    def token_nll(self, ids: Sequence[int]) -> tuple[float, int]:
        """Sum of the negative log-likelihood of ``ids[1:]`` given their prefixes, and how many tokens."""
        if len(ids) < 2:
            return 0.0, 0
        logits = self.logits(ids)[:-1].astype(np.float64)
        top = logits.max(axis=-1, keepdims=True)
        logz = np.log(np.exp(logits - top).sum(axis=-1)) + top[:, 0]
        target = logits[np.arange(len(ids) - 1), np.asarray(ids[1:])]
        return float((logz - target).sum()), len(ids) - 1


def first_near_tie(margins: Sequence[float], limit: float = NEAR_TIE) -> int | None:
    """The first step whose top-two FP32 logit margin is below ``limit`` (None: none)."""
    for i, m in enumerate(margins):
        if m < limit:
            return i
    return None


def top_two_margin(logits: np.ndarray) -> float:
    """The gap between the largest and second-largest logit."""
    two = np.partition(np.asarray(logits, np.float64).ravel(), -2)[-2:]
    return float(two[1] - two[0])


def teacher_forced_agreement(runner: DecoderRunner, prompt: Sequence[int], tokens: Sequence[int],
                             upto: int | None) -> tuple[int, int]:
    """How many of the reference ``tokens`` the graph predicts itself when fed the reference prefix.

    One prefill of ``prompt + tokens``; the prediction at each position is compared with the next reference
    token, up to ``upto`` (the first near-tie; None: all). Returns (agreeing, compared).
    """
    n = len(tokens) if upto is None else min(upto, len(tokens))
    if n == 0:
        return 0, 0
    ids = list(prompt) + list(tokens[:n])
    logits = runner.logits(ids[:-1])  # the last reference token is predicted, never fed
    predicted = np.argmax(logits[len(prompt) - 1:len(prompt) - 1 + n], axis=-1)
    return int(np.sum(predicted == np.asarray(tokens[:n]))), n
