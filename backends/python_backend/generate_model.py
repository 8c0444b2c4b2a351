"""The decoupled Triton model of a text-generation version (``task = "text-generation"``).

Threads with one job each, as Triton's vLLM backend: ``execute()`` only reads and checks each request
(``generate_requests``) and hands it to the scheduler, answering a bad one at once with INVALID_ARG and a
refused one (waiting queue full) with UNAVAILABLE ("server busy ... retry after N s"); the engine loop runs
``scheduler.Scheduler.step`` while there is work; a response thread makes each response from what the steps
produced and sends it through its request's response sender, so neither stalls the engine; a watcher asks
Triton whether each request was cancelled (``cancel_watch``: a round trip per request, kept off the engine loop
too). A streamed request gets a response per token (text delta, its id), the last one flagged final and
carrying the finish reason; a request with ``stream`` false gets exactly one response (Triton's ``generate``
endpoint accepts nothing else). A client that goes away (``is_cancelled()``) frees its slot at the step after
the watcher saw it (within 50 ms).

A request with ``n`` choices (``sampling_parameters``) runs as ``n`` sequences (``scheduler.Generation.index``,
choice 0 the leader whose prefill the others share; choice ``i``'s seed ``sampling.choice_seed``): streamed, each
response is one choice's delta with its ``index``, the last one to finish flagged final; not streamed, one
response holds every choice (``text_output``, ``finish_reason``, ``num_output_tokens``, ``index`` one entry a
choice; ``output_ids`` the choices' ids one after the other). With ``logprobs`` asked, ``logprobs`` holds a JSON
list a choice entry: per token its id, text, bytes, log-probability and the top alternatives (each token's text
made here, on the response thread: ``detokenize.TokenTexts``).

Load: ``generation.json`` (``contract.GenerationSpec``), the served precision's ONNX file and its tokenizer,
each read through the integrity check; the KV slots sized from ``memory_budget_mib`` less the weights; the
prefill cost model measured by a short warm-up (or the configured ``cost_model`` constants).

A GPU instance (``KIND_GPU``) runs the graph on ONNX Runtime's CUDA provider on a stream of its own, with the KV
buffers allocated once from the instance's ``cudaMallocAsync`` pool (``kv_device``): as many slots as
``cudaMemGetInfo``'s free memory after the session loaded, less ``device_reserve_mib``, holds at full context
(capped by ``memory_budget_mib`` less the weights when that is set), admission by the same account as on the CPU.
When it cannot (no CUDA provider, no GPU, a precision whose attention has no CUDA kernel) the load fails naming
the fix, unless the recipe allows the CPU (``allow_cpu_fallback``): then it serves on the CPU and says why.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .generation.cancel_watch import CancelWatch
from .generation.causal_lm import CausalLM, CudaPlacement, attention_kernel
from .generation.chunked_prefill import chunk_tokens, whole_below
from .generation.itl_budget import itl_budget
from .contract import INT8_KV_ONNXRUNTIME, Files, GenerationSpec, runs_int8_kv
from .batching.deferred_responses import ResponseDispatcher
from .generation.requests import GenerateRequest, read_generate_request, request_inputs
from .batching.grouping import CostModel
from .generation.prefill_cost import cached_cost, cost_cache_file, measure_cost, save_cost
from .integrity import read_checked, verified_digests
from .lora_contract import ADAPTER_WEIGHTS
from .generation.kv_blocks import block_tokens
from .generation.kv_slots import KVSlots
from .generation.kv_pool import kv_storage, layout_block_tokens, layout_note
from .generation.lora import AdapterError, AdapterTable, discover, prepare_or_refuse
from .engines.loading import available_cpus, load_verified_onnx
from .generation.detokenize import TokenTexts
from .generation.draft_model import load_draft
from .generation.sampling import SamplingError, choice_seed
from .generation.sampling_kernel import LIBRARY_NAME as SAMPLING_LIBRARY, load as load_sampling_kernel
from .generation.scheduler import Generation, QueueFull, Scheduler, TokenEvent
from .generation.structured.engines import load_engine
from .generation.structured.grammar import LazyGrammars
from .settings import Settings, SettingsError, cpu_spinning, cpu_threads_per_instance

_MIB = 1 << 20


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo"),
                           cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Memory this process may still take: MemAvailable, capped by a cgroup v2 limit less its usage."""
    free = 0
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text().strip())
            free = min(free or 1 << 62, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return free


def kv_budget_bytes(settings: Settings, spec: GenerationSpec, available: int) -> int:
    """The KV cache's share: the configured memory budget (or half of ``available``) less the weights, and less a
    draft graph's weights and its slots at their whole context (``speculative = "draft"``: draft_model)."""
    budget = settings.memory_budget_mib * _MIB if settings.memory_budget_mib else available // 2
    weights = int(spec.weights_bytes.get(settings.precision, 0))
    if settings.speculative == "draft":
        draft = spec.for_precision(settings.speculative_draft)
        weights += int(spec.weights_bytes.get(settings.speculative_draft, 0)) + (
            settings.speculative_max_sequences * spec.max_context * draft.kv_bytes_per_token)
    kv = budget - weights
    if kv <= 0:
        raise SettingsError(f"parameter memory_budget_mib={budget // _MIB} leaves no room for the KV cache beside "
                            f"{weights // _MIB} MiB of weights" + (" (the draft's and its slots' included)"
                                                                   if settings.speculative == "draft" else "")
                            + ": raise it")
    return kv


class GenerativeModel:
    """One instance of a text-generation model inside Triton (``pb_utils`` passed in)."""

    def __init__(self, pb_utils: Any, args: dict, settings: Settings, quiet: bool = False) -> None:
        self.pb = pb_utils
        self.settings = s = settings
        version_dir = Path(args["model_repository"]) / str(args["model_version"])
        self._gpu = (int(args.get("model_instance_device_id", 0) or 0)
                     if args.get("model_instance_kind", "CPU") == "GPU" else None)
        self._device: GpuGeneration | None = None
        self.placement_note = ""
        self.sampling_note = ""  # which draw samples (_load): the compiled kernel, or numpy's and why
        cpus = available_cpus()
        threads = cpu_threads_per_instance(s, cpus)
        started = time.monotonic()
        # A rollout's switch loads this version beside the one serving: the load (hashing, the session, the prefill
        # cost's warm-up) then runs at the lowest CPU priority in a thread of its own; this thread, and every thread
        # that serves later (the session's pool, the engine loop, the watcher, the response thread), keeps the
        # normal priority (quiet_start.py).
        if quiet:
            from .engines.quiet_start import run_quietly

            loaded, lowered = run_quietly(lambda: self._load(version_dir, cpus, threads))
            start_note = f", load quiet ({'nice 19' if lowered else 'priority unchanged'})"
        else:
            loaded, start_note = self._load(version_dir, cpus, threads), ""
        self.spec, self.model, self.tokenizer, self.slots, cost, cost_note = loaded
        spec = self.spec
        start_note += f", loaded in {time.monotonic() - started:.1f} s"
        # Loaded: wall the stub in before any thread starts (Landlock and seccomp bind the calling thread and the
        # threads it starts later), as the encoder path does (sandbox.py): reads only its model folder, the Python
        # environment and system libraries; writes only scratch; no new process, no network socket.
        from .integrity import ENV as DIGESTS_ENV
        from .operations.sandbox import wall_in_stub

        # Structured outputs: the grammar engine for this tokenizer, made at the first request that asks for one
        # (structured/grammar.py); its package imported now, before the walls, where it is installed.
        self.grammars = LazyGrammars(self._grammar_engine)
        _preload_grammar_engine()

        from .operations.events import input_hash
        from .operations.shadow import ShadowMirror, shadow_folder

        # A rollout's shadow (shadow.py): finished requests whose tokens are reproducible generated again by the
        # candidate, the continuations compared token by token.
        shadow_dir = shadow_folder()
        self.shadow = ShadowMirror(pb_utils, shadow_dir, s.model_name, str(args.get("model_instance_name", "")),
                                   hash_inputs=input_hash, log=pb_utils.Logger.log_warn, generation=True)
        digests_file = os.environ.get(DIGESTS_ENV)
        adapter_files = tuple(str(f.folder / ADAPTER_WEIGHTS) for f in self.adapters.found.values())
        self.sandbox = wall_in_stub(version_dir, writable=(str(shadow_dir),) if shadow_dir else (),
                                    readable_files=((digests_file,) if digests_file else ()) + adapter_files)
        self.metrics = _make_metrics(pb_utils, s.model_name, {"instance": str(args.get("model_instance_name", ""))})
        # A cached prefix's keys and values are the base's: with adapters served, prefix caching is off.
        self.prefix_cache = None if self.adapters.found else _prefix_cache(s, spec, version_dir, self.model)
        chunk = chunk_tokens(s.prefill_chunk_tokens, cost, s.max_prefill_tokens)
        self.scheduler = Scheduler(self.model, self.slots, self.tokenizer, spec.eos_token_ids,
                                   max_waiting=s.max_waiting_sequences, cost=cost,
                                   max_prefill_tokens=s.max_prefill_tokens,
                                   preemption_wait_s=s.preemption_wait_ms / 1000.0,
                                   max_tokens_grouping_s=s.max_tokens_grouping_ms / 1000.0, metrics=self.metrics,
                                   log_error=pb_utils.Logger.log_error,
                                   cancel_check_s=0.0,  # reads the watcher's flags: no round trip
                                   prefix_cache=self.prefix_cache, chunk_tokens=chunk,
                                   whole_below=whole_below(s.prefill_chunk_tokens, chunk),
                                   itl_budget=itl_budget(s.prefill_chunk_tokens, s.max_itl_ratio, chunk, cost,
                                                         s.max_prefill_tokens))
        self.scheduler.loras = self.adapters if self.adapters.found else None
        self.scheduler.speculator = _speculator(s, self.metrics, self.draft)
        if self.draft is not None:  # its catch-up chunked as the served prompts are
            self.draft.chunk_tokens, self.draft.whole_below = chunk, self.scheduler.whole_below
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self._final = final
        # Off the engine loop: the cancellation questions (cancel_watch) and the building and sending of each
        # token's response (the loop hands over a _Delta; the response thread makes the tensors).
        self.cancels = CancelWatch(log_error=pb_utils.Logger.log_error)
        self.responses = ResponseDispatcher(self._send, pb_utils.Logger.log_error)
        self._token_texts = TokenTexts(self.tokenizer)  # the response thread's, for log-probabilities
        self._stop = threading.Event()
        self._loop = threading.Thread(target=self._engine_loop, name="mf-engine-loop", daemon=True)
        self._loop.start()
        usage = self.slots.usage()
        pb_utils.Logger.log_info(
            f"model-factory backend: {s.model_name} generates with {s.precision} on onnxruntime "
            f"({s.onnx_file}) on {self.model.device}"
            + (f", {threads} threads" if self.model.device == "cpu" else ", KV cache in the instance's pool")
            + f", {self.slots.slots} KV slots of {self.slots.max_context} "
            f"tokens, KV budget {usage.budget_bytes // _MIB} MiB, waiting bound {s.max_waiting_sequences}, "
            f"prefill cost a={cost.a:.2e} b={cost.b:.2e} c={cost.c:.2e} ({cost_note}), sandbox {self.sandbox}{start_note}"
            f"{self.placement_note}, prefix caching {'on' if self.prefix_cache is not None else 'off'}"
            f", chunked prefill {f'{chunk} tokens a step' if chunk else 'off'}"
            + (f", KV admission paged (blocks of {self.slots.block_tokens} tokens)" if self.slots.block_tokens
               else ", KV admission reserves prompt + max_tokens"
               + (" (a GPU instance's slots are committed whole)" if self.model.device != "cpu" else ""))
            + (f" (auto: prompts over {whole_below(s.prefill_chunk_tokens, chunk)} tokens"
               + (f", each step within {s.max_itl_ratio:g}x a decode-only one while sequences decode"
                  if self.scheduler.itl is not None else "") + ")"
               if chunk and s.prefill_chunk_tokens == "auto" else "")
            + (", speculative decoding " + (f"by prompt lookup (up to {s.num_speculative_tokens} tokens, a match's "
                                             f"length plus one, from matches of {s.prompt_lookup_min}-"
                                             f"{s.prompt_lookup_max} tokens" if self.draft is None else
                                             f"by the {s.speculative_draft} graph ({s.num_speculative_tokens} tokens, "
                                             f"{s.speculative_max_sequences} draft slot(s) of {self.draft.max_context} tokens")
               + f", while at most {s.speculative_max_sequences} sequences decode"
               + ("; not exact on this batch-dependent precision" if s.precision in spec.batch_dependent else "")
               + ")" if self.scheduler.speculator is not None else "")
            + (f"; attention: {self.model.attention}" if spec.kv_dtype == "int8" and self.model.device == "cpu" else "")
            + (f"; INT8 MatMuls: {self.model.matmul}" if getattr(self.model, "matmul", "") else "")
            + layout_note(s.kv_layout, self.model)
            + self.sampling_note
            + (f"; {s.precision}'s outputs depend on the batch (its activations share one scale per step: "
               "dynamic INT8)" if s.precision in spec.batch_dependent else ""))

    # ------------------------------------------------------------------ load

    def _load(self, version_dir: Path, cpus: int, threads: int) -> tuple:
        """``(spec, model, tokenizer, slots, cost model, where the cost came from)``: everything read, checked and
        measured before serving; it starts no thread that serves later (the session's pool is made at the normal
        priority even inside a quiet start)."""
        s = self.settings
        digests = verified_digests(version_dir.parent.name, version_dir.name)
        relpath = f"{version_dir.name}/{Files.GENERATION}"
        if not (version_dir.parent / relpath).is_file():
            raise SettingsError(f"{relpath} is missing: a text-generation model needs it (rebuild the model)")
        spec = GenerationSpec.from_json(read_checked(version_dir.parent, relpath, digests).decode()).for_precision(
            s.precision)
        if spec.kv_dtype == "int8":
            _require_int8_kv_runtime(s.precision)
        found, refused, modules = discover(version_dir, digests, on_cpu=self._gpu is None)  # adapters of this base
        loaded = self._load_on_gpu(version_dir, digests, spec) if self._gpu is not None else None
        if loaded is not None:
            model, slots = loaded
        else:
            model = load_verified_onnx(
                version_dir, s.onnx_file, digests,
                lambda src: CausalLM(src, threads=threads, spinning=cpu_spinning(s, cpus, threads),
                                     pad_token_id=spec.pad_token_id or 0,
                                     int8_attention=attention_kernel(s.int8_attention, spec.kv_dtype),
                                     lora=prepare_or_refuse(src, found, refused, modules, s.precision),
                                     kv_block_tokens=layout_block_tokens(s.kv_layout),
                                     int8_matmul=s.int8_matmul))
            slots = KVSlots(spec, s.max_active_sequences, kv_budget_bytes(s, spec, available_memory_bytes()),
                            storage=kv_storage(model, spec, s.max_active_sequences),
                            block_tokens=block_tokens(s.kv_admission))
        self.draft = load_draft(version_dir, digests, s, relpath, threads, slots.max_context, self._gpu)
        self.adapters = AdapterTable(found if modules else [], refused, getattr(model, "lora_shapes", {}), s.max_loras,
                                     self.pb.Logger.log_info, ranks=getattr(model, "lora_ranks", None) or None)
        model.lora_table = self.adapters if modules else None
        tokenizer = _load_tokenizer(version_dir, digests)
        why = load_sampling_kernel()  # compiled on this host (first load), else numpy's draw and why
        self.sampling_note = f"; sampling: {why or f'the factory kernel ({SAMPLING_LIBRARY})'}"
        if s.cost_model:
            return spec, model, tokenizer, slots, CostModel(*s.cost_model), "configured"
        cache_file = cost_cache_file(version_dir, s, digests, model.device,
                                     model.attention + getattr(model, "matmul", ""))
        cached = cached_cost(cache_file)
        if cached is not None:
            return spec, model, tokenizer, slots, cached, f"measured at an earlier load, {cache_file.name}"
        cost = measure_cost(model, slots, s.max_prefill_tokens)
        if cache_file is not None:
            save_cost(cache_file, cost, s.model_name)
        return spec, model, tokenizer, slots, cost, "measured"

    def _load_on_gpu(self, version_dir: Path, digests: Any, spec: GenerationSpec) -> tuple | None:
        """``(model, slots)`` on the instance's GPU, or None to serve on the CPU where the recipe allows it (the
        reason kept in ``placement_note``); SettingsError naming the fix otherwise."""
        s, device_id = self.settings, int(self._gpu)
        try:
            self._device = load_on_gpu(version_dir, s, digests, spec, device_id)
        except GpuUnavailable as exc:
            if not s.cpu_fallback:
                raise SettingsError(f"GPU instance of {s.model_name}: {exc}") from exc
            self.placement_note = f"; on the CPU instead of cuda:{device_id}, allowed by the recipe ({exc.why})"
            return None
        return self._device.model, self._device.slots

    # ------------------------------------------------------------------ Triton

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                req = read_generate_request(lambda n: _input(self.pb, request, n), self.tokenizer, self.spec,
                                            self.slots.max_context)
                # A grammar compiled here, off the engine loop (once per schema: the cache), or refused naming it.
                grammar = self.grammars.get().compile(req.params.guided) if req.params.guided is not None else None
                slot = self.adapters.acquire(req.adapter) if req.adapter else 0  # its adapter loaded (verified)
            except (SamplingError, AdapterError) as exc:
                busy, e = getattr(exc, "busy", False), self.pb.TritonError
                self._send_error(sender, str(exc), getattr(e, "UNAVAILABLE", e.INTERNAL) if busy else e.INVALID_ARG)
                continue
            cancelled = self.cancels.watch(request.is_cancelled)
            done = (lambda: (cancelled.close(), self.adapters.release(slot))) if slot else cancelled.close
            try:
                self.scheduler.submit_all(self._choices(req, sender, done, cancelled, grammar, slot))
            except SamplingError as exc:
                done()
                self._send_error(sender, str(exc), self.pb.TritonError.INVALID_ARG)
            except QueueFull as exc:
                done()
                code = getattr(self.pb.TritonError, "UNAVAILABLE", self.pb.TritonError.INTERNAL)
                self._send_error(sender, str(exc), code)
            except BaseException:  # Triton answers (and frees) the request: it must not be asked after that
                done()
                raise
        return None

    def _send_error(self, sender: Any, message: str, code: Any) -> None:
        response = self.pb.InferenceResponse(error=self.pb.TritonError(message, code))
        self.responses.dispatch([sender], [(response, self._final)])

    def _grammar_engine(self) -> Any:
        if self.tokenizer is None:
            raise SamplingError("guided: structured outputs need the model's tokenizer, and this model has none")
        return load_engine(self.tokenizer.to_str(), self.spec.vocab_size, self.spec.eos_token_ids)

    def _choices(self, req: GenerateRequest, sender: Any, done: Any, cancelled: Any, grammar: Any = None,
                 slot: int = 0) -> list[Generation]:
        """The request's sequences: one, or its ``n`` choices (choice 0 the leader; each its own seed and, with a
        grammar, its own matcher); ``slot``: its adapter's, held until ``done`` is called once it is answered."""
        closed = threading.Event()  # set once the request is answered: its other choices stop at the next step
        emit = self._emitter(sender, req, lambda: (closed.set(), done()))
        lora = {"adapter": slot, "adapter_name": req.adapter or ""}
        if req.params.n == 1:
            return [Generation(list(req.prompt_ids), req.params, self._mirrored(emit, req), is_cancelled=cancelled,
                               grammar=grammar, **lora)]
        gens: list[Generation] = []
        for index in range(req.params.n):
            params = dataclasses.replace(req.params, seed=choice_seed(req.params.seed, index))
            gens.append(Generation(list(req.prompt_ids), params, emit, index=index, leader=gens[0] if gens else None,
                                   is_cancelled=lambda: closed.is_set() or cancelled(), grammar=grammar, **lora))
        return gens

    def _mirrored(self, emit, req: GenerateRequest):
        """``emit``, and while a rollout mirrors this model, its continuation offered to the shadow once it ended
        (only when its tokens are reproducible: greedy, or sampled with a seed; not one cancelled or failed, nor one
        of a LoRA adapter, which the candidate does not load; the mirror drops it if that rollout has stopped)."""
        control = self.shadow.active()
        if control is None or req.params.n > 1 or req.adapter or not (req.params.greedy or req.params.seed is not None):
            return emit

        def emit_and_offer(gen: Generation, event: TokenEvent) -> None:
            emit(gen, event)
            if event.finish_reason is not None and event.finish_reason != "cancelled" and event.error is None:
                self.shadow.offer(control, request_inputs(req),
                                  {"output_ids": np.asarray(gen.generated, dtype=np.int32)})

        return emit_and_offer

    def _emitter(self, sender: Any, req: GenerateRequest, answered: Callable[[], None] = lambda: None):
        """What a step's event for one of this request's sequences sends: a delta per token when streaming (its
        choice's index with it when ``n`` > 1), else one response once every choice ended; ``answered`` is
        called with the final one."""
        n, n_in = req.params.n, len(req.prompt_ids)
        with_lp = req.params.logprobs is not None
        prefix = ""
        if not req.stream and not req.exclude_input:
            prefix = req.prompt_text if req.prompt_text is not None else (
                self.tokenizer.decode(list(req.prompt_ids), skip_special_tokens=False) if self.tokenizer else "")
        pieces: list[list[str]] = [[] for _ in range(n)]
        ids: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[Any]] = [[] for _ in range(n)]
        reasons = [""] * n
        state = {"done": 0, "closed": False}

        def emit(gen: Generation, event: TokenEvent) -> None:
            if state["closed"]:
                return
            i = gen.index
            if event.error is not None:
                state["closed"] = True
                answered()
                response = self.pb.InferenceResponse(error=self.pb.TritonError(event.error))
                self.responses.dispatch([sender], [(response, self._final)])
                return
            if event.finish_reason is not None:
                state["done"] += 1
                reasons[i] = event.finish_reason
            last = state["done"] == n
            if last:
                state["closed"] = True
                answered()
            if req.stream:
                if event.finish_reason == "cancelled":  # nobody listens: close the stream without a payload
                    if last:
                        self.responses.dispatch([sender], [(None, self._final)])
                    return
                choice = _Choice(i, event.text, () if event.token is None else (event.token,),
                                 event.finish_reason or "", len(gen.generated),
                                 (event.logprobs,) if with_lp and event.logprobs is not None else ())
                self.responses.dispatch([sender], [(_Delta((choice,), n_in, n > 1, with_lp),
                                                    self._final if last else 0)])
                return
            if event.token is not None:
                ids[i].append(event.token)
                if with_lp and event.logprobs is not None:
                    lps[i].append(event.logprobs)
            pieces[i].append(event.text)
            if not last:
                return
            if "cancelled" in reasons:
                self.responses.dispatch([sender], [(None, self._final)])
                return
            choices = tuple(_Choice(k, prefix + "".join(pieces[k]), tuple(ids[k]), reasons[k], len(ids[k]),
                                    tuple(lps[k])) for k in range(n))
            self.responses.dispatch([sender], [(_Delta(choices, n_in, n > 1, with_lp), self._final)])

        return emit

    def _send(self, sender: Any, item: tuple) -> None:
        """The response thread's send: a _Delta becomes its response here, off the engine loop."""
        payload, flags = item
        if isinstance(payload, _Delta):
            cs = payload.choices
            tensors = [
                self.pb.Tensor("text_output", np.array([c.text.encode("utf-8") for c in cs], dtype=np.object_)),
                self.pb.Tensor("output_ids", np.asarray([t for c in cs for t in c.ids], dtype=np.int32)),
                self.pb.Tensor("finish_reason", np.array([c.finish_reason.encode() for c in cs], dtype=np.object_)),
                self.pb.Tensor("num_input_tokens", np.array([payload.input_tokens], dtype=np.int32)),
                self.pb.Tensor("num_output_tokens", np.array([c.output_tokens for c in cs], dtype=np.int32)),
            ]
            if payload.indexed:
                tensors.append(self.pb.Tensor("index", np.array([c.index for c in cs], dtype=np.int32)))
            if payload.logprobs:
                tensors.append(self.pb.Tensor("logprobs", np.array(
                    [json.dumps(self._logprob_entries(c)).encode("utf-8") for c in cs], dtype=np.object_)))
            payload = self.pb.InferenceResponse(output_tensors=tensors)
        sender.send(payload, flags=flags)

    def _logprob_entries(self, choice: "_Choice") -> list[dict]:
        """One choice's tokens with their log-probabilities, as the ``logprobs`` output's JSON holds them."""
        texts = self._token_texts
        out = []
        for token, lp in zip(choice.ids, choice.logprobs):
            text, raw = texts(token)
            top = []
            for alt, alt_lp in zip(lp.top_ids, lp.top_logprobs):
                alt_text, alt_raw = texts(alt)
                top.append({"id": alt, "token": alt_text, "bytes": alt_raw, "logprob": alt_lp})
            out.append({"id": token, "token": text, "bytes": raw, "logprob": lp.logprob, "top": top})
        return out

    def _engine_loop(self) -> None:
        while not self._stop.is_set():
            if not self.scheduler.has_work():
                self.scheduler.wake.wait(0.05)
                self.scheduler.wake.clear()
                continue
            try:
                self.scheduler.step()
            except Exception as exc:  # noqa: BLE001 - logged; the loop keeps serving
                self.pb.Logger.log_error(f"model-factory backend: {self.settings.model_name}: step failed: {exc}")
                time.sleep(0.01)

    def finalize(self) -> None:
        self._stop.set()
        self.scheduler.wake.set()
        self._loop.join(timeout=30)
        self.cancels.close()
        self.responses.close()
        self.shadow.close()
        if self.metrics is not None:
            self.metrics.close()
        self.model.close()
        if self.draft is not None:
            self.draft.close()
        if self._device is not None:
            self._device.close()  # the model again (idempotent), the KV buffers, the pool and the stream


