"""The encoders' batching: a window of requests split into groups by a cost model, and run.

``grouping`` (the cost model and the exact split), ``executor`` (groups padded and run, split-and-retry),
the online cost model (``cost_estimator`` refitted from real launches, ``adaptive_planner`` plans with it,
``cost_learning`` where it starts and what it saves, ``cost_cache`` kept outside the repository),
``idle_cores`` (a lone request borrows the other CPU instances' idle cores), ``deferred_responses`` (a
window's responses sent just after ``execute()`` returns).

Imports: ``requests`` and ``memory``.
"""
