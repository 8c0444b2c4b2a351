"""Start Triton on a repository serving only what verified (and, asked to, passed acceptance) on this machine.

The steps, each its own module: verification against the trust policy (``model_factory.signing``), the
verified-digests table handed to the backend (:mod:`.digests`), checks in a child process on this
machine (acceptance, :mod:`.acceptance`; the engine's cost model for the queue bound, :mod:`.queue_bound`),
the Triton process (:mod:`.triton_process`), and one scrape of what the backends report
(:mod:`.metrics_scrape`). What one step hands the next is a value, returned, never set on the server.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from model_factory.errors import FactoryError
from model_factory.serving.digests import VerifiedDigests, verified_table, write_table
from model_factory.serving.metrics_scrape import engine_description, engine_info_from_metrics, serving_notes
from model_factory.serving.refusals import load_error_line
from model_factory.serving.triton_process import (COST_CACHE_ENV, VERIFIED_DIGESTS_ENV, VERIFIED_PREFIX, ServerOptions,
                                                  TritonServer, discover_models)
from model_factory.serving.work_folders import make_owned, release


@dataclass(frozen=True)
class ServeReport:
    """Which models were verified and loaded, why the others were refused, and where each one computes."""

    served: tuple[str, ...]
    refused: dict[str, str]
    # model -> "engine (file) on device", from acceptance or from the backend's metric labels
    engines: dict[str, str] = field(default_factory=dict)
    # What was verified, and against which policy (None without one): the stub watch re-verifies with it.
    digests: VerifiedDigests | None = None
    # model -> the cost model measured here for its queue bound (models whose bound is derived here)
    queue_costs: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    # model -> Triton's full load error (the backend's stack included), shown with --debug
    load_details: dict[str, str] = field(default_factory=dict)
    # model -> what the operator should know about how it computes here (INT8 simulated in float: FP32 is faster)
    notes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Verification:
    """The outcome of verifying a repository: the models to load, those refused, and the digests table."""

    to_load: tuple[str, ...]
    refused: dict[str, str]
    table: dict[str, dict[str, dict[str, str]]] | None
    policy: Any = None


@dataclass(frozen=True)
class MachineChecks:
    """What the child process found on this machine: models that passed, where they compute, their costs."""

    passed: tuple[str, ...]
    refused: dict[str, str]
    engines: dict[str, str]
    costs: dict[str, tuple[float, float, float]]


def verify(repository: Path, policy: Path | None, allow_unsigned: bool) -> Verification:
    """Verify every model of ``repository`` against ``policy`` (fail-closed without one unless allowed)."""
    models = discover_models(repository)
    if not models:
        raise FactoryError(f"{repository} holds no model folders with a config.pbtxt. Fix: run model-factory build")
    refused: dict[str, str] = {}
    if policy is None:
        if not allow_unsigned:
            raise FactoryError("refusing to serve without verification. Fix: pass --policy POLICY.toml "
                               "(see model-factory verify), or --allow-unsigned for a local experiment")
        return Verification(tuple(models), refused, None)
    from model_factory.signing import check_release, load_policy, verify_repository

    trust = load_policy(policy)
    # With [release] in the policy: a rolled-back, frozen or mixed repository is refused here too.
    results = check_release(repository, trust, verify_repository(repository, trust))
    for r in results:
        if not r.ok:
            refused[r.model] = "verification failed: " + "; ".join(r.reasons)
    verified = {r.model for r in results if r.ok}
    for m in models:
        if m not in verified and m not in refused:
            refused[m] = "verification failed: no verified version"
    to_load = tuple(m for m in models if m not in refused)
    if not to_load:
        raise FactoryError("no model passed verification:\n" + "\n".join(f"  {m}: {why}" for m, why in refused.items()))
    return Verification(to_load, refused, verified_table(repository, results, trust), trust)


def check_on_this_machine(repository: Path, models: tuple[str, ...], table: dict | None, *, accept: bool,
                          gpu_product: str | None, int8_kernels: str | None = None,
                          cost_cache: Path | None = None, yield_cores: bool = False) -> MachineChecks:
    """Acceptance (with ``accept``) and the queue-bound cost model of each model, in one child process.

    ``yield_cores`` (a rollout beside live traffic): the child runs acceptance at the lowest CPU priority
    (nice 19), after measuring any cost model at the normal one (a cost measured at nice 19 under load would
    overstate it). The child keeps that priority for any model after the first: a rollout checks one.

    The engines a child loads (GPU memory, a CUDA context, torch's cache) are gone before Triton loads
    the same models. A cost model measured before for the same engine on this machine (kept in
    ``cost_cache``, :func:`.queue_bound.cost_file`) is read instead of measured: without acceptance to run,
    such a start spawns no child at all.
    """
    import multiprocessing

    from model_factory.build.repository import read_config
    from model_factory.serving.acceptance import served_version
    from model_factory.serving.queue_bound import cached_cost, cost_file, needs_measuring, remember_cost

    refused: dict[str, str] = {}
    jobs = []
    known: dict[str, tuple[float, float, float]] = {}
    files: dict[str, Path | None] = {}
    for m in models:
        digests = None
        if table is not None:
            digests = table.get(m, {}).get(served_version(repository / m, read_config(repository / m)))
            if digests is None:
                if accept:
                    refused[m] = "acceptance failed: the served version was not verified"
                else:  # its load is refused by the backend, with the reason; nothing unverified is read here
                    jobs.append((str(repository / m), None, gpu_product, False, False, int8_kernels, False))
                continue
        measure = needs_measuring(repository / m)
        if measure:
            files[m] = cost_file(cost_cache, repository / m, digests, gpu_product, int8_kernels)
            cached = cached_cost(files[m])
            if cached is not None:
                known[m], measure = cached, False
        jobs.append((str(repository / m), digests, gpu_product, accept, measure, int8_kernels, yield_cores))
    todo = [j for j in jobs if j[3] or j[4]]
    verdicts = {}
    if todo:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            verdicts = dict(zip((j[0] for j in todo), pool.map(_check_one, todo)))
    passed, engines, costs = [], {}, dict(known)
    for path, *_ in jobs:
        m = Path(path).name
        ok, where, reason, cost = verdicts.get(path, (True, None, None, None))
        if cost is not None:
            costs[m] = cost
            remember_cost(files.get(m), cost, m)
        if ok:
            passed.append(m)
            if where:
                engines[m] = where
        else:
            refused[m] = f"acceptance failed on this machine ({where}): {reason}"
    return MachineChecks(tuple(passed), refused, engines, costs)


def _check_one(job: tuple[str, dict | None, str | None, bool, bool, str | None, bool]
               ) -> tuple[bool, str | None, str | None, Any]:
    """One model's verdict and cost model (run in the child process of :func:`check_on_this_machine`)."""
    from model_factory.backend.batching.idle_cores import yield_cores
    from model_factory.serving.acceptance import accept_model
    from model_factory.serving.queue_bound import measure_engine_cost

    path, digests, gpu_product, accept, measure, int8_kernels, lower_priority = job
    ok, where, reason, cost = True, None, None, None
    if measure and lower_priority:  # measured first, at the normal priority
        cost = measure_engine_cost(Path(path), digests, gpu_product, int8_kernels)
    if accept:
        if lower_priority:
            yield_cores()  # this child's one thread: it cannot be raised back, nor needs to be
        result = accept_model(Path(path), digests=digests, gpu_product=gpu_product, int8_kernels=int8_kernels)
        ok, where, reason = result.passed, result.where, result.reason
    if measure and ok and cost is None:
        cost = measure_engine_cost(Path(path), digests, gpu_product, int8_kernels)
    return ok, where, reason, cost if ok else None


def _served_contract(model_dir: Path) -> tuple[dict[str, str], str]:
    """The served config's string parameters and its instance kind (what the banner says a model runs on)."""
    from model_factory.build.repository import config_parameters, read_config

    try:
        config = read_config(model_dir)
    except FactoryError:
        return {}, "KIND_CPU"
    kinds = [type(g).Kind.Name(g.kind) for g in config.instance_group]
    return config_parameters(config), "KIND_GPU" if "KIND_GPU" in kinds else "KIND_CPU"


def _cost_cache_env(repository: Path, cost_cache: Path | None) -> dict[str, str]:
    if cost_cache is None:
        return {}
    cost_cache = Path(cost_cache).resolve()
    if cost_cache == repository.resolve() or repository.resolve() in cost_cache.parents:
        raise FactoryError(f"cost cache {cost_cache} is inside the repository, which is signed and read-only. "
                           "Fix: pass a folder outside it (--cost-cache)")
    return {COST_CACHE_ENV: str(cost_cache)}


def start_verified_server(repository: Path, options: ServerOptions, policy: Path | None,
                          allow_unsigned: bool = False, log_file: Path | None = None,
                          accept: bool = False, cost_cache: Path | None = None,
                          allow_empty: bool = False,
                          on_loaded: Callable[[TritonServer], None] | None = None) -> tuple[TritonServer, ServeReport]:
    """Verify the repository against ``policy``, then start Triton loading only verified models.

    Fail-closed: without a policy, nothing is served unless ``allow_unsigned``
    says so explicitly. A model that fails verification is refused with its
    reason; a model that fails to load is reported too. With ``accept``, each
    verified model must also pass acceptance on this machine (its golden inputs
    through the engine the backend would load, from the verified bytes:
    ``model_factory.serving.acceptance``) or it is refused like an unverified one. A model packaged with
    ``max_queue_size = "auto"`` gets its queue bound from its engine's cost model measured here
    (``model_factory.serving.queue_bound``). ``cost_cache``: a folder outside the repository where the
    backend keeps the cost-model constants it learned (per engine and device), so that a restart needs no
    warm-up, and where the queue bound's measured cost is kept (per served version and machine), so that a
    restart measures nothing. When no model loads, the server is stopped and FactoryError names every refusal, unless
    ``allow_empty`` keeps it up for later loads. ``on_loaded``: called with the server once every load has ended, before the report is
    gathered; from then on Triton answers requests (``serve`` stops taking a signal as an aborted start-up there).
    """
    repository = Path(repository)
    if not repository.is_dir():
        raise FactoryError(f"model repository {repository} does not exist. Fix: run model-factory build first")
    checked = verify(repository, policy, allow_unsigned)
    env = _cost_cache_env(repository, cost_cache)
    checks = check_on_this_machine(repository, checked.to_load, checked.table, accept=accept,
                                   gpu_product=options.gpu_product, int8_kernels=options.int8_kernels,
                                   cost_cache=cost_cache)
    refused = {**checked.refused, **checks.refused}
    # A prompt template runs only on the base files it was written for (its pinned digests): refused by name here.
    from model_factory.serving.openai_prompts import pin_problem

    refused.update({m: why for m in checks.passed if (why := pin_problem(repository, m))})
    checks = replace(checks, passed=tuple(m for m in checks.passed if m not in refused))
    if not checks.passed:
        raise FactoryError("no model passed verification and acceptance:\n"
                           + "\n".join(f"  {m}: {why}" for m, why in refused.items()))
    digests = None
    if checked.table is not None:
        # The verified digests go to a file outside the repository; the backend checks the bytes it
        # loads against them, so a file swapped after this verification is refused at load.
        # A folder owned through a lock, as the server's work folder is: one a killed serve left behind is removed
        # by the next server that starts (serving/work_folders.py).
        folder, owner_fd = make_owned(VERIFIED_PREFIX)
        path = folder / "verified-digests.json"
        try:
            write_table(path, checked.table)
        except BaseException:
            release(folder, owner_fd)
            raise
        digests = VerifiedDigests(repository, path, checked.policy)
        env[VERIFIED_DIGESTS_ENV] = str(path)
    try:
        server = TritonServer(repository, checks.passed, options, log_file=log_file, env=env, queue_costs=checks.costs)
    except BaseException:
        if digests is not None:
            release(folder, owner_fd)
        raise
    if digests is not None:
        # The digests live as long as the server object (a rollout rewrites them while it serves), as its work
        # folder does: nothing is left in the temporary folder once it is gone.
        weakref.finalize(server, release, folder, owner_fd)
    server.start()
    if on_loaded is not None:
        on_loaded(server)
    details = dict(server.load_errors)
    refused.update({m: f"failed to load: {load_error_line(why)}" for m, why in details.items()})
    served = tuple(server.ready_models)
    if not served and not allow_empty:
        server.stop()
        raise FactoryError("no model could be served:\n" + "\n".join(f"  {m}: {why}" for m, why in refused.items())
                           + "\nFix: correct the models above, or pass --allow-empty to keep the server up for "
                           "later loads")
    engines = dict(checks.engines)
    info = engine_info_from_metrics(server.metrics_url) if served else {}  # one scrape: engine, device, threads
    engines = {m: engines.get(m) or engine_description(info.get(m), *_served_contract(repository / m))
               for m in served}
    for m, labels in info.items():
        if m in engines and labels.get("threads"):
            borrow = labels.get("wide_threads", "0")
            engines[m] += (f", {labels['threads']} thread{'' if labels['threads'] == '1' else 's'} per instance"
                           + (f" ({borrow} for a lone request)" if borrow not in ("", "0") else ""))
    notes = serving_notes({m: labels for m, labels in info.items() if m in served})
    return server, ServeReport(served, refused, engines, digests, dict(checks.costs), details, notes)