def _preload_grammar_engine() -> None:
    try:
        import llguidance  # noqa: F401 - imported before the stub's walls; absent: guided requests say what to install
    except ImportError:
        pass


def _require_int8_kv_runtime(precision: str) -> None:
    import onnxruntime

    if not runs_int8_kv(onnxruntime.__version__):
        want = ".".join(map(str, INT8_KV_ONNXRUNTIME))
        raise SettingsError(f"{precision}'s graph keeps its KV cache in INT8, which needs onnxruntime >= {want}; this "
                            f"server has {onnxruntime.__version__}: install 'onnxruntime>={want}' here, or serve a "
                            "build with quantization.kv_cache = \"float\"")


def _prefix_cache(s: Settings, spec: GenerationSpec, version_dir: Path, model: Any) -> Any:
    """The instance's prefix cache (``prefix_caching``: ``auto`` where reuse is exact), its hashes seeded with what
    changes the keys and values: the graph's digest, the version, precision, KV element type and attention kernel."""
    from .generation.prefix_cache import PrefixCache, enabled, identity

    if not enabled(s.prefix_caching, s.precision, spec.batch_dependent):
        return None
    digests = verified_digests(version_dir.parent.name, version_dir.name) or {}
    return PrefixCache(identity(graph=digests.get(f"{version_dir.name}/{s.onnx_file}", s.onnx_file),
                                version=version_dir.name, precision=s.precision, kv_dtype=spec.kv_dtype,
                                attention=getattr(model, "attention", ""), device=getattr(model, "device", "")))


