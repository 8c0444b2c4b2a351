"""Text generation: continuous batching over a KV cache, tokens streamed.

``scheduler`` (admission by KV memory, prefill grouped by the cost model, one batched decode step, preemption,
cancellation), ``prefix_cache`` (prefix caching: block hashes of what running and kept slots hold), ``kv_slots``
(the KV account over a storage, kept prefixes included; in blocks when paged), ``kv_blocks`` (paged admission's guard:
each decoding sequence's next block, or a preemption), ``kv_device`` (its buffers in device memory
from the pool) and ``kv_pool`` (an INT8 cache on the factory's kernel as a pool of blocks with a table per slot:
``kv_layout = "blocks"``), ``causal_lm`` (one prefill/decode launch on ONNX Runtime), ``int8_attention`` (an INT8 KV
cache's attention on the factory's own ONNX Runtime operator, ``kernels/``), ``sampling``, ``detokenize``
(incremental text, stop strings), ``structured`` (structured outputs: a request's grammar, its
token masks applied before sampling), ``requests`` (the generate inputs read and checked), ``cancel_watch``
(``is_cancelled()`` asked off the engine loop), ``metrics`` (the generation families).

Imports: ``engines``, ``batching`` (the cost model), ``memory``, ``operations`` (metrics).
"""
