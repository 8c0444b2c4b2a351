"""Structured outputs: a request's grammar (a JSON schema, any JSON object, a regex, a choice of strings, or a
Lark grammar) compiled once against the model's tokenizer, and a matcher per sequence whose token mask is applied
to that row's logits before sampling.

``grammar`` is the interface the rest of the backend sees: :class:`~.grammar.GuidedSpec` (what a request asked:
``sampling_parameters``' ``"guided"`` object, checked and canonical), :class:`~.grammar.Grammars` (the engine for
one tokenizer, with the compiled grammars cached by their canonical source), the per-sequence matcher and
:class:`~.grammar.StepMasks` (the masks of a step's guided rows computed on a worker thread while the batched step
runs when there are many, in place when few). One module per grammar engine behind it, chosen in ``engines``: ``llguidance_engine`` (the one served;
docs/generation.md has the measurement that chose it). The engine's view of the tokenizer is made at the first
request that asks for a grammar.
"""
