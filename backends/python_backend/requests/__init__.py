"""What a request holds, decoded and checked before anything reaches an engine.

``items`` (one request's inputs into an ``Item``, per-request errors answered alone), ``input_bounds`` (the
allowed values of index-like inputs; the parameter's reader is in ``contract``), ``long_inputs`` (texts over
the limit: refused, truncated and said, or chunked), ``tokenizer`` (the version's tokenizer, read checked),
``samples`` (warm-up feeds within the bounds).

Imports: the package's ``contract``, ``settings`` and ``integrity``, nothing from the other rooms.
"""