def _speculator(s: Settings, metrics: Any, draft: Any = None) -> Any:
    """The scheduler's speculative decoding (``speculative``: off, ``prompt_lookup``, or ``draft`` with ``draft``
    loaded), else None."""
    if s.speculative == "off":
        return None
    from .generation.speculative import SpeculativeConfig, Speculator

    return Speculator(SpeculativeConfig(num_speculative_tokens=s.num_speculative_tokens,
                                        prompt_lookup_max=s.prompt_lookup_max, prompt_lookup_min=s.prompt_lookup_min,
                                        max_sequences=s.speculative_max_sequences), metrics=metrics, draft=draft)


class GpuUnavailable(RuntimeError):
    """A text-generation graph that does not load on the instance's GPU (``why``: the cause), with the fixes."""

    def __init__(self, device_id: int, why: str) -> None:
        super().__init__(f"the text-generation graph does not load on cuda:{device_id} ({why}) and this model does "
                         "not allow serving on the CPU instead. Fix: install onnxruntime-gpu "
                         "('model-factory[onnxruntime-gpu]') on a machine with the GPU, serve the fp16 build, or set "
                         "[repository] allow_cpu_fallback = true in the recipe, or give the model a KIND_CPU "
                         "instance group")
        self.why = why


class GpuGeneration:
    """What a GPU instance of a text-generation model holds: the CUDA runtime, its stream, its pool, the graph's
    session on that stream and the KV slots in device buffers from the pool."""

    def __init__(self) -> None:
        self.rt: Any = None
        self.stream: Any = None
        self.pool: Any = None
        self.model: Any = None
        self.storage: Any = None
        self.slots: Any = None

    def close(self) -> None:
        """The session, the KV buffers back to the pool, then the pool and the stream (stream-ordered; idempotent)."""
        from .memory.pool import release_stream

        if self.model is not None:
            self.model.close()
            self.model = None
        if self.storage is not None:
            self.storage.close()
            self.storage = self.slots = None
        if self.rt is not None and self.stream is not None:
            self.rt.cudaStreamSynchronize(self.stream)
        release_stream(self.rt, self.stream, self.pool, True)
        self.stream = self.pool = None


