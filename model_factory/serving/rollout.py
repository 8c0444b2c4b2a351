"""Roll a served model to a new version inside a running ``serve``: verify, accept, shadow, gate, switch, undo.

The steps of :meth:`RolloutControl.start` (docs/operations.md has the runbook):

1. **Refusals, before anything loads** (one line each, :class:`~model_factory.errors.FactoryError`): the
   model is not served here; ``serve`` runs without a trust policy, or one without ``[release]``; the version
   is not newer than the serving one; it fails verification against the policy (unsigned, tampered, untrusted
   signer); it is not part of the trusted release, or below the model's trusted floor
   (:func:`~model_factory.signing.release_check.verify_release_files`: the rollback protection ``serve`` has).
2. **Candidate**: the version's verified files are linked (or copied) into ``serve``'s private candidates
   repository as ``<model>__candidate`` with a ``config.pbtxt`` derived from the signed one; its digests are
   added to the verified-digests table, so the backend checks every byte it loads against them.
3. **Acceptance** of the candidate on this machine (its golden data through the engine the backend would
   load, in a child process): a candidate that fails is refused, nothing loaded.
4. **Shadow**: the candidate is loaded beside the served version, and the control file of the backend's mirror
   (``backend/shadow.py``) turns mirroring on: a share of live requests is sent again to the candidate in the
   background, its answers scored against the served ones and never returned (a text-generation model's
   finished greedy or seeded requests, generated again by the candidate, loaded non-decoupled for it: token
   agreement; a prompt template, which generates nothing itself, is not mirrored: its acceptance is its gate).
5. **Gate**: once ``min_requests`` were mirrored, agreement (their mean score) at or above ``gate`` switches;
   below it, or a candidate error, or not enough traffic before ``timeout_s``, rolls back (the candidate
   unloaded, the served version untouched) and reports the worst cases by input hash.
6. **Switch**: the model is loaded again under its own name with its version policy set to the previous and
   the new version. Triton keeps the previous one loaded as it is (nothing it reads changed: see
   ``served_view.py``), loads the new one beside it and, once it is ready, sends it every request that names no
   version (Triton serves the highest ready version); requests in flight on the previous version finish there.
   The configuration is the new version's (derived from the ``config.pbtxt`` its packaging wrote); where it
   differs from the serving one in more than the version policy and the instance names, the previous version
   cannot stay (one Triton model, one configuration) and the switch names the new version alone
   (:func:`switch_plan`). The new instances load quietly: at the lowest CPU priority, their serving threads
   excepted (``backend/quiet_start.py``). Then the candidate is unloaded. The load's configuration is kept, so
   a healed stub (``supervise``) reloads what serves.
7. **Undo** (:meth:`RolloutControl.undo`) within ``grace_s``: the model's version policy set to the previous
   version alone, which is still loaded: Triton unloads the new one (its requests in flight finish) and loads
   nothing (where the switch could not keep it: loaded again with the configuration it served with). When the
   grace period ends the previous version is unloaded the same way (``grace_s`` 0: it is not kept at all, and
   there is no undo).

A rollout runs in a thread of ``serve``: a client (``model-factory rollout``) that goes away changes nothing. The
pieces it composes: ``rollout_plan`` (the request, its status, the switch's configurations), ``rollout_candidate``
(staging, acceptance, the candidate dropped) and ``rollout_mirror`` (the shadow and its agreement).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

from model_factory.backend.batching.idle_cores import yield_cores
from model_factory.backend.engines.quiet_start import run_quietly
from model_factory.errors import FactoryError
from model_factory.serving.adapter_rollout import (ServedAdapter, accept_adapter_version, check_adapter,
                                                   served_adapters, switch_adapter)
from model_factory.serving.rollout_candidate import (accept_candidate, candidate_name, drop_candidate, quiet_start,
                                                     stage_candidate)
from model_factory.serving.rollout_mirror import mirror_and_judge, shadow_dir, stop_mirroring
from model_factory.serving.rollout_plan import (CLEANUP_WAIT_S, FINAL, QUIET_LOAD_TIMEOUT_S, RolloutRequest,
                                                RolloutStatus, Switched, signed_config, switch_plan, version_config)


class RolloutControl:
    """Rollouts of the models one ``serve`` serves (one at a time per server).

    ``server``: the started :class:`~.triton_process.TritonServer`; ``digests``: the
    :class:`~.digests.VerifiedDigests` ``serve`` started with (None: no policy, every rollout refused);
    ``served``: the models it serves.
    """

    def __init__(self, server: Any, digests: Any, served: tuple[str, ...] | list[str], *,
                 gpu_product: str | None = None, int8_kernels: str | None = None,
                 echo: Callable[[str], None] | None = None, poll_s: float = 0.2) -> None:
        from model_factory.build.repository import read_config
        from model_factory.serving.acceptance import served_version

        self.server, self.digests = server, digests
        self.gpu_product, self.int8_kernels = gpu_product, int8_kernels
        self.echo = echo or (lambda _m: None)
        self.poll_s = poll_s
        repo = Path(server.repository)
        self.serving: dict[str, int] = {}
        for m in served:
            cfg = json.loads(server.load_configs[m]) if m in server.load_configs else None
            wanted = (cfg or {}).get("version_policy", {}).get("specific", {}).get("versions")
            self.serving[m] = int(max(int(v) for v in wanted)) if wanted else int(
                served_version(repo / m, read_config(repo / m)))
            if cfg is None:  # from now on its loads carry the configuration it serves with (a heal, an undo)
                server.load_configs[m] = json.dumps(version_config(signed_config(repo / m, self.serving[m]),
                                                                   self.serving[m]))
        self.statuses: dict[str, RolloutStatus] = {}
        self.switched: dict[str, Switched] = {}
        self._lock = threading.Lock()
        self._running: threading.Thread | None = None
        self._stop = threading.Event()
        self._tried: set[tuple[str, int]] = set()  # versions a scan started (not started again by a scan)
        self._refused: dict[tuple[str, int], str] = {}  # the last refusal said per version (said once)
        # One load of a served model at a time (a switch, an undo, a grace period's end), with what it records;
        # taken before _lock where both are.
        self._switch_lock = threading.RLock()
        self._timers: dict[str, threading.Timer] = {}  # model -> the end of its grace period
        # LoRA adapters the served bases' stubs found, rolled out by reloading their base (adapter_rollout.py): from
        # now on a base's loads serve the adapter versions set here (a heal, a base's own rollout).
        self.adapters: dict[str, ServedAdapter] = served_adapters(server, self.serving)
        for a in self.adapters.values():
            server.adapter_versions[a.name] = a.version
        self._reloads = 0  # the bases' reloads for their adapters (their instances named apart)

    @property
    def shadow_dir(self) -> Path:
        return shadow_dir(self.server)

    # ------------------------------------------------------------------ refusals (before anything loads)

    def check(self, req: RolloutRequest) -> dict[str, str]:
        """Refuse (FactoryError, one line) a rollout that must not start; return the version's verified digests."""
        from model_factory.signing import signed_digests
        from model_factory.signing.release import release_dir
        from model_factory.signing.release_check import verify_release_files

        m, v = req.model, req.version
        adapter = self.adapters.get(m)
        if m not in self.serving and adapter is None:
            served = sorted([*self.serving, *self.adapters])
            raise FactoryError(f"refused: {m} is not served here (serving: {', '.join(served) or 'none'}). Fix: roll "
                               "out a model or LoRA adapter this serve loaded")
        if self.digests is None or self.digests.policy is None:
            raise FactoryError("refused: this serve runs without a trust policy (--allow-unsigned), so nothing "
                               "can be verified. Fix: restart serve with --policy")
        policy = self.digests.policy
        if policy.release is None:
            raise FactoryError("refused: not released: the trust policy has no [release] section, so no version "
                               "can be shown to be released and newer. Fix: add [release] (docs/releases.md)")
        if adapter is not None:
            return check_adapter(self.server, self.digests, adapter, v, self.serving[adapter.base])
        if v <= self.serving[m]:
            raise FactoryError(f"refused: {m} version {v} is not newer than the serving version {self.serving[m]} "
                               "(rollback protection). Fix: within the grace period use rollout --undo; else "
                               "release the older model again under a higher version")
        model_dir = Path(self.server.repository) / m
        if not (model_dir / str(v)).is_dir():
            raise FactoryError(f"refused: {model_dir / str(v)} does not exist. Fix: build or pull version {v} "
                               "into the repository serve reads")
        try:
            digests = signed_digests(model_dir, v, policy)
        except FactoryError as exc:
            raise FactoryError(f"refused: {' '.join(str(exc).split())}") from None
        verdict = verify_release_files(release_dir(Path(self.server.repository)), model_dir, v, policy)
        if not verdict.ok:
            raise FactoryError(f"refused: not released: {' '.join(' '.join(verdict.all_problems()).split())}")
        if self._is_prompt(m):  # a prompt template runs only on the base bytes it pins, as at serve's start
            from model_factory.serving.openai_prompts import pin_problem

            problem = pin_problem(Path(self.server.repository), m, v, self.serving)
            if problem:
                raise FactoryError(f"refused: {problem}")
        return digests

    def _is_prompt(self, model: str) -> bool:
        from model_factory.backend.contract import PROMPT

        return (signed_config(Path(self.server.repository) / model).get("parameters", {}).get("task", {})
                .get("string_value") == PROMPT)

    # ------------------------------------------------------------------ the rollout

    def start(self, req: RolloutRequest) -> RolloutStatus:
        """Check ``req`` (refusals raise), then run the rollout in a thread; returns its first status."""
        with self._lock:
            self._await_cleanup()
            if self._running is not None and self._running.is_alive():
                busy = next((s for s in self.statuses.values() if s.state not in FINAL), None)
                raise FactoryError(f"refused: a rollout is in progress ({busy.model if busy else '?'} "
                                   f"{busy.state if busy else ''}). Fix: wait for it (rollout --status)")
            # Hashing the whole version beside live traffic: on a nice-19 thread (this one keeps its priority).
            digests, _ = run_quietly(lambda: self.check(req))
            adapter = self.adapters.get(req.model)
            # A prompt template answers nothing to compare (its base generates), an adapter runs in its base's
            # stubs: neither is mirrored, their acceptance is the gate.
            judged_by = "acceptance" if adapter is not None or self._is_prompt(req.model) else "mirror"
            status = RolloutStatus(uuid.uuid4().hex[:12], req.model, req.version,
                                   adapter.version if adapter is not None else self.serving[req.model],
                                   gate=req.gate, min_requests=req.min_requests, judged_by=judged_by)
            self.statuses[req.model] = status
            self._running = threading.Thread(target=self._run_adapter if adapter is not None else self._run,
                                             args=(req, status, digests), name="mf-rollout", daemon=True)
            self._running.start()
        return status

    def _await_cleanup(self, timeout_s: float = CLEANUP_WAIT_S) -> None:
        """Wait for a rollout whose outcome is already final (its status says so) to finish its cleanup: the
        candidate's unload and its files. Its thread outlives that status by the unload; a rollout started then
        is not refused for it."""
        if (self._running is not None and self._running.is_alive()
                and all(s.state in FINAL for s in self.statuses.values())):
            self._running.join(timeout=timeout_s)

    def _set(self, status: RolloutStatus, state: str, reason: str = "") -> None:
        status.state = state
        if reason:
            status.reason = reason
        self.echo(f"rollout {status.model} {status.serving} -> {status.version}: {state}"
                  + (f" ({reason})" if reason else ""))

    def _run(self, req: RolloutRequest, status: RolloutStatus, digests: dict[str, str]) -> None:
        cand = candidate_name(req.model)
        loaded = False
        yield_cores()  # this thread only: staging and hashing the candidate beside live traffic
        try:
            cand_dir = stage_candidate(self.server, self.digests, req.model, req.version,
                                       self.serving[req.model], digests)
            if req.accept:
                self._set(status, "accepting")
                accept_candidate(cand_dir, req.version, digests, gpu_product=self.gpu_product,
                                 int8_kernels=self.int8_kernels)
                if status.judged_by == "acceptance":
                    status.accepted = ("passed on this machine: its template filled with every field it reads, its "
                                       "schema compiled; its base pins match the base serving here")
            self._set(status, "loading")
            error = self.server.load_model(cand, timeout_s=QUIET_LOAD_TIMEOUT_S)
            loaded = True
            if error:
                from model_factory.serving.refusals import load_error_line

                raise FactoryError(f"the candidate did not load: {load_error_line(error)}")
            if status.judged_by == "mirror":
                self._set(status, "shadowing")
                if not mirror_and_judge(self.shadow_dir, req, status, stop=self._stop, poll_s=self.poll_s,
                                        set_state=self._set):
                    return
                stop_mirroring(self.shadow_dir, req.model)  # judged: more would only load the cores during the switch
            self._set(status, "switching")
            with self._switch_lock, quiet_start(self.shadow_dir, req.model):  # the new stubs load at nice 19
                serving_config = self.server.load_configs[req.model]
                new_config = self._derived_config(req.model, req.version)
                versions, kept = switch_plan(json.loads(serving_config), new_config, status.serving, req.version,
                                             req.grace_s)
                self._switch(req.model, versions, timeout_s=QUIET_LOAD_TIMEOUT_S, base=new_config)
                status.seconds_to_switch = time.time() - status.started
                self.switched.pop(req.model, None)  # an earlier rollout's grace period: its version was unloaded now
                until = time.time() + req.grace_s
                done = Switched(req.model, status.serving, req.version, until, kept, serving_config)
                if req.grace_s > 0:
                    self.switched[req.model] = done
                if kept:
                    self._end_grace_at(done)
            if req.grace_s <= 0:
                self._set(status, "switched", f"{req.model} serves version {req.version} (no grace period: version "
                          f"{status.serving} unloaded, no undo)")
                return
            if not kept:
                status.undo_until = until
                self._set(status, "switched", f"{req.model} serves version {req.version}; its configuration differs "
                          f"from version {status.serving}'s, so that one was unloaded: rollout --undo loads it again "
                          f"(until {time.strftime('%H:%M:%S', time.localtime(until))})")
                return
            status.undo_until = until
            self._set(status, "switched", f"{req.model} serves version {req.version}; version {status.serving} stays "
                      f"loaded for rollout --undo until {time.strftime('%H:%M:%S', time.localtime(until))}")
        except FactoryError as exc:
            self._set(status, "failed" if status.state in ("verifying", "accepting", "loading") else "rolled_back",
                      str(exc))
        except Exception as exc:  # noqa: BLE001 - reported to the operator; the served version is untouched
            self._set(status, "failed", f"{type(exc).__name__}: {exc}")
        finally:
            stop_mirroring(self.shadow_dir, req.model)
            if loaded:
                self.server.unload_model(cand)
            drop_candidate(self.server, self.digests, req.model)

    def _run_adapter(self, req: RolloutRequest, status: RolloutStatus, digests: dict[str, str]) -> None:
        """A LoRA adapter's rollout (``adapter_rollout.py``): accepted, then its base reloaded with it."""
        adapter = self.adapters[req.model]
        yield_cores()
        try:
            if req.accept:
                self._set(status, "accepting")
                status.accepted = accept_adapter_version(self.server, req.model, req.version, digests)
            self._set(status, "switching")
            with self._switch_lock, quiet_start(self.shadow_dir, adapter.base):
                self._reload_adapter(adapter, req.version, digests)
                status.seconds_to_switch = time.time() - status.started
                until = time.time() + req.grace_s
                self.switched.pop(req.model, None)
                if req.grace_s > 0:
                    self.switched[req.model] = Switched(req.model, adapter.version, req.version, until, kept=False)
            serves = f"adapter {req.model} version {req.version} serves on {adapter.base}"
            if req.grace_s <= 0:
                self._set(status, "switched", f"{serves} (no grace period: no undo)")
                return
            status.undo_until = until
            self._set(status, "switched", f"{serves}; rollout --undo serves version {adapter.version} again (until "
                      f"{time.strftime('%H:%M:%S', time.localtime(until))})")
        except FactoryError as exc:
            self._set(status, "failed" if status.state in ("verifying", "accepting") else "rolled_back", str(exc))
        except Exception as exc:  # noqa: BLE001 - reported to the operator; the base serves on as it was
            self._set(status, "failed", f"{type(exc).__name__}: {exc}")

    def _reload_adapter(self, adapter: ServedAdapter, version: int, digests: dict[str, str] | None) -> None:
        """The adapter's base loaded again serving ``version`` of it (the caller holds the switch lock)."""
        self._reloads += 1
        switch_adapter(self.server, self.digests, adapter, version, self.serving[adapter.base], digests,
                       f"r{self._reloads}", QUIET_LOAD_TIMEOUT_S)
        self.adapters[adapter.name] = replace(adapter, version=version)

    def _derived_config(self, model: str, version: int | None = None) -> dict[str, Any]:
        """The configuration a load of ``model`` at ``version`` would carry, derived from that version's own signed
        ``config.pbtxt`` (else the model's, as it is now) as ``serve`` derives it at the start."""
        from google.protobuf import json_format

        from model_factory.build.repository import read_version_config
        from model_factory.serving.queue_bound import derived_config

        config = read_version_config(Path(self.server.repository) / model, version)
        derived = derived_config(config, (getattr(self.server, "queue_costs", None) or {}).get(model))
        return derived if derived is not None else json_format.MessageToDict(config, preserving_proto_field_name=True)

    def _switch(self, model: str, versions: Sequence[int], timeout_s: float | None = None,
                base: dict[str, Any] | None = None) -> None:
        """Load ``model`` again set to ``versions`` (with ``base``'s configuration, else the one it serves with):
        a version already loaded stays as it is, one not loaded is loaded and one no longer named is unloaded (its
        requests in flight finish on it); requests that name no version go to the highest once it is ready. The
        configuration is kept for later loads (a healed stub)."""
        with self._switch_lock:
            if base is None:
                base = (json.loads(self.server.load_configs[model]) if model in self.server.load_configs
                        else signed_config(Path(self.server.repository) / model))
            previous = self.server.load_configs.get(model)
            self.server.load_configs[model] = json.dumps(version_config(base, versions))
            error = self.server.load_model(model, timeout_s=timeout_s)
            if error:
                from model_factory.serving.refusals import load_error_line

                if previous is None:
                    self.server.load_configs.pop(model, None)
                else:
                    self.server.load_configs[model] = previous
                raise FactoryError(f"the switch to version {max(versions)} did not load (the serving version "
                                   f"stays): {load_error_line(error)}")
            self.serving[model] = int(max(versions))

    def _end_grace_at(self, done: Switched) -> None:
        """At ``done.until``, unload the version kept for an undo (unless the switch was undone or followed by
        another one meanwhile)."""
        old = self._timers.pop(done.model, None)
        if old is not None:
            old.cancel()
        timer = threading.Timer(max(0.0, done.until - time.time()), self._end_grace, args=(done,))
        timer.daemon = True
        timer.name = f"mf-grace-{done.model}"
        self._timers[done.model] = timer
        timer.start()

    def _end_grace(self, done: Switched) -> None:
        with self._switch_lock:  # not while a switch or an undo of the model runs: it may have replaced ``done``
            with self._lock:
                if self.switched.get(done.model) is not done or self._stop.is_set():
                    return
                del self.switched[done.model]
            try:
                self._switch(done.model, [done.current])
            except FactoryError as exc:
                self.echo(f"rollout {done.model}: the grace period ended but version {done.previous} could not be "
                          f"unloaded: {exc}")
                return
        self.echo(f"rollout {done.model}: grace period over, version {done.previous} unloaded")

    def undo(self, model: str) -> RolloutStatus:
        """Switch ``model`` back to the version it served before its last rollout, within the grace period."""
        if not self._switch_lock.acquire(timeout=CLEANUP_WAIT_S):
            raise FactoryError("refused: a switch is in progress. Fix: wait for it (rollout --status)")
        try:
            return self._undo(model)
        finally:
            self._switch_lock.release()

    def _undo(self, model: str) -> RolloutStatus:
        with self._lock:
            self._await_cleanup()
            if self._running is not None and self._running.is_alive():
                raise FactoryError("refused: a rollout is in progress. Fix: wait for it (rollout --status)")
            done = self.switched.get(model)
            if done is None:
                raise FactoryError(f"refused: no rollout of {model} to undo. Fix: roll out a version first")
            if time.time() > done.until:
                raise FactoryError(f"refused: the grace period of {model}'s rollout to version {done.current} "
                                   "ended. Fix: release the older model again under a higher version and roll it out")
            status = self.statuses.get(model) or RolloutStatus("undo", model, done.previous, done.current)
            start = time.time()
            if model in self.adapters:  # its base loaded again with the previous version (its files still there)
                with quiet_start(self.shadow_dir, self.adapters[model].base):
                    self._reload_adapter(self.adapters[model], done.previous, None)
            elif done.kept:
                self._switch(model, [done.previous])  # still loaded: Triton only unloads the newer version
            else:  # unloaded at the switch (another configuration): loaded again with its own
                self._switch(model, [done.previous], base=json.loads(done.previous_config))
            del self.switched[model]
            timer = self._timers.pop(model, None)
            if timer is not None:
                timer.cancel()
            status = replace(status, state="undone", seconds_to_switch=time.time() - start, undo_until=None,
                             reason=f"{model} serves version {done.previous} again")
            self.statuses[model] = status
            self.echo(f"rollout {model}: undone, version {done.previous} serves again")
            return status

    def status(self, model: str) -> RolloutStatus | None:
        return self.statuses.get(model)

    def scan(self) -> list[str]:
        """``serve --watch`` and SIGHUP: one look at the repository. The highest version folder of a served model
        or of an adapter its bases serve above its serving version is rolled out (one rollout at a time; defaults
        of :class:`RolloutRequest`),
        through every check of :meth:`start`; a refusal is said once per reason (the same version is looked at
        again on each scan: a release added later lets it through), a version whose rollout ended is not tried
        again. Returns the lines said (also echoed)."""
        said: list[str] = []
        if self._running is not None and self._running.is_alive():
            return said
        repo = Path(self.server.repository)
        serving_now = {**self.serving, **{name: a.version for name, a in self.adapters.items()}}
        for m, serving in sorted(serving_now.items()):
            try:
                versions = sorted(int(p.name) for p in (repo / m).iterdir() if p.is_dir() and p.name.isdigit())
            except OSError:
                continue
            newer = [v for v in versions if v > serving and (m, v) not in self._tried]
            if not newer:
                continue
            v = newer[-1]
            try:
                self.start(RolloutRequest(m, v))
            except FactoryError as exc:
                line = f"watch: {m} version {v} not rolled out: {exc}"
                if self._refused.get((m, v)) != line:
                    self._refused[(m, v)] = line
                    said.append(line)
                continue
            self._tried.add((m, v))
            said.append(f"watch: rolling out {m} version {v} (serving {serving})")
            break
        for line in said:
            self.echo(line)
        return said

    def close(self) -> None:
        """Stop a rollout in progress (it rolls back: the served version is untouched)."""
        self._stop.set()
        for timer in self._timers.values():
            timer.cancel()
        if self._running is not None:
            self._running.join(timeout=60)
