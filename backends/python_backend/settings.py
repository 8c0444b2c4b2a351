"""Backend settings, parsed once from the model configuration Triton hands to ``initialize()``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from .contract import (ENGINES, PRECISIONS, SPECULATIVE_TOKENS, TEXT_GENERATION, Files,  # noqa: F401
                       ParameterError, parse_parameters, plan_file, bounds_from_parameters, string_parameters)


class SettingsError(ValueError):
    """A model configuration the backend cannot run with (raised at load: the model stays unavailable)."""


@dataclass(frozen=True)
class IOSpec:
    """One input or output of the Triton model (dims exclude the batch axis)."""

    name: str
    data_type: str
    dims: tuple[int, ...]
    optional: bool


@dataclass(frozen=True)
class Settings:
    """Everything the backend reads from ``config.pbtxt``."""

    model_name: str
    max_batch_size: int
    inputs: tuple[IOSpec, ...]
    outputs: tuple[IOSpec, ...]
    max_sequence_length: int
    sequence_buckets: tuple[int, ...]
    grouping: str
    cost_model: tuple[float, float, float] | None
    max_group_tokens: int | None
    onnx_file: str
    engine: str
    pool_release_threshold_mib: int
    pool_initial_mib: int
    cost_model_repeats: int
    # The TorchScript file for engine=torch (and engine=auto on GPU instances), in the version folder.
    torchscript_file: str = Files.TORCHSCRIPT
    # The model's vocabulary size (Hugging Face config.json "vocab_size"): token ids must be below it.
    vocab_size: int | None = None
    # The cost model's start (short | sweep) and whether it keeps learning (None: yes unless constants are given).
    cost_model_warmup: str = "short"
    cost_model_online: bool | None = None
    # A GPU instance may serve on the CPU (ONNX Runtime) when no GPU engine loads: only when the recipe says so.
    cpu_fallback: bool = False
    # The precision this deployment serves (recipe repository.serve) and its TensorRT plan, if built.
    precision: str = "fp32"
    plan_file: str | None = None
    # Whether requests of different lengths may be padded into one launch along the sequence axis. Only a
    # model that ignores padding (it reads an attention mask) gives the same outputs padded; any other
    # model is batched only with requests of exactly its shape.
    pad_sequences: bool = True
    # ONNX Runtime CPU threads per instance: the ``cpu_threads`` parameter, else None (every core, see
    # cpu_threads_per_instance).
    cpu_threads: int | None = None
    # The ``cpu_spinning`` parameter: auto | on | off (:func:`cpu_spinning`).
    cpu_spinning: str = "auto"
    # With the cores split, runs borrow every core while no other CPU instance computes (idle_cores).
    lend_idle_cores: bool = True
    # Instances of this model on the CPU (``instance_group`` count of KIND_CPU groups; 0 when none).
    cpu_instances: int = 0
    # Send responses just after execute() returns (deferred_responses), not as its return value: by default
    # exactly when the configuration sets a queue policy, the case where Triton's batcher needs it.
    respond_after_return: bool = False
    # The allowed [low, high] of each index-like input (input_bounds.py): checked per request before any engine.
    input_bounds: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    # INT8 on the ONNX Runtime CPU engine: auto (integer kernels where the CPU has VNNI/AMX/dot products),
    # integer or simulated (Q/DQ in float); see cpu_features.
    int8_kernels: str = "auto"
    # Texts over max_sequence_length: refuse | truncate | chunk (long_inputs.py), the chunks' overlap in tokens
    # and how chunk vectors are pooled (none: this model does not chunk).
    long_inputs: str = "refuse"
    chunk_overlap: int = 32
    chunk_pooling: str = "none"
    # The recipe's task ("text-generation": the decoupled generator, generate_model.py) and its serving knobs.
    task: str | None = None
    memory_budget_mib: int = 0
    max_active_sequences: int = 32
    max_waiting_sequences: int = 64
    max_loras: int = 4
    preemption_wait_ms: int = 0
    max_tokens_grouping_ms: int = 0
    int8_attention: str = "auto"
    int8_matmul: str = "auto"
    prefix_caching: str = "auto"
    kv_admission: str = "paged"  # generation/kv_blocks.py: paged | reserve
    kv_layout: str = "slots"  # generation/kv_pool.py: slots | blocks
    max_prefill_tokens: int = 2048
    # Chunked prefill: "auto" or prompt tokens per engine step (0: off; generation/chunked_prefill.py).
    prefill_chunk_tokens: int | str = "auto"
    # Under auto: a step's chunk keeps the step within this multiple of the decode-only step (0, the default: the
    # fixed chunk; generation/itl_budget.py).
    max_itl_ratio: float = 0.0
    # Speculative decoding (generation/speculative.py; "off", "prompt_lookup" or "draft": speculative_draft's graph).
    speculative: str = "off"
    num_speculative_tokens: int = SPECULATIVE_TOKENS["prompt_lookup"]  # the method's where the parameter is unset
    prompt_lookup_max: int = 8
    prompt_lookup_min: int = 1
    speculative_max_sequences: int = 1
    speculative_draft: str = "none"
    device_reserve_mib: int = 1024
    # Degrade before shedding (degrade.py): the cheaper precision a backlogged window runs on (None: never) and
    # the window size (requests) from which it does (0: half of max_batch_size).
    degrade_to: str | None = None
    degrade_backlog: int = 0
    # Triton's dynamic batcher's preferred batch sizes: under a backlog a window holds the largest of them.
    preferred_batch_sizes: tuple[int, ...] = ()

    def input(self, name: str) -> IOSpec | None:
        """The input spec called ``name``, if any."""
        return next((s for s in self.inputs if s.name == name), None)

    @property
    def sequence_inputs(self) -> frozenset[str]:
        """Inputs whose first non-batch axis is dynamic: the sequence axis requests are grouped along."""
        return frozenset(i.name for i in self.inputs if i.dims and i.dims[0] == -1 and i.data_type != "TYPE_STRING")

    @property
    def sequence_outputs(self) -> frozenset[str]:
        """Outputs whose first non-batch axis is the sequence axis (sliced per request)."""
        return frozenset(o.name for o in self.outputs if o.dims and o.dims[0] == -1)


def _io(items: Any) -> tuple[IOSpec, ...]:
    return tuple(IOSpec(i["name"], i["data_type"], tuple(int(d) for d in i.get("dims", [])), bool(i.get("optional", False)))
                 for i in items or [])


def parse_settings(model_config: str | Mapping[str, Any]) -> Settings:
    """Parse Triton's JSON model configuration into :class:`Settings` (parameters through :mod:`.contract`)."""
    cfg = json.loads(model_config) if isinstance(model_config, str) else dict(model_config)
    params = string_parameters(cfg)
    try:
        p = parse_parameters(params)
    except ParameterError as exc:
        raise SettingsError(str(exc)) from None
    max_len = p.max_sequence_length
    buckets = p.sequence_buckets or (max_len,)
    if p.max_group_tokens and p.max_group_tokens < max_len:  # the longest request allowed could not be placed
        raise SettingsError(f"parameter max_group_tokens={p.max_group_tokens} is below max_sequence_length={max_len}: "
                            "use 0 (no budget) or at least max_sequence_length")
    if p.prompt_lookup_min > p.prompt_lookup_max:
        raise SettingsError(f"parameter prompt_lookup_min={p.prompt_lookup_min} is above prompt_lookup_max="
                            f"{p.prompt_lookup_max}: the shortest n-gram looked up must be at most the longest")
    if (p.speculative == "draft") != (p.speculative_draft != "none"):
        raise SettingsError(f"parameters speculative={p.speculative} and speculative_draft={p.speculative_draft} do "
                            "not go together: speculative = draft takes the precision that drafts (speculative_draft), "
                            "and only it")
    if p.speculative == "draft" and p.speculative_draft == p.precision:
        raise SettingsError(f"parameter speculative_draft={p.speculative_draft} is the precision served: a draft is "
                            "a cheaper precision of the same model")
    inputs = _io(cfg.get("input"))
    # Older repositories do not say: an attention mask is what makes padding harmless.
    pad_sequences = p.pad_sequences if p.pad_sequences is not None else any(i.name == "attention_mask" for i in inputs)
    cpu_instances = sum(int(g.get("count", 1) or 1) for g in cfg.get("instance_group") or []
                        if g.get("kind") == "KIND_CPU")
    return Settings(
        input_bounds=bounds_from_parameters(params, p.vocab_size),
        model_name=cfg.get("name", "model"),
        max_batch_size=int(cfg.get("max_batch_size", 0)),
        inputs=inputs,
        outputs=_io(cfg.get("output")),
        max_sequence_length=max_len,
        sequence_buckets=buckets,
        grouping=p.grouping,
        cost_model=p.cost_model,
        max_group_tokens=p.max_group_tokens or None,
        onnx_file=p.onnx_file,
        engine=p.engine,
        pool_release_threshold_mib=p.pool_release_threshold_mib,
        pool_initial_mib=p.pool_initial_mib,
        cost_model_repeats=p.cost_model_repeats,
        torchscript_file=p.torchscript_file,
        vocab_size=p.vocab_size,
        cost_model_warmup=p.cost_model_warmup,
        cost_model_online=p.cost_model_online,
        cpu_fallback=p.cpu_fallback,
        precision=p.precision,
        # Packages from before the precision parameter name no plan: the served precision's own, if any.
        plan_file=p.plan_file or (None if "precision" in params else plan_file(p.precision)),
        pad_sequences=pad_sequences,
        cpu_threads=p.cpu_threads or None,
        cpu_spinning=p.cpu_spinning,
        lend_idle_cores=p.lend_idle_cores,
        cpu_instances=cpu_instances,
        respond_after_return=p.respond_after_return == "true"
        or (p.respond_after_return == "auto" and has_queue_policy(cfg)),
        int8_kernels=p.int8_kernels,
        long_inputs=p.long_inputs,
        chunk_overlap=p.chunk_overlap,
        chunk_pooling=p.chunk_pooling,
        task=p.task,
        memory_budget_mib=p.memory_budget_mib,
        max_active_sequences=p.max_active_sequences,
        max_waiting_sequences=p.max_waiting_sequences,
        max_loras=p.max_loras,
        preemption_wait_ms=p.preemption_wait_ms,
        max_tokens_grouping_ms=p.max_tokens_grouping_ms,
        int8_attention=p.int8_attention,
        int8_matmul=p.int8_matmul,
        prefix_caching=p.prefix_caching,
        kv_admission=p.kv_admission,
        kv_layout=p.kv_layout,
        max_prefill_tokens=p.max_prefill_tokens,
        prefill_chunk_tokens=p.prefill_chunk_tokens,
        max_itl_ratio=p.max_itl_ratio,
        speculative=p.speculative,
        num_speculative_tokens=p.num_speculative_tokens or SPECULATIVE_TOKENS.get(p.speculative,
                                                                                   SPECULATIVE_TOKENS["prompt_lookup"]),
        prompt_lookup_max=p.prompt_lookup_max,
        prompt_lookup_min=p.prompt_lookup_min,
        speculative_max_sequences=p.speculative_max_sequences,
        speculative_draft=p.speculative_draft,
        device_reserve_mib=p.device_reserve_mib,
        degrade_to=p.degrade_to or None,
        degrade_backlog=p.degrade_backlog,
        preferred_batch_sizes=tuple(int(x) for x in (cfg.get("dynamic_batching") or {}).get("preferred_batch_size")
                                    or ()),
    )


