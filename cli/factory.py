"""Commands for the artifact pipeline and serving: export, package, build, serve, demo."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import click

from model_factory.cli.common import (debug_enabled, progress_printer, recipe_argument, recipe_overrides, repository_option,
                                      sandbox_mode, sandbox_options, user_errors)


@click.command()
@recipe_argument
@repository_option
@sandbox_options
@user_errors
def export(recipe: str, repository: str | None, require_sandbox: bool, no_sandbox: bool) -> None:
    """Export the recipe's model to ONNX and check it against the source framework.

    The source's code (a torch factory, a model's own modules) runs in a child process walled in as
    build's stages are (Landlock and seccomp: the source, the Python environment and the data read,
    only the work folder written, no network socket); --no-sandbox runs it unwalled.

    \b
    Example:
      model-factory export examples/minilm.toml
    """
    from model_factory.build.pipeline import run_stage
    from model_factory.build_engines.export import export_model
    from model_factory.recipe import load_recipe

    spec = load_recipe(recipe, recipe_overrides(repository))
    res = run_stage(spec, "export", export_model, spec, progress=progress_printer(),
                    sandbox=sandbox_mode(require_sandbox, no_sandbox))
    click.echo(f"wrote {res.onnx_path} (max abs error vs source {res.max_abs_error:.3g}, "
               f"tolerance {res.tolerance:g})")


@click.command()
@recipe_argument
@repository_option
@user_errors
def package(recipe: str, repository: str | None) -> None:
    """Lay out the Triton repository from the artifacts already built for RECIPE.

    \b
    Example:
      model-factory package examples/minilm.toml -r model_repository
    """
    from model_factory.build.pipeline import package_existing
    from model_factory.recipe import load_recipe
    from model_factory.recipe.prompt import is_prompt_recipe, parse_prompt_recipe, read_recipe_data

    data = read_recipe_data(recipe, recipe_overrides(repository))
    if is_prompt_recipe(data):  # a prompt template: laid out unsigned (model-factory sign, or build --key)
        from model_factory.build.prompt import package_prompt

        res = package_prompt(parse_prompt_recipe(data, Path(recipe).resolve().parent, Path(recipe).resolve()))
        click.echo(f"wrote {res.model_dir} (config.pbtxt, version {res.version_dir.name}, prompt template)")
        return
    res = package_existing(load_recipe(recipe, recipe_overrides(repository)), progress=progress_printer())
    click.echo(f"wrote {res.model_dir} (config.pbtxt, version {res.version_dir.name})")


@click.command()
@recipe_argument
@repository_option
@click.option("--key", type=click.Path(exists=True, dir_okay=False), help="Private key (PEM) to sign with.")
@click.option("--cert-chain", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Signing certificate, then intermediates (repeat). Omit for key mode.")
@click.option("--min-accuracy", type=float, default=None, help="Override quantization.min_accuracy.")
@click.option("--engines/--no-engines", default=None, help="Build TensorRT engines (default: the recipe's tensorrt.enabled).")
@sandbox_options
@user_errors
def build(recipe: str, repository: str | None, key: str | None, cert_chain: tuple[str, ...],
          min_accuracy: float | None, engines: bool | None, require_sandbox: bool, no_sandbox: bool) -> None:
    """Run export → quantize → build-engine → package (→ sign) for RECIPE.

    A prompt template's recipe (a [prompt] table on a [base] model of the repository) is packaged as its own
    version instead (prompt.json, signed with --key): docs/models.md, "A prompt template".
    A LoRA adapter's recipe (source.kind = "lora", [adapter] naming its packaged base) is checked against
    transformers + peft on the base's graph, gated on the held-out text and packaged as its own signed entry.

    Every source file is scanned before it is read (pickles refused unless [source] allow_pickle), and
    export, quantize and engine build run in child processes walled in by Landlock and seccomp: they read
    the source, the Python environment and the data, write only the work folder, and open no network
    socket. Where the kernel lacks these, the build says so in one line (--require-sandbox refuses).

    \b
    Example:
      model-factory build examples/minilm.toml --key keys/signing-key.pem
    """
    from model_factory.build.pipeline import build as run_build
    from model_factory.recipe import load_recipe
    from model_factory.recipe.prompt import is_prompt_recipe, parse_prompt_recipe, read_recipe_data

    mode = sandbox_mode(require_sandbox, no_sandbox)

    signer = None
    if key:
        from model_factory.signing import SignerConfig

        signer = SignerConfig(private_key=Path(key), password=None, certificate_chain=tuple(Path(c) for c in cert_chain))
    data = read_recipe_data(recipe, recipe_overrides(repository))
    if is_prompt_recipe(data):  # a prompt template: packaged (and signed), no stage to run
        from model_factory.build.prompt import build_prompt

        packaged = build_prompt(parse_prompt_recipe(data, Path(recipe).resolve().parent, Path(recipe).resolve()),
                                signer)
        click.echo(f"built {packaged.version_dir} (prompt template{', signed' if signer else ''})")
        return
    loaded = load_recipe(recipe, recipe_overrides(repository))
    if loaded.is_adapter:  # a LoRA adapter onto its packaged base (source.kind = "lora"): its own signed entry
        from model_factory.build.adapter import build_adapter

        built = build_adapter(loaded, signer=signer, progress=progress_printer(), isolate=True, sandbox=mode)
        click.echo(f"built {built.version_dir}" + (f"\nsigned: {built.signature}" if built.signature else ""))
        return
    res = run_build(loaded, progress=progress_printer(), signer=signer, min_accuracy=min_accuracy, engines=engines,
                    isolate=True, sandbox=mode)
    click.echo(f"built {res.version_dir}")
    for name in res.files:  # what the version folder holds, not what the stages made
        click.echo(f"  {name}")
    if res.signature:
        click.echo(f"signed: {res.signature}")


class _Interrupted(Exception):
    """SIGTERM or Ctrl-C arrived while the server was starting."""


@click.command()
@click.argument("repository", type=click.Path(file_okay=False))
@click.option("--policy", type=click.Path(exists=True, dir_okay=False), help="Trust policy to verify against.")
@click.option("--allow-unsigned", is_flag=True, help="Serve without verification (local experiments only).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0 in a container).")
@click.option("--http-port", default=8000, show_default=True, help="0 picks a free port.")
@click.option("--grpc-port", default=8001, show_default=True)
@click.option("--metrics-port", default=8002, show_default=True)
@click.option("--log-verbose", default=0, show_default=True, help="tritonserver --log-verbose level.")
@click.option("--gpu-product", metavar="LABEL",
              help="Load only TensorRT plans built on this GPU product (the nvidia.com/gpu.product node label, "
                   "e.g. NVIDIA-H100-80GB-HBM3); others fall back as if absent.")
@click.option("--int8-kernels", type=click.Choice(["auto", "integer", "integer-7bit", "simulated"]), default=None,
              help="INT8 on the CPU: ONNX Runtime's integer kernels (7-bit weights on a CPU without VNNI/AMX/dot "
                   "products, where 8-bit ones can saturate; integer-7bit: those everywhere), or Q/DQ simulated "
                   "in float. Default: each model's [repository] int8_kernels (auto).")
@click.option("--admin-key-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="File whose first line is the key of the restricted admin APIs (model repository, shared "
                   "memory, logging, trace), sent as header 'model-factory-admin-key'. Default: "
                   "$MODEL_FACTORY_ADMIN_KEY, else a key generated for this run and held by serve alone.")
@click.option("--watch-interval", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Seconds between checks of the backend stubs (a dead one is healed); 0: no watch.")
@click.option("--accept", "accept", is_flag=True,
              help="Also run each model's acceptance data through its engine here; refuse models below their gate.")
@click.option("--cost-cache", type=click.Path(file_okay=False), default=None, envvar="MODEL_FACTORY_COST_CACHE",
              help="Folder (outside the repository) where instances keep the cost-model constants they learned, "
                   "per engine and device, so a restart skips the warm-up, and the queue bound's measured cost, per "
                   "served version and machine, so a restart measures nothing. Default: "
                   "~/.cache/model-factory/cost-models.")
@click.option("--no-cost-cache", is_flag=True, help="Neither read nor write learned constants or measured costs (warm up and measure every start).")
@click.option("--events", "events_file", type=click.Path(dir_okay=False), default=None,
              help="Append decision events (JSON lines: windows grouped, inputs refused, long texts, splits, engine "
                   "fallbacks, stubs healed; request ids and input hashes, never input text) to this file. "
                   "Default: Triton's log.")
@click.option("--events-rate", type=click.FloatRange(min=0.1), default=None,
              help="Decision events a second per model instance at most (a burst of 5x that); the rest are "
                   "counted (model_factory_events_dropped_total). Default: 20.")
@click.option("--trace-endpoint", metavar="URL", default=None,
              help="Send OpenTelemetry traces over OTLP/HTTP to URL (e.g. 127.0.0.1:4318/v1/traces): the request's "
                   "span, and the backend's validate, tokenize, group, engine_run and respond under it.")
@click.option("--trace-rate", type=click.IntRange(min=1), default=1000, show_default=True,
              help="With --trace-endpoint: trace one request in this many (1: every request); a request whose "
                   "traceparent header is sampled is always traced (with --trace-source backend).")
@click.option("--trace-source", type=click.Choice(["backend", "triton"]), default="backend", show_default=True,
              help="Who opens the request's span. backend: the backend, under the client's W3C traceparent header "
                   "(Triton's tracer off). triton: Triton's OpenTelemetry tracer (its own spans too), which in "
                   "Triton 2.51 crashes the server after thousands of traced requests at 100+/s "
                   "(triton-inference-server/server#7795): keep --trace-rate high with it.")
@click.option("--allow-empty", is_flag=True,
              help="Keep serving when no model loads (models are loaded later through the admin API); by default "
                   "serve then exits 1.")
@click.option("--openai-port", type=click.IntRange(min=0), default=None,
              help="Also serve the OpenAI API on this port (0 picks a free one), stopped with the server: "
                   "/v1/completions and /v1/chat/completions for text-generation models, /v1/embeddings and "
                   "TEI's /embed for embedding models, TEI's /rerank and Cohere's /v1/rerank for rerankers, "
                   "TEI's /predict for classifiers, /v1/models.")
@click.option("--chat-template", "chat_templates", metavar="[MODEL=]FILE", multiple=True,
              help="With --openai-port: render /v1/chat/completions with this Jinja2 chat template instead of the "
                   "model's own (vLLM's --chat-template; for a base model without one, or to override it), in the same "
                   "sandbox. MODEL=FILE: that model (and its adapters); FILE alone: every text-generation model. "
                   "Its sha256 is printed at start; a prompt template on such a base is refused (it pins the base's "
                   "own template). Repeatable, one a model.")
@click.option("--control-port", type=click.IntRange(min=0), default=None,
              help="Also listen on 127.0.0.1:PORT for model-factory rollout (new versions verified, accepted, "
                   "mirrored in shadow and switched without a restart); needs --admin-key-file. 0 picks a port.")
@click.option("--watch", "watch_s", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Every SECONDS, look for a newly released version of a served model in the repository and roll it "
                   "out (as model-factory rollout does: verified, released, newer, accepted, shadowed, gated); "
                   "anything else is refused with the reason. SIGHUP looks at once. 0: only on SIGHUP.")
@user_errors
def serve(repository: str, policy: str | None, allow_unsigned: bool, host: str, http_port: int, grpc_port: int,
          metrics_port: int, log_verbose: int, gpu_product: str | None, int8_kernels: str | None,
          admin_key_file: str | None, watch_interval: float, accept: bool, cost_cache: str | None, no_cost_cache: bool,
          events_file: str | None, events_rate: float | None, trace_endpoint: str | None, trace_rate: int,
          trace_source: str, allow_empty: bool, openai_port: int | None, chat_templates: tuple[str, ...],
          control_port: int | None, watch_s: float) -> None:
    """Verify REPOSITORY, then serve its verified models on a real Triton server until Ctrl-C/SIGTERM.

    Only this process (and operators holding --admin-key-file) may load, unload or list models:
    ordinary clients get 403 / UNAVAILABLE from the admin APIs. A model whose backend stub dies
    is marked not ready, verified again and reloaded. SIGTERM stops taking new requests, lets
    those in flight finish and exits 0.

    \b
    Examples:
      model-factory serve --policy policy.toml model_repository
      model-factory serve --policy policy.toml --admin-key-file /run/secrets/admin-key model_repository
      model-factory serve --accept --policy policy.toml model_repository
      model-factory serve --events /var/log/model-factory/events.jsonl --policy policy.toml model_repository
      model-factory serve --trace-endpoint 127.0.0.1:4318/v1/traces --trace-rate 100 model_repository
      model-factory serve --policy policy.toml --openai-port 9000 model_repository
      model-factory serve --openai-port 9000 --chat-template gemma3-270m=gemma_turns.jinja model_repository
      model-factory serve --policy policy.toml --admin-key-file key --control-port 8003 model_repository
      model-factory serve --policy policy.toml --watch 60 model_repository
    """
    import functools

    from model_factory.serving.server import (ServerOptions, admin_key_from, default_cost_cache, reverify_model,
                                              start_verified_server)
    from model_factory.serving.supervise import StubWatch

    opts = ServerOptions(http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                         log_verbose=log_verbose, host=host, gpu_product=gpu_product or None,
                         int8_kernels=int8_kernels, events_file=Path(events_file) if events_file else None,
                         events_rate=events_rate, trace_endpoint=trace_endpoint or None, trace_rate=trace_rate,
                         trace_source=trace_source,
                         admin_key=admin_key_from(Path(admin_key_file) if admin_key_file else None))
    cache = None if no_cost_cache else Path(cost_cache) if cost_cache else default_cost_cache()
    if chat_templates and openai_port is None:
        from model_factory.errors import FactoryError

        raise FactoryError("--chat-template is used by the OpenAI frontend only. Fix: add --openai-port")
    templates = {}
    if chat_templates:  # read and parsed before the server starts: a bad file is refused at once
        from model_factory.serving.openai_chat_template import parse_chat_template_options

        templates = parse_chat_template_options(chat_templates)
    if control_port is not None and opts.admin_key is None:
        from model_factory.errors import FactoryError

        raise FactoryError("--control-port needs an admin key the operator holds. Fix: pass --admin-key-file "
                           "(or set $MODEL_FACTORY_ADMIN_KEY)")
    stop = threading.Event()
    loading = threading.Event()  # cleared once every load has ended: Triton answers requests from then on
    loading.set()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()
        if loading.is_set():  # unwinds start-up: TritonServer.start stops the server it began
            raise _Interrupted(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    look = threading.Event()  # SIGHUP: look for newly released versions now
    signal.signal(signal.SIGHUP, lambda _signum, _frame: look.set())
    try:
        server, report = start_verified_server(Path(repository), opts, Path(policy) if policy else None,
                                               allow_unsigned, accept=accept, cost_cache=cache,
                                               allow_empty=allow_empty, on_loaded=lambda _server: loading.clear())
    except _Interrupted as exc:
        raise click.ClickException(f"interrupted by signal {exc.args[0]} while starting; tritonserver stopped")
    if stop.is_set():
        # A signal after the loads: the models were ready (a readiness probe may have passed and routed requests),
        # so this is an ordinary stop, drained like one.
        click.echo("stopping: a signal arrived as start-up ended")
        _drain_and_stop(server)
        return
    click.echo(f"serving {', '.join(report.served) or 'no model yet (--allow-empty)'}")
    for name, where in report.engines.items():
        click.echo(f"  {name}: {where}")
    for name, note in report.notes.items():
        click.echo(f"note: {name}: {note}", err=True)
    for name, why in report.refused.items():
        click.echo(f"refused {name}: {why}", err=True)
        if debug_enabled() and name in report.load_details:
            click.echo(report.load_details[name], err=True)
    if server.swept:
        click.echo(f"note: removed {len(server.swept)} temporary folder(s) of servers killed earlier: "
                   + ", ".join(p.name for p in server.swept), err=True)
    click.echo(f"  HTTP    http://{server.http_url}\n  gRPC    {server.grpc_url}\n  metrics {server.metrics_url}")
    frontend = None
    if openai_port is not None:
        from model_factory.serving.encoder_models import encoder_models
        from model_factory.serving.openai_api import OpenAIFrontend, generative_models
        from model_factory.serving.openai_prompts import prompt_models

        from model_factory.serving.openai_chat_template import apply_chat_templates

        try:
            models, prompts, refused_prompts, overridden = apply_chat_templates(
                generative_models(Path(repository), report.served), prompt_models(Path(repository), report.served),
                templates)
            for name, line in overridden.items():
                click.echo(f"  {name}: {line}")
            for name, why in refused_prompts.items():
                click.echo(f"refused {name}: {why}", err=True)
            frontend = OpenAIFrontend(server.http_url, models, host, openai_port, metrics_url=server.metrics_url,
                                      encoders=encoder_models(Path(repository), report.served),
                                      prompts=prompts).start()
        except BaseException:
            server.stop()
            raise
        listed = [*frontend.models, *(f"{n} ({m.task})" for n, m in frontend.encoders.items()),
                  *(f"{n} (prompt on {p.base}{': ' + p.pinned if p.pinned else ''})"
                    for n, p in frontend.prompts.items())]
        click.echo(f"  OpenAI  {frontend.url}/v1 ({', '.join(listed) or 'no text-generation or encoder model'})")
    from model_factory.serving.rollout import RolloutControl

    # Rollouts (serve --control-port, --watch, SIGHUP): new versions verified, accepted, shadowed, switched.
    rollouts = RolloutControl(server, report.digests, report.served, gpu_product=gpu_product,
                              int8_kernels=int8_kernels, echo=lambda m: click.echo(m, err=True))
    control = None
    if control_port is not None:
        from model_factory.serving.control_api import ControlServer

        try:
            control = ControlServer(rollouts, server.admin_key, "127.0.0.1", control_port).start()
        except BaseException:
            if frontend is not None:
                frontend.stop()
            server.stop()
            raise
        click.echo(f"  control {control.url} (model-factory rollout)")
    if watch_s:
        click.echo(f"  watching {repository} for released versions every {watch_s:g} s (SIGHUP: at once)")
    click.echo("Ctrl-C to stop.")
    reverify = functools.partial(reverify_model, report.digests) if report.digests is not None else None
    events = None
    if events_file:
        from model_factory.backend.operations.events import EventLog

        events = EventLog("serve", path=str(Path(events_file).resolve()), rate=events_rate or 20.0)
    watch = StubWatch(server, report.served, watch_interval, echo=lambda m: click.echo(m, err=True),
                      reverify=reverify, events=events).start() if watch_interval > 0 else None
    next_look = time.monotonic() + watch_s if watch_s else float("inf")
    try:
        while not stop.wait(0.5):
            if server.process is not None and server.process.poll() is not None:
                raise click.ClickException(f"tritonserver exited with {server.process.returncode}:\n"
                                           f"{server.log_tail()}")
            if look.is_set() or time.monotonic() >= next_look:
                look.clear()
                next_look = time.monotonic() + watch_s if watch_s else float("inf")
                rollouts.scan()
    finally:
        if control is not None:
            control.stop()
        else:
            rollouts.close()
        if watch is not None:
            watch.stop()
        if frontend is not None:
            frontend.stop()
    _drain_and_stop(server)


def _drain_and_stop(server) -> None:
    """New requests refused, those in flight answered, then tritonserver stopped; its exit code checked."""
    if not server.drain():
        click.echo("requests were still in flight when the exit timeout expired", err=True)
    rc = server.stop()
    click.echo(f"tritonserver stopped (exit code {rc})")
    if rc != 0:
        raise click.ClickException(f"tritonserver exited with code {rc}:\n{server.log_tail(10)}")


@click.command()
@click.option("--workdir", type=click.Path(file_okay=False), default="model-factory-demo", show_default=True,
              help="Where the demo writes keys, the build and the repository.")
@user_errors
def demo(workdir: str) -> None:
    """Build the packaged MiniLM example, sign, verify, serve it and query it over HTTP and gRPC."""
    from model_factory.demo import run_demo

    run_demo(Path(workdir), progress=progress_printer(), echo=click.echo)


COMMANDS = [export, package, build, serve, demo]
