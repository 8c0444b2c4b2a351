"""Plan each window with the cost model as it stands, compare, and explore a little.

:class:`AdaptivePlanner` wraps ``grouping.plan_groups`` for the executor:

- it plans with the *current* constants (fixed ones, or a
  ``cost_estimator.CostEstimator`` that refits from the timings the executor feeds
  back through :meth:`AdaptivePlanner.observe`);
- for every window it prices the chosen split against the alternatives it did not
  take under the same model — one padded group (split only at the limits) and one
  launch per sequence — so the metrics can show what the choice was worth;
- when the model is unsure (a constant's relative standard error above
  ``unsure``), it may run a split it has not timed: every ``explore_every``-th
  window, the best splits with the launch cost ``a`` two standard errors lower and
  higher (halved and doubled while its error is unknown) are priced; one
  whose groups include a launch shape live traffic has not timed yet, and that the
  current model prices within ``explore_margin`` of the best, is run instead. The
  modelled extra time of all explorations stays under ``explore_share`` of the
  modelled time of everything planned, so exploring cannot make a regime slower
  by more than that share, as far as the model can tell, and it stops when the
  model is sure;
- after each refit it re-plans the last few windows with the new constants and
  counts those whose split changed (``plan_changes``).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from .cost_estimator import CostEstimator
from .grouping import CostModel, ProfileCostModel, plan_cost, plan_groups

Model = CostModel | ProfileCostModel


@dataclass(frozen=True)
class PlanReport:
    """Modelled seconds of one window's split and of the alternatives, under the model it was planned with."""

    chosen: float = 0.0  # the split that ran
    best: float = 0.0  # the least-cost split (the chosen one unless this window explored)
    one_group: float = 0.0  # one group padded to the longest, split only at the limits
    singles: float = 0.0  # one launch per sequence
    explored: bool = False

    @staticmethod
    def total(reports: Sequence["PlanReport"]) -> "PlanReport":
        """The reports of a window's parts (its shape partitions) added up."""
        return PlanReport(sum(r.chosen for r in reports), sum(r.best for r in reports),
                          sum(r.one_group for r in reports), sum(r.singles for r in reports),
                          any(r.explored for r in reports))


def _shifted_a(model: Model, uncertainty: Sequence, sign: int, spread: float = 2.0) -> Model:
    """``model`` with each launch cost ``a`` moved by ``spread`` standard errors (doubled or halved when unknown)."""
    def one(m: CostModel, u) -> CostModel:
        se = getattr(u, "a", float("inf"))
        if math.isfinite(se) and se > 0:
            a = max(0.0, m.a + sign * spread * se)
        else:
            a = m.a * (2.0 if sign > 0 else 0.5)
        return dataclasses.replace(m, a=a)

    if isinstance(model, ProfileCostModel):
        return ProfileCostModel(model.buckets, tuple(one(m, u) for m, u in zip(model.models, uncertainty)))
    return one(model, uncertainty[0])


def _shape(groups: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(sorted(g)) for g in groups)


class AdaptivePlanner:
    """Splits windows for one engine (see the module docstring)."""

    def __init__(self, cost: Model | CostEstimator, *, max_batch: int, max_tokens: int | None = None,
                 mode: str = "cost_model", explore_share: float = 0.02, explore_margin: float = 0.15,
                 explore_every: int = 4, unsure: float = 0.10, recent: int = 4) -> None:
        self.estimator = cost if isinstance(cost, CostEstimator) else None
        self._fixed = None if self.estimator is not None else cost
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self.mode = mode
        self.explore_share = explore_share
        self.explore_margin = explore_margin
        self.explore_every = max(1, int(explore_every))
        self.unsure = unsure
        self._windows = 0
        self._planned = 0.0  # modelled seconds of every best split so far
        self._explored = 0.0  # modelled seconds explorations cost above the best
        self._recent: deque = deque(maxlen=max(0, int(recent)))  # (lengths, shape of the best split)
        self.explorations = 0
        self.plan_changes = 0

    @property
    def model(self) -> Model:
        """The constants plans are made with now."""
        return self.estimator.model if self.estimator is not None else self._fixed

    @property
    def learning(self) -> bool:
        return self.estimator is not None

    def _plan(self, lengths: Sequence[int], model: Model, mode: str | None = None) -> list[list[int]]:
        return plan_groups(lengths, model, self.max_batch, self.max_tokens, mode or self.mode)

    def plan(self, lengths: Sequence[int], mode: str | None = None) -> tuple[list[list[int]], PlanReport]:
        """The split to run for ``lengths`` and its report (``mode``: this window's, else the planner's)."""
        if not lengths:
            return [], PlanReport()
        model = self.model
        mode = mode or self.mode
        groups = self._plan(lengths, model, mode)
        if mode != "cost_model":
            cost = plan_cost(groups, lengths, model)
            return groups, PlanReport(cost, cost, cost if mode == "pad_to_longest" else 0.0,
                                      cost if mode == "none" else 0.0)
        best = plan_cost(groups, lengths, model)
        one = plan_cost(self._plan(lengths, model, "pad_to_longest"), lengths, model)
        singles = sum(model.cost(1, int(x)) for x in lengths)
        self._windows += 1
        self._planned += best
        if self._recent.maxlen:
            self._recent.append((list(lengths), _shape(groups)))
        explored = self._explore(lengths, model, best)
        if explored is not None:
            chosen_groups, chosen = explored
            return chosen_groups, PlanReport(chosen, best, one, singles, True)
        return groups, PlanReport(best, best, one, singles, False)

    def _explore(self, lengths: Sequence[int], model: Model, best: float) -> tuple[list[list[int]], float] | None:
        est = self.estimator
        if est is None or len(lengths) < 2 or self._windows % self.explore_every:
            return None
        if est.relative_uncertainty() <= self.unsure:
            return None
        room = self.explore_share * self._planned - self._explored
        if room <= 0:
            return None
        for sign in (-1, 1):  # launches cheaper than thought (more groups), then dearer (fewer)
            groups = self._plan(lengths, _shifted_a(model, est.uncertainty, sign))
            cost = plan_cost(groups, lengths, model)
            extra = cost - best
            if extra <= 0 or extra > self.explore_margin * best or extra > room:
                continue
            if all(est.timed(len(g), max(int(lengths[i]) for i in g)) for g in groups):
                continue  # nothing new to learn from this split
            self._explored += extra
            self.explorations += 1
            return groups, cost
        return None

    def observe(self, n: int, length: int, seconds: float) -> bool:
        """Feed one launch's timing to the estimator; on a refit, count the recent plans it changes."""
        if self.estimator is None:
            return False
        before = self.estimator.model
        if not self.estimator.observe(n, length, seconds):
            return False
        after = self.estimator.model
        if after != before and self.mode == "cost_model":
            replanned = [(ls, _shape(self._plan(ls, after))) for ls, _ in self._recent]
            self.plan_changes += sum(new != old for (_, new), (_, old) in zip(replanned, self._recent))
            self._recent = deque(replanned, maxlen=self._recent.maxlen)
        return True
