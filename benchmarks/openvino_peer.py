"""OpenVINO GenAI's continuous-batching pipeline, in-process: the peer ``bench_generate.py --peers openvino`` runs.

Runs inside its own venv (``openvino-genai``, ``optimum-intel``: ``/work/peers/install_openvino.sh``), never the
factory's. Reads the prompts ``bench_generate`` drew (token ids, one list per round and level), adds each level's
requests to one ``ContinuousBatchingPipeline`` at once and steps it until all are done; greedy (``--sampling``:
sampled with its temperature, top_k, top_p), exactly ``--output`` new tokens (``min_new_tokens`` =
``max_new_tokens``, ``ignore_eos``). Prints one JSON line per cell: output tokens/s over the wall time, the time to
first token of every request.

    python benchmarks/openvino_peer.py --model OV_DIR --prompts prompts.json --output 128 --threads 2

``--one-by-one`` (``bench_prefix_cache.py --served``): each cell's requests one after another instead, each added
when the one before it has ended (one client), with ``--prefix-caching`` the scheduler's ``enable_prefix_caching``
on; a cell's ``warm`` prompt (if any) runs first, untimed; each request's generated ids are printed too.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSON: [{'round': r, 'level': c, 'prompts': [[ids]...]}...]")
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-gb", type=int, default=2)
    ap.add_argument("--one-by-one", action="store_true", help="each request when the one before it has ended")
    ap.add_argument("--prefix-caching", action="store_true", help="SchedulerConfig.enable_prefix_caching")
    ap.add_argument("--sampling", default="", help="JSON {temperature, top_k, top_p}: sampled instead of greedy")
    args = ap.parse_args()
    cells = json.loads(open(args.prompts).read())
    sched = og.SchedulerConfig()
    sched.cache_size = args.cache_gb  # GB of KV cache
    sched.enable_prefix_caching = args.prefix_caching
    pipe = og.ContinuousBatchingPipeline(args.model, sched, "CPU", {"INFERENCE_NUM_THREADS": args.threads})
    config = og.GenerationConfig()
    config.max_new_tokens = config.min_new_tokens = args.output
    config.ignore_eos = True
    config.do_sample = False
    if args.sampling:
        sampling = json.loads(args.sampling)
        config.do_sample = True
        config.temperature = float(sampling["temperature"])
        if sampling.get("top_k"):
            config.top_k = int(sampling["top_k"])
        config.top_p = float(sampling.get("top_p", 1.0))
    warm = pipe.add_request(10**6, ov.Tensor(np.asarray([cells[0].get("warm") or cells[0]["prompts"][0]], np.int64)),
                            config)
    while pipe.has_non_finished_requests():
        pipe.step()
    del warm
    if args.one_by_one:
        one_by_one(pipe, config, cells)
        return
    rid = 0
    for cell in cells:
        start = time.perf_counter()
        handles, first, counts = [], {}, {}
        for ids in cell["prompts"]:
            handles.append((rid, pipe.add_request(rid, ov.Tensor(np.asarray([ids], np.int64)), config)))
            counts[rid] = 0
            rid += 1
        while pipe.has_non_finished_requests():
            pipe.step()
            now = time.perf_counter() - start
            for i, h in handles:
                if h.can_read():
                    got = sum(len(o.generated_ids) for o in h.read().values())
                    if got and i not in first:
                        first[i] = now
                    counts[i] += got
        for i, h in handles:  # what the last step made and no loop turn read
            while h.can_read():
                counts[i] += sum(len(o.generated_ids) for o in h.read().values())
        wall = time.perf_counter() - start
        print(json.dumps({"round": cell["round"], "level": cell["level"], "tokens": sum(counts.values()),
                          "counts": sorted(set(counts.values())), "wall": wall,
                          "ttft": [first.get(i, wall) for i, _h in handles]}), flush=True)


def one_by_one(pipe, config, cells: list[dict]) -> None:
    """Each cell's prompts one after another (one client): a request added when the one before it has ended; its
    TTFT from its add to the step whose output first holds a token; one JSON line per cell."""
    import numpy as np
    import openvino as ov

    rid = 0
    for cell in cells:
        start = time.perf_counter()
        ttft, counts, ids = [], [], []
        for prompt in cell["prompts"]:
            added = time.perf_counter()
            handle = pipe.add_request(rid, ov.Tensor(np.asarray([prompt], np.int64)), config)
            rid += 1
            got: list[int] = []
            first = None
            while pipe.has_non_finished_requests():
                pipe.step()
                while handle.can_read():
                    for out in handle.read().values():
                        got.extend(out.generated_ids)
                if got and first is None:
                    first = time.perf_counter() - added
            while handle.can_read():
                for out in handle.read().values():
                    got.extend(out.generated_ids)
            ttft.append(first if first is not None else time.perf_counter() - added)
            counts.append(len(got))
            ids.append(got)
        print(json.dumps({"round": cell["round"], "level": cell["level"], "tokens": sum(counts),
                          "counts": sorted(set(counts)), "wall": time.perf_counter() - start, "ttft": ttft,
                          "ids": ids}), flush=True)


if __name__ == "__main__":
    main()
