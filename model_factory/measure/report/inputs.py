"""Section "inputs": the version's data contract (``contract.json``) and what texts over its limit got.

The contract is what a client relies on (``model_factory.build.data_contract``): the inputs and outputs with
their meaning, the limits (batch, sequence length) and the long-input policy, i.e. what a text over
``max_sequence_length`` gets by default (``refuse``, ``truncate`` or ``chunk``: ``docs/inputs.md``). Where the
report has a sweep of this version (``--bench``) run with the server's metrics URL, the texts the backend
truncated (and the tokens it cut) or chunked are summed from its counters over the measured runs; a sweep sent
as token ids was cut by the bench's own tokenizer before the server saw it, and the page says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from model_factory.measure.report.release import Release

POLICY_MEANING = {
    "refuse": "a text over the limit is answered 400, naming its length and the limit",
    "truncate": "a text over the limit is cut to it; the response's truncated_tokens says how many tokens were "
                "dropped and model_factory_truncated_tokens_total counts them",
    "chunk": "a text over the limit is split into overlapping windows whose embeddings are pooled into one",
}


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    dims: str
    meaning: str
    optional: bool


@dataclass(frozen=True)
class Truncations:
    """Texts over the limit during the sweep of this version, from the backend's counters."""

    send: str  # "text" or "ids" (the bench's tokenizer cut the texts: the server saw none over the limit)
    counted: bool  # the sweep read the counters (a metrics URL and a model-factory backend)
    truncated_texts: int
    truncated_tokens: int
    chunked_texts: int
    requests: int


@dataclass(frozen=True)
class Inputs:
    present: bool  # a contract could be read (contract.json, or derived from an older version's config)
    error: str | None
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    max_batch: int | None
    max_sequence_length: int | None
    long_inputs: str | None
    tokenizer_sha256: str | None
    golden_texts: int
    truncations: Truncations | None

    @property
    def policy_meaning(self) -> str:
        return POLICY_MEANING.get(self.long_inputs or "", "")


def _tensors(entries: Sequence[Mapping[str, Any]]) -> tuple[Tensor, ...]:
    return tuple(Tensor(str(t.get("name")), str(t.get("dtype")), "[" + ", ".join(str(d) for d in t.get("dims", []))
                        + "]", str(t.get("meaning") or ""), bool(t.get("optional"))) for t in entries)


def truncations(doc: Mapping[str, Any] | None) -> Truncations | None:
    """The sweep's truncation counts summed over its points (None without a sweep)."""
    if doc is None:
        return None
    points = list(doc.get("points") or ())
    counted = bool(points) and all(p.get("truncated_texts") is not None for p in points)

    def total(key: str) -> int:
        return int(sum(p.get(key) or 0 for p in points))

    return Truncations(send=str(doc.get("send")), counted=counted, truncated_texts=total("truncated_texts"),
                       truncated_tokens=total("truncated_tokens"), chunked_texts=total("chunked_texts"),
                       requests=int(sum(p.get("requests") or 0 for p in points)))


def collect(release: Release, sweep: Mapping[str, Any] | None = None) -> Inputs:
    """The section for one version; ``sweep`` is the bench sweep of this version, if the report has one."""
    from model_factory.build.data_contract import load_contract
    from model_factory.errors import FactoryError

    try:
        contract = load_contract(release.version_dir)
    except (FactoryError, OSError, ValueError) as exc:
        return Inputs(False, str(exc), (), (), None, None, None, None, 0, truncations(sweep))
    limits = contract.get("limits") or {}
    tok = contract.get("tokenizer") or {}
    return Inputs(True, None, _tensors(contract.get("inputs") or ()), _tensors(contract.get("outputs") or ()),
                  limits.get("max_batch"), limits.get("max_sequence_length"), limits.get("long_inputs"),
                  tok.get("sha256"), len(tok.get("golden") or ()), truncations(sweep))
