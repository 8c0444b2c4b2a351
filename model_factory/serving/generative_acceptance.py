"""Acceptance of a text-generation model on this machine: its golden continuations replayed through the runtime.

``acceptance/continuations.json`` (``backend/contract.Files.CONTINUATIONS``) holds prompts with the FP32
reference's greedy tokens and, for each, the first near-tie step (where the reference's top two logits differ
by less than 1e-3 and float rounding may pick either). The served precision's graph is loaded as the backend
loads it (``causal_lm.CausalLM`` through the integrity check) and every prompt is generated greedily by the
backend's own scheduler, all of them batched together as under load. The score is what the build's gate scored
(``build_engines.lm_quantize``), on this machine's kernels: the teacher-forced token agreement, each prompt and
its reference tokens run as one sequence through the served graph, the prediction at every position compared
with the next reference token up to the prompt's near-tie. The model passes when it reaches the file's
``min_agreement``; FP32 must also reach it generating freely through the batched scheduler (its tokens equal to
the reference's up to the first difference, counted up to each near-tie), since the reference is its own
output. A reduced precision generating freely departs from the reference at its first differing token and
never returns to it (the tests' random-weight Llama: INT4 0.54 teacher-forced, 0.03 free; dynamic INT8 0.89 and
0.12): that figure is reported, not gated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from model_factory.serving.refusals import one_line

METRIC = "token_agreement"


def agreement(got: list[list[int]], prompts: list[Mapping[str, Any]]) -> tuple[float, int]:
    """``(agreeing / compared tokens, tokens compared)``, each prompt compared up to its near-tie."""
    agree = compared = 0
    for tokens, p in zip(got, prompts):
        want = [int(t) for t in p["tokens"]]
        end = len(want) if p.get("near_tie") is None else min(len(want), int(p["near_tie"]))
        compared += end
        for a, b in zip(tokens[:end], want[:end]):
            if a != b:
                break
            agree += 1
    return (agree / compared if compared else 1.0), compared


def teacher_forced(model: Any, slots: Any, prompts: list[Mapping[str, Any]]) -> tuple[float, int]:
    """``(agreeing / compared, compared)``: the graph's own next-token predictions along each reference."""
    agree = compared = 0
    for p in prompts:
        want = [int(t) for t in p["tokens"]]
        n = len(want) if p.get("near_tie") is None else min(len(want), int(p["near_tie"]))
        if n == 0:
            continue
        prompt = [int(t) for t in p["prompt_ids"]]
        slot = slots.admit(len(prompt) + n)
        try:
            logits = model.position_logits(prompt + want[:n - 1], slots.views(slot, 1))
        finally:
            slots.release(slot)
        predicted = logits[len(prompt) - 1:len(prompt) - 1 + n].argmax(axis=-1)
        agree += int(sum(int(a) == b for a, b in zip(predicted, want[:n])))
        compared += n
    return (agree / compared if compared else 1.0), compared


