"""Triton's entry points for model-factory models (kept thin: the logic lives in the modules beside it).

``initialize()`` parses the configuration once, loads the engine (``loading``:
TensorRT, ONNX Runtime CUDA or torch on a GPU instance, ONNX Runtime on a CPU one), the
tokenizer for text models, and fixes the cost model (measured by a warm-up over
the optimization profiles unless given). ``execute()`` validates each request
alone, runs the window through the grouped executor and returns exactly one
response per request, in order: outputs, or an INVALID_ARG error for that
request alone. A ``task = "text-generation"`` model is a decoupled generator instead (``generate_model``):
its instance hands every call over to it.
"""

from __future__ import annotations

import faulthandler
import os
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from .contract import PROMPT, TEXT_GENERATION
from .batching.executor import GroupedExecutor
from .batching.grouping import profile_for_length
from .engines.loading import load_for_serving, text_inputs
from .operations import decisions
from .contract import BACKEND_OUTPUTS, PRECISION_OUTPUT, TRUNCATED_TOKENS_OUTPUT
from .operations.degrade import precision_column
from .operations.events import EventLog, request_id
from .operations.tracing import Sampler, SpanExporter, parse_context
from .requests.long_inputs import LongInputRefused, TextEncoder, pool_chunks
from .requests.items import RequestError, check_items, items_from_tensors, request_parameters, texts_from_text_inputs
from .memory.guard import guard_for
from .requests.samples import sample_feeds
from .settings import parse_settings


