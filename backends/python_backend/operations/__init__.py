"""Running the model in production, around the request path.

``metrics`` (Prometheus families on Triton's metrics port), ``events`` (rate-limited decision events, request
ids, input hashes) and ``decisions`` (what a window decided, as events), ``tracing`` (OpenTelemetry spans),
``shadow`` (a rollout's candidate fed a share of answered requests), ``degrade`` (a backlogged window on a
cheaper precision that passed its gate), ``sandbox`` (Landlock and seccomp walls a stub raises after its
load; the build's stages use the same walls), ``orphan_watch`` (a stub whose server died is ended).

Imports: ``engines``, ``batching``, ``requests``, ``memory``; never ``generation``.
"""