def accept_generative(model_dir: Path, version: str, settings: Any, digests: Mapping[str, str] | None,
                      instance: tuple[str, int] = ("CPU", 0)) -> dict[str, Any]:
    """Replay the golden continuations of ``model_dir/version`` on this machine (never raises): the fields of
    its ``acceptance.AcceptanceResult`` after model and version (``passed``, ``score``, ``reason``, ...).
    ``instance``: where the model's instance runs (``acceptance.instance_of``); a GPU instance replays them on
    that GPU as the backend loads it (``generate_model.load_on_gpu``), or on the CPU where its recipe allows the
    fallback and the GPU path does not load."""
    from model_factory.backend.generation.causal_lm import CausalLM, attention_kernel
    from model_factory.backend.contract import Files, GenerationSpec
    from model_factory.backend.generate_model import GpuUnavailable, _load_tokenizer, load_on_gpu
    from model_factory.backend.integrity import read_checked
    from model_factory.backend.generation.kv_slots import KVSlots
    from model_factory.backend.engines.loading import load_verified_onnx
    from model_factory.backend.generation.sampling import SamplingParams
    from model_factory.backend.generation.scheduler import Generation, Scheduler

    d = None if digests is None else dict(digests)
    rel = f"{version}/{Files.ACCEPTANCE_DIR}/{Files.CONTINUATIONS}"
    if not (Path(model_dir) / rel).is_file():
        return dict(passed=False, metric=METRIC, reason=f"no golden continuations ({rel}): "
                                "rebuild the model with this model-factory")
    try:
        golden = json.loads(read_checked(Path(model_dir), rel, d))
        spec = GenerationSpec.from_json(read_checked(Path(model_dir), f"{version}/{Files.GENERATION}", d).decode()
                                        ).for_precision(settings.precision)
        prompts, gate = list(golden["prompts"]), float(golden["min_agreement"])
    except Exception as exc:  # noqa: BLE001 - an unreadable or tampered file: refused with the reason
        return dict(passed=False, metric=METRIC, reason=f"{type(exc).__name__}: {exc}")
    vdir = Path(model_dir) / version
    kind, device_id = instance
    where = dict(engine="onnxruntime", file=settings.onnx_file, device="cpu")
    gpu = slots = None
    try:
        if kind == "GPU":
            try:
                gpu = load_on_gpu(vdir, settings, d, spec, device_id)
                model, slots, where["device"] = gpu.model, gpu.slots, gpu.model.device
            except GpuUnavailable:
                if not settings.cpu_fallback:
                    raise
        if gpu is None:
            model = load_verified_onnx(vdir, settings.onnx_file, d,
                                       lambda src: CausalLM(src, pad_token_id=spec.pad_token_id or 0,
                                                            int8_attention=attention_kernel(settings.int8_attention,
                                                                                            spec.kv_dtype),
                                                            int8_matmul=settings.int8_matmul))
        tokenizer = _load_tokenizer(vdir, d)
    except Exception as exc:  # noqa: BLE001 - it would not load in Triton either: that is the verdict
        if gpu is not None:
            gpu.close()
        return dict(passed=False, metric=METRIC, threshold=gate, **where,
                                reason=f"the model does not load here ({kind} instance): {one_line(exc)}")
    try:
        need = max(len(p["prompt_ids"]) + len(p["tokens"]) for p in prompts)
        if slots is None:
            slots = KVSlots(spec, max(1, min(len(prompts), settings.max_active_sequences)),
                            budget_bytes=KVSlots(spec, 1, 1 << 62).bytes_for(need) * len(prompts))
        sched = Scheduler(model, slots, tokenizer, spec.eos_token_ids, max_waiting=len(prompts))
        gens = []
        for p in prompts:
            # Greedy, exactly as many tokens as the reference made, eos not ending it (a reference that stopped
            # at eos ends with it: the tokens compared are the same).
            # The build's golden tokens were made with eos blocked until max_tokens (min_new_tokens): eos is
            # blocked here too, up to a reference's own final eos.
            n = len(p["tokens"])
            ends_in_eos = bool(n) and int(p["tokens"][-1]) in spec.eos_token_ids
            params = SamplingParams(max_tokens=n, min_tokens=n - 1 if ends_in_eos else n, ignore_eos=True)
            gens.append(sched.submit(Generation([int(t) for t in p["prompt_ids"]], params, lambda g, e: None)))
        while sched.has_work():
            sched.step()
        if any(g.finish_reason == "error" for g in gens):
            raise RuntimeError("a generation step failed")
        slots.clear()
        score, compared = teacher_forced(model, slots, prompts)
    except Exception as exc:  # noqa: BLE001
        return dict(passed=False, metric=METRIC, threshold=gate, **where,
                                reason=f"the engine fails on the golden prompts: {type(exc).__name__}: {exc}")
    finally:
        model.close()
        if gpu is not None:
            gpu.close()
    free, free_compared = agreement([g.generated for g in gens], prompts)
    reason = None
    if score < gate:
        reason = f"token agreement {score:.4f} over {compared} tokens is below the gate {gate}"
    elif settings.precision == "fp32" and free < gate:
        reason = (f"generating freely, batched, FP32 agrees with its own reference on {free:.4f} of {free_compared} "
                  f"tokens, below the gate {gate}: the serving path (slots, batching) departs from the graph")
    return dict(passed=reason is None, metric=METRIC, threshold=gate, score=score,
                primary_output="output_ids", samples=len(prompts), **where, reason=reason,
                free_running=free)