class TritonPythonModel:
    """One model instance."""

    generator = None  # a text-generation model's decoupled generator (generate_model), a prompt's definition (prompt_model)
    shadow = None  # the rollout's shadow mirror (shadow.py), set at load

    def initialize(self, args: dict) -> None:
        from .operations.orphan_watch import watch_parent

        watch_parent()  # this stub exits when its server has died (Triton 2.51 leaves it running)
        # A stub that crashes (a fault in native code) leaves every thread's Python stack in Triton's log.
        try:
            faulthandler.enable(all_threads=True)
        except (AttributeError, OSError, RuntimeError, ValueError):  # no usable stderr: serve without it
            pass
        from .operations.shadow import yield_cores_if_candidate

        yield_cores_if_candidate(str(args.get("model_name", "")))  # a rollout's candidate: lowest CPU priority
        self.settings = s = parse_settings(args["model_config"])
        kind = args.get("model_instance_kind", "CPU")
        # A rollout's switch loads this version beside the one serving: the load then runs at the lowest CPU
        # priority in a thread of its own, this (serving) thread keeping its priority (quiet_start.py).
        from .engines.quiet_start import requested, run_quietly
        from .operations.shadow import shadow_folder

        quiet = kind == "CPU" and requested(shadow_folder(), s.model_name)
        if s.task == TEXT_GENERATION:
            from .generate_model import GenerativeModel

            self.generator = GenerativeModel(pb_utils, args, s, quiet=quiet)
            return
        if s.task == PROMPT:  # a prompt template: its signed definition answered (prompt_model)
            from .prompt_model import PromptDefinition

            self.generator = PromptDefinition(pb_utils, args, s)
            return
        version_dir = Path(args["model_repository"]) / args["model_version"]

        def load() -> tuple:
            # One load path for serve, accept and build's check: the engine, the tokenizer, a warm-up run per bucket
            # with values the model accepts. A model that cannot run its warm-up is refused here, with the fix.
            engine, info, tokenizer = load_for_serving(version_dir, s, kind,
                                                       int(args.get("model_instance_device_id", 0) or 0),
                                                       server_instance=True)
            # Texts over max_sequence_length: refused, truncated and said, or chunked (long_inputs.py).
            encoder = (TextEncoder(tokenizer, s.max_sequence_length, s.chunk_overlap, s.chunk_pooling)
                       if tokenizer is not None else None)
            return engine, info, tokenizer, encoder

        started = time.monotonic()
        if quiet:
            (self.engine, self.engine_info, self.tokenizer, self.encoder), lowered = run_quietly(load)
            self.engine_info["start"] = (f"quiet ({'nice 19' if lowered else 'priority unchanged'}), "
                                         f"{time.monotonic() - started:.1f} s")
        else:
            self.engine, self.engine_info, self.tokenizer, self.encoder = load()
        # Token ids past the embedding table are refused per request (INVALID_ARG) instead of failing the group.
        self.vocab_size = s.vocab_size
        # Text inputs (BYTES): `text`, or `query` + `passage` for a reranker; tokenized here with the model's tokenizer.
        self.text_inputs = text_inputs(s)
        # Decision events (events.py): rate-limited JSON lines to serve's --events file, else Triton's log.
        self.events = EventLog.from_env(s.model_name, str(args.get("model_instance_name", "")),
                                        log=pb_utils.Logger.log_info)
        decisions.engine_choices(self.events, self.engine_info)
        # OpenTelemetry spans (serve --trace-endpoint) under the backend's own request span (its sampler) or
        # Triton's model span (--trace-source triton: no sampler); None: tracing off, no cost.
        self.tracer = SpanExporter.from_env({"model": s.model_name,
                                             "instance": str(args.get("model_instance_name", ""))})
        self.trace_sampler = Sampler.from_env() if self.tracer is not None else None
        if self.tokenizer is not None:
            self.vocab_size = self.tokenizer.get_vocab_size()
        # What the engine computes; truncated_tokens (declared beside them for text models) is the backend's.
        self._engine_outputs = tuple(o.name for o in s.outputs if o.name not in BACKEND_OUTPUTS)
        self._says_truncation = any(o.name == TRUNCATED_TOKENS_OUTPUT for o in s.outputs)
        self._says_precision = any(o.name == PRECISION_OUTPUT for o in s.outputs)
        seq_inputs = s.sequence_inputs
        self._zeros_for = [n for n in self.engine.input_names if n == "token_type_ids"]
        # An engine with one optimization profile per bucket (TensorRT) gets a cost model per profile.
        per_profile = int(getattr(self.engine, "num_profiles", 1) or 1) > 1
        # A model without a sequence axis runs every request at "length" 1: its warm-up times batch sizes only.
        buckets = s.sequence_buckets if seq_inputs else (1,)
        start, cache_file, cache_key = _start_cost(s, self._dummy_run(), buckets, per_profile and bool(seq_inputs),
                                                   args, self.engine_info)
        cost = start.cost
        self.executor = GroupedExecutor(
            self.engine, cost, max_batch=s.max_batch_size, buckets=s.sequence_buckets,
            seq_inputs=seq_inputs, seq_outputs=s.sequence_outputs, mode=s.grouping,
            max_tokens=s.max_group_tokens, fill=self._fill, pad_sequences=s.pad_sequences,
            memory_guard=guard_for(self.engine))
        # Degrade before shedding (degrade.py): a backlogged window runs on a cheaper precision that passed its gate.
        self.degrader = None
        if s.degrade_to:
            from .operations.degrade import build_degrader

            self.degrader = build_degrader(s, version_dir, args, seq_inputs, buckets, self._fill, self.events,
                                           pb_utils.Logger.log_info)
        # Loaded: from here on the stub reads only its model folder, the Python environment and system libraries,
        # writes only its scratch (and the cost cache), starts no process and opens no network socket (sandbox.py).
        from .integrity import ENV as DIGESTS_ENV
        from .operations.sandbox import wall_in_stub

        digests = os.environ.get(DIGESTS_ENV)
        # Shadow mirroring during a rollout (shadow.py): a share of answered requests sent again to a candidate.
        from .operations.events import input_hash
        from .operations.shadow import ShadowMirror, shadow_folder

        shadow_dir = shadow_folder()
        self.shadow = ShadowMirror(pb_utils, shadow_dir, s.model_name, str(args.get("model_instance_name", "")),
                                   classification="classif" in (s.task or ""), hash_inputs=input_hash,
                                   log=pb_utils.Logger.log_warn)
        writable = ((str(Path(cache_file).parent),) if cache_file else ()) + ((str(shadow_dir),) if shadow_dir else ())
        self.engine_info["sandbox"] = wall_in_stub(
            version_dir, writable=writable,
            readable_files=(digests,) if digests else (), ip_sockets=self.tracer is not None)
        # The GPU engines' memory: TensorRT's per-instance cudaMallocAsync pool, torch's allocator (None on CPU).
        self.pool = getattr(self.engine, "pool", None)
        pool_source = self.pool.stats if self.pool is not None else None
        # One label per instance: each instance has its own pool, and counters sum across instances anyway.
        self.metrics = _make_metrics(s.model_name, self.executor.estimator or cost, self.engine_info, pool_source,
                                     {"instance": str(args.get("model_instance_name", ""))})
        self.cost_keeper = None
        if self.executor.estimator is not None:
            from .batching.cost_learning import CostKeeper

            self.cost_keeper = CostKeeper(self.executor.estimator, cache_file=cache_file,
                                          log=pb_utils.Logger.log_info, meta={"model": s.model_name, **cache_key})
        # Responses go out just after execute() returns: Triton's batcher with a queue policy is then woken
        # by the next requests instead of sleeping 500 ms on them (deferred_responses).
        self.dispatcher = None
        if s.respond_after_return:
            from .batching.deferred_responses import ResponseDispatcher

            final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            self.dispatcher = ResponseDispatcher(lambda sender, response: sender.send(response, flags=final),
                                                 pb_utils.Logger.log_error)
        self.trimmer = None
        if self.pool is not None:
            from .memory.pool import IdleTrimmer

            self.trimmer = IdleTrimmer(self.pool, keep_bytes=s.pool_initial_mib << 20, on_trim=self._publish_pool)
        for key, why in self.engine_info.items():  # every engine skipped on the way, with its reason
            if key.startswith("fallback_from_"):
                pb_utils.Logger.log_warn(f"model-factory backend: {s.model_name}: {key[len('fallback_from_'):]} "
                                         f"engine not used: {why}")
        if self.engine_info.get("int8_kernels") == "simulated":  # say plainly that INT8 buys no speed here
            pb_utils.Logger.log_warn(f"model-factory backend: {s.model_name}: INT8 with Q/DQ simulated in float: "
                                     f"{self.engine_info.get('int8_kernels_why')}")
        if self.engine_info.get("format") == "TorchScript":
            pb_utils.Logger.log_warn(f"model-factory backend: {s.model_name}: serving a TorchScript trace "
                                     f"({self.engine_info['file']}), which torch deprecates: rebuild the repository "
                                     "with this model-factory to serve model.pt2 (torch.export)")
        if "cpu_fallback" in self.engine_info:
            pb_utils.Logger.log_warn(f"model-factory backend: {s.model_name}: GPU instance serving on the CPU "
                                     f"(ONNX Runtime): {self.engine_info['cpu_fallback']}")
        device = self.engine_info.get("device")
        kernels = self.engine_info.get("int8_kernels")
        pb_utils.Logger.log_info(
            f"model-factory backend: {s.model_name} serves {s.precision} on {self.engine_info['flavour']} "
            f"({self.engine_info['file']}){f' on {device}' if device else ''}"
            + (f", {self.engine_info['threads']} threads" if "threads" in self.engine_info else "")
            + (f", idle cores: {self.engine_info['lend_idle_cores']}" if "lend_idle_cores" in self.engine_info else "")
            + (f", int8 kernels: {kernels} ({self.engine_info.get('int8_kernels_why')})" if kernels else "")
            + f", grouping={s.grouping}, {start.note}, sandbox {self.engine_info['sandbox']}"
            + (f", load {self.engine_info['start']}" if "start" in self.engine_info else ""))

    def _fill(self, item: dict) -> dict:
        # Inputs the graph takes but the request may omit (BERT's token_type_ids) are zeros.
        for name in self._zeros_for:
            if name not in item:
                item[name] = np.zeros_like(item["input_ids"])
        return item

    def _dummy_run(self):
        names = self.engine.input_names
        # Without a sequence axis the sweep's "length" is 1; other dynamic axes then take the first bucket.
        fixed = None if self.settings.sequence_inputs else self.settings.sequence_buckets[0]

        def run(n: int, length: int) -> None:
            # Inputs of the declared dtypes and dims (an image CNN gets FP32 images, an encoder token ids).
            feeds = sample_feeds(self.settings, names, n, fixed or length)
            self.engine.run(feeds, profile_for_length(length, self.settings.sequence_buckets))

        return run

    def execute(self, requests: list) -> list | None:
        if self.generator is not None:
            return self.generator.execute(requests)
        # The whole window counts as computing; a window of one request (nothing else queued) may borrow the
        # other instances' idle cores (idle_cores).
        busy = getattr(self.engine, "busy", None)
        if busy is None:
            return self._execute(requests)
        with busy(borrow=len(requests) == 1):
            return self._execute(requests)

    def _execute(self, requests: list) -> list | None:
        start = time.perf_counter()
        s = self.settings
        batches, errors, wanted, encoded = [], {}, [], {}
        long = {"refused": 0, "truncated": 0, "chunked": 0, "dropped": 0}
        seen = [self._seen(request) for request in requests]
        parents = [self._trace_parent(r) for r in requests] if self.tracer is not None else None
        self.executor.record_spans = bool(parents) and any(parents)
        mirror = self.shadow.active() if self.shadow is not None else None
        mirrored: dict[int, dict] = {}  # request -> its inputs, while a rollout mirrors this model
        own: dict[int, list] = {}  # traced requests' own spans: (name, start_ns, end_ns, attributes)
        for idx, request in enumerate(requests):
            asked = tuple(request.requested_output_names())
            traced = parents is not None and parents[idx] is not None
            t0 = time.time_ns() if traced else 0
            try:
                raw = {n: _as_numpy(pb_utils.get_input_tensor_by_name(request, n)) for n in self.text_inputs}
                raw = {n: v for n, v in raw.items() if v is not None}
                if raw:
                    tok0 = time.time_ns() if traced else 0
                    enc = self._encode_texts(request, raw)
                    if traced:
                        own.setdefault(idx, []).append(("tokenize", tok0, time.time_ns(),
                                                        {"texts": len(enc.spans), "tokens": sum(enc.lengths)}))
                    items, encoded[idx] = enc.items, enc
                    check_items(items, s)
                    long["truncated"] += enc.truncated_rows
                    long["chunked"] += enc.chunked_rows
                    long["dropped"] += sum(enc.dropped)
                    if enc.truncated_rows or enc.chunked_rows:
                        decisions.long_input(self.events, seen[idx], enc, s.max_sequence_length)
                else:
                    tensors = {i.name: _as_numpy(pb_utils.get_input_tensor_by_name(request, i.name))
                               for i in s.inputs if i.data_type != "TYPE_STRING"}
                    items = items_from_tensors(tensors, s, self.vocab_size)
                if mirror is not None:  # copies: a tensor's array may be a view of the request's shared memory
                    mirrored[idx] = raw or {n: np.array(v) for n, v in tensors.items() if v is not None}
                engine_wanted = self._engine_wanted(asked, encoded.get(idx))
            except RequestError as exc:
                if isinstance(exc, LongInputRefused):
                    long["refused"] += 1
                errors[idx] = str(exc)
                decisions.refused(self.events, seen[idx], str(exc))
                items, engine_wanted = [], self._engine_outputs
                encoded.pop(idx, None)
            batches.append(items)
            wanted.append(engine_wanted)
            if traced:
                own.setdefault(idx, []).append(("validate", t0, time.time_ns(),
                                                {"sequences": len(items), "refused": idx in errors}))
        borrowed = getattr(self.engine, "wide_runs", 0)
        executor, answered_by = self.executor, s.precision
        if self.degrader is not None:
            executor, answered_by = self.degrader.choose(self.executor, s.precision, len(requests) - len(errors))
            executor.record_spans = self.executor.record_spans
        results, stats = executor.run(batches, wanted)
        if answered_by != s.precision:
            self._said_degraded([x for i, x in enumerate(seen) if i not in errors], answered_by)
        responses = []
        for idx, result in enumerate(results):
            r0 = time.time_ns() if parents is not None and parents[idx] is not None else 0
            if idx in errors:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(errors[idx], pb_utils.TritonError.INVALID_ARG)))
            elif isinstance(result, Exception):
                decisions.failed(self.events, seen[idx], result)
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(result))))
            else:
                if idx in encoded:
                    result = self._text_outputs(result, encoded[idx], requests[idx])
                if idx in mirrored:
                    self.shadow.offer(mirror, mirrored[idx], {k: np.array(v) for k, v in result.items()})
                if self._says_precision:
                    result = self._precision_output(result, requests[idx], answered_by)
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(name, np.ascontiguousarray(val)) for name, val in result.items()]))
            if r0:
                own.setdefault(idx, []).append(("respond", r0, time.time_ns(), {"error": idx in errors}))
        if self.metrics is not None:
            self.metrics.observe_window(stats, time.perf_counter() - start)
            self.metrics.add_borrowed_runs(getattr(self.engine, "wide_runs", 0) - borrowed)
            self.metrics.observe_long_inputs(**long)
        decisions.window(self.events, [x for i, x in enumerate(seen) if i not in errors], stats,
                         time.perf_counter() - start, s.grouping)
        if self.metrics is not None:
            self.metrics.set_events_dropped(self.events.dropped_total)
            if self.tracer is not None:  # as of the export thread's last batch
                self.metrics.set_trace_spans(self.tracer.sent, self.tracer.dropped)
        if parents is not None and any(parents):  # queued raw: the export thread makes the spans
            self.tracer.add_window(parents, [x.id for x in seen], own, stats.spans)
        if self.trimmer is not None:
            self.trimmer.touch()
        if self.cost_keeper is not None:
            self.cost_keeper.after_window()
        if self.dispatcher is not None:
            self.dispatcher.dispatch([request.get_response_sender() for request in requests], responses)
            return None
        return responses

    def _seen(self, request) -> "decisions.Seen":
        """The request as events name it: its id (KServe id, X-Request-ID header, or generated) and its inputs."""
        rid, source = request_id(request.request_id(), request.parameters())
        names = [i.name for i in self.settings.inputs]
        return decisions.Seen(rid, source, lambda: [t.as_numpy() for t in
                                                    (pb_utils.get_input_tensor_by_name(request, n) for n in names)
                                                    if t is not None])

    def _trace_parent(self, request):
        """The span this request's spans go under, when it is traced: the backend's own request span (its sampler:
        the client's traceparent header, else one request in the rate), or Triton's model span (Triton's tracer
        as the source); else None."""
        if self.trace_sampler is not None:
            return self.trace_sampler.parent(request_parameters(request.parameters()))
        trace = request.trace()
        return parse_context(trace.get_context()) if trace is not None else None

    def _encode_texts(self, request, raw: dict):
        """A request's texts as items, under its long-input mode (long_inputs.py)."""
        mode = self.encoder.mode_for(request.parameters(), self.settings.long_inputs)
        return self.encoder.encode(texts_from_text_inputs(raw), mode, self.engine.input_names)

    def _engine_wanted(self, asked: tuple, enc) -> tuple:
        """The engine outputs a request gets; a chunked text has pooled ones only (a sequence has no pooling)."""
        names = tuple(n for n in asked if n not in BACKEND_OUTPUTS) if asked else self._engine_outputs
        if enc is not None and enc.chunked_rows:
            # Triton names every output when the request names none: the sequence ones are left out then;
            # a request that asks for sequence outputs alone is told why it cannot have them.
            pooled = tuple(n for n in names if n not in self.settings.sequence_outputs)
            if not pooled:
                raise RequestError(f"output {names[0]!r} is per token and a chunked text has no single sequence: "
                                   "ask for the pooled outputs (e.g. 'embedding') with long_inputs=chunk")
            names = pooled
        return names

    def _text_outputs(self, result: dict, enc, request) -> dict:
        """Chunk rows pooled back to one per text, and ``truncated_tokens`` when declared and wanted."""
        result = pool_chunks(result, enc, self.settings.chunk_pooling)
        asked = tuple(request.requested_output_names())
        if self._says_truncation and (not asked or TRUNCATED_TOKENS_OUTPUT in asked):
            result[TRUNCATED_TOKENS_OUTPUT] = np.asarray(enc.dropped, dtype=np.int64).reshape(-1, 1)
        return result

    def _precision_output(self, result: dict, request, answered_by: str) -> dict:
        """``precision`` (declared with degrade_to) when wanted: which precision answered each row."""
        asked = tuple(request.requested_output_names())
        if not asked or PRECISION_OUTPUT in asked:
            rows = next(iter(result.values())).shape[0] if result else 1
            result[PRECISION_OUTPUT] = precision_column(answered_by, rows)
        return result

    def _said_degraded(self, seen: list, precision: str) -> None:
        """A window answered by the degrade precision: counted per request and one decision event."""
        if self.metrics is not None:
            self.metrics.add_degraded(precision, len(seen))
        decisions.degraded(self.events, seen, precision, self.degrader.policy.backlog, self.degrader.gate)

    def _publish_pool(self, pool) -> None:
        if self.metrics is not None:
            self.metrics.set_pool_stats(pool.stats())

    def finalize(self) -> None:
        if self.generator is not None:
            self.generator.finalize()
            return
        if self.dispatcher is not None:  # what was computed is still sent
            self.dispatcher.close()
        if self.shadow is not None:
            self.shadow.close()
        if self.cost_keeper is not None:
            self.cost_keeper.close(self.executor.planner)
        if self.trimmer is not None:
            self.trimmer.close()
        if self.metrics is not None:
            self.metrics.close()
        self.events.close()
        if self.tracer is not None:
            self.tracer.close()
        if self.degrader is not None:
            self.degrader.close()
        self.engine.close()