def load_on_gpu(version_dir: Path, s: Settings, digests: Any, spec: GenerationSpec, device_id: int) -> GpuGeneration:
    """The served precision's graph on ONNX Runtime's CUDA provider on ``device_id``, on a stream of its own, and
    its KV slots in device buffers from a pool of its own: as many as hold a sequence at full context in what
    ``cudaMemGetInfo`` reports free once the session holds its weights, less ``device_reserve_mib`` (capped by
    ``memory_budget_mib`` less the weights when set). GpuUnavailable when it cannot (nothing half-made is kept);
    an IntegrityError or SettingsError as they come."""
    from .integrity import IntegrityError
    from .generation.kv_device import DeviceKVBuffers, device_memory, device_slots, kv_budget_from_device
    from .memory.pool import MemoryPool, check, require_device

    gpu = GpuGeneration()
    try:
        rt = gpu.rt = require_device(device_id)
        check(rt, rt.cudaSetDevice(device_id), f"cudaSetDevice({device_id})")
        gpu.stream = check(rt, rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreate")
        gpu.pool = MemoryPool(device_id, s.pool_release_threshold_mib * _MIB, s.pool_initial_mib * _MIB)
        placement = CudaPlacement(device_id, int(gpu.stream))
        gpu.model = load_verified_onnx(version_dir, s.onnx_file, digests,
                                       lambda src: CausalLM(src, pad_token_id=spec.pad_token_id or 0,
                                                            cuda=placement, precision=s.precision))
        # Read after the session holds its weights: what is free now is what the cache and activations share.
        free, _total = device_memory(device_id)
        budget = kv_budget_from_device(free, s.device_reserve_mib * _MIB)
        if s.memory_budget_mib:
            budget = min(budget, kv_budget_bytes(s, spec, 0))
        count = device_slots(spec, budget, s.max_active_sequences)
        gpu.storage = DeviceKVBuffers(spec, count, gpu.pool, gpu.stream)
        gpu.slots = KVSlots(spec, count, gpu.storage.nbytes, storage=gpu.storage)
    except (SettingsError, IntegrityError):
        gpu.close()
        raise  # a file changed after verification, or settings that fit no device: never a fallback
    except Exception as exc:  # noqa: BLE001 - no CUDA provider, no GPU, a graph it cannot run: named
        gpu.close()
        raise GpuUnavailable(device_id, f"{type(exc).__name__}: {exc}") from exc
    return gpu


@dataclass(frozen=True)
class _Choice:
    """One choice's part of a response: its text (a delta when streaming), ids, finish reason, tokens so far and,
    when asked, each token's log-probabilities."""

    index: int
    text: str
    ids: tuple[int, ...]
    finish_reason: str
    output_tokens: int
    logprobs: tuple[Any, ...] = ()


@dataclass(frozen=True)
class _Delta:
    """One response's content, as the engine loop hands it to the response thread."""

    choices: tuple[_Choice, ...]
    input_tokens: int
    indexed: bool = False  # the index output (a request with n > 1)
    logprobs: bool = False  # the logprobs output (asked)


def _input(pb_utils: Any, request: Any, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _load_tokenizer(version_dir: Path, digests: Any) -> Any:
    """The version's tokenizer, never truncating (a prompt past the context is refused with both lengths)."""
    from .requests.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(version_dir, 1 << 30, digests)
    except FileNotFoundError:
        return None  # prompt_ids only
    tok.no_truncation()
    return tok


def _make_metrics(pb_utils: Any, model_name: str, labels: dict):
    if not hasattr(pb_utils, "MetricFamily"):
        return None
    from .generation.metrics import GenerationMetrics

    return GenerationMetrics(pb_utils, model_name, extra_labels=labels)
