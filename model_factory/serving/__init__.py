"""Serving control: the Triton process, verify/accept-then-load at start, and the stub watch.

What runs inside Triton is not here: it is the backend (``model_factory.backend``), copied into each
model version and signed with it."""