def _as_numpy(tensor) -> np.ndarray | None:
    return None if tensor is None else tensor.as_numpy()


def _start_cost(s, run, buckets, per_profile: bool, args: dict, engine_info: dict):
    """``(CostStart, cache file or None, cache key parts)``: the starting cost model (cost_learning)."""
    from .batching import cost_cache
    from .batching.cost_learning import start_cost_model

    folder, key, cache_file = cost_cache.cache_dir_from_env(), {}, None
    if folder is not None and not s.cost_model:
        kind, device_id = args.get("model_instance_kind", "CPU"), int(args.get("model_instance_device_id", 0) or 0)
        key = {"engine_sha256": _engine_sha256(Path(args["model_repository"]), str(args["model_version"]),
                                               engine_info["file"]),
               "flavour": engine_info["flavour"], "device": cost_cache.device_description(engine_info, kind, device_id)}
        cache_file = cost_cache.cache_path(folder, s.model_name, cost_cache.cache_key(
            key["engine_sha256"], key["flavour"], key["device"], buckets, per_profile))
    start = start_cost_model(run=run, buckets=buckets, max_batch=s.max_batch_size,
                             max_tokens=s.max_group_tokens, per_profile=per_profile, given=s.cost_model,
                             online=s.cost_model_online, warmup=s.cost_model_warmup, repeats=s.cost_model_repeats,
                             cache_file=cache_file)
    return start, cache_file, key


def _engine_sha256(model_dir: Path, version: str, file: str) -> str:
    """The engine file's sha256, for the cost cache's key: verified digests, else metadata.json's, else hashed.

    Only a cache key (what was learned for which engine), never a check: integrity is loading's job.
    """
    import hashlib
    import json

    from .contract import Files
    from .integrity import verified_digests

    digests = verified_digests(model_dir.name, version)
    relpath = f"{version}/{file}"
    if digests and relpath in digests:
        return digests[relpath]
    try:
        listed = json.loads((model_dir / version / Files.METADATA).read_text()).get("files", {}).get(file)
        if isinstance(listed, str) and len(listed) == 64:
            return listed
    except (OSError, ValueError, AttributeError):
        pass
    h = hashlib.sha256()
    with open(model_dir / relpath, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _make_metrics(model_name: str, cost, engine_info: dict, pool_source=None, labels=None):
    try:
        from .operations.metrics import BackendMetrics
    except ImportError:  # metrics are optional for the backend to run
        return None
    return BackendMetrics(pb_utils, model_name, cost, engine_info, extra_labels=labels, pool_source=pool_source)
