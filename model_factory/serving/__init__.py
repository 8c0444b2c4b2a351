"""Serving control: the Triton process, verify/accept-then-load at start, and the stub watch.

One module per concern (``server`` names their public parts): ``triton_process`` (find, start, load,
drain, stop ``tritonserver``), ``verified_start`` (verify, check on this machine, start), ``digests``
(the verified-digests table the backend checks its loads against), ``queue_bound`` (the queue bound
derived on the serving machine), ``acceptance`` (golden inputs through the engine here),
``metrics_scrape`` and ``supervise`` (the stub watch). Values pass between them; none is set on the
server object from outside.

What runs inside Triton is not here: it is the backend (``model_factory.backend``), copied into each
model version and signed with it."""