def has_queue_policy(cfg: Mapping[str, Any]) -> bool:
    """Whether Triton's JSON model configuration sets a queue policy (a bound, a timeout or priorities).

    Any of them turns Triton's payload prefetching off, and with it the batcher's wake-ups depend on the
    instance waiting when requests arrive (deferred_responses). Triton writes 64-bit fields as strings.
    """
    batching = cfg.get("dynamic_batching") or {}
    policy = batching.get("default_queue_policy") or {}

    def positive(value: Any) -> bool:
        try:
            return int(value or 0) > 0
        except (TypeError, ValueError):
            return False

    return (positive(policy.get("max_queue_size")) or positive(policy.get("default_timeout_microseconds"))
            or positive(batching.get("priority_levels")) or bool(batching.get("priority_queue_policy")))


def cpu_threads_per_instance(settings: Settings, cpus: int) -> int:
    """ONNX Runtime intra-op threads for one CPU instance: the cores split between the instances, unless
    ``cpu_threads`` says otherwise.

    Each instance is its own stub process with its own session. With a thread per core in each instance and
    ONNX Runtime's spinning on, two instances on 2 cores ran slower than one (0.81x, benchmarks/RESULTS.md,
    "Instances"); every core per instance with spinning off (:func:`cpu_spinning`; ``cpu_threads`` = the
    core count) gives a lone request all the cores but loses the loaded case (a calm 2-core Xeon:
    benchmarks/history/RESULTS-notebook-2026-12-01.md, "INT8 on the CPU"). So the split stays, and a lone
    request borrows the idle cores instead (``idle_cores``).
    """
    if settings.cpu_threads:
        return settings.cpu_threads
    return max(1, int(cpus) // max(1, settings.cpu_instances))


def cpu_spinning(settings: Settings, cpus: int, threads: int) -> bool:
    """Whether ONNX Runtime's intra-op threads may spin: as the ``cpu_spinning`` parameter says; under "auto" only
    when the instances' threads fit the cores.

    A text-generation model sends a response a token: the stub's response thread, Triton, the OpenAI frontend and the
    clients run between and during its launches, on the same cores. Served Gemma 3 270M (INT8 dynamic + INT8 KV, 2
    cores): on a machine other work shared (load average 7-14) spinning off made 1.2-2x the tokens/s at 8 and 32
    streams; on a calm one (load 1-2) spinning on made more in 5 of 6 rounds (benchmarks/RESULTS.md,
    "served_overhead"). A server's cores are its own, so "auto" keeps the rule of every model; ``off`` is for a host
    whose cores other work shares.
    """
    if settings.cpu_spinning != "auto":
        return settings.cpu_spinning == "on"
    return max(1, settings.cpu_instances) * max(1, threads) <= max(1, int(cpus))
