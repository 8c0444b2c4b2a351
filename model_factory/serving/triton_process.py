"""Find, start, watch and stop a real ``tritonserver`` on a model repository.

The server is the ``tritonserver`` on ``PATH`` (NVIDIA's containers) or, when
there is none, the one bundled in the ``nvidia-pytriton`` wheel. Models are
loaded with explicit model control, so the caller decides which models load
(``serve`` loads only those that passed verification), and each load may carry
the configuration this deployment derived (``queue_bound``): the signed
``config.pbtxt`` stays as signed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from model_factory.build.repository import discover_models  # noqa: F401 - part of this module's API
from model_factory.errors import FactoryError

_SYSTEM_BACKENDS = Path("/opt/tritonserver/backends")
# Read by the Python backend (backends/python_backend/integrity.py).
VERIFIED_DIGESTS_ENV = "MODEL_FACTORY_VERIFIED_DIGESTS"
# Read by the Python backend (backends/python_backend/batching/cost_cache.py): where learned cost models are kept.
COST_CACHE_ENV = "MODEL_FACTORY_COST_CACHE"


def default_cost_cache() -> Path:
    """``$XDG_CACHE_HOME/model-factory/cost-models`` (``~/.cache/...`` when unset): outside any repository."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "model-factory" / "cost-models"


# Read by the Python backend (backends/python_backend/engines/loading.py): load only plans built on this GPU product.
GPU_PRODUCT_ENV = "MODEL_FACTORY_GPU_PRODUCT"
INT8_KERNELS_ENV = "MODEL_FACTORY_INT8_KERNELS"  # backends/python_backend/engines/cpu_features.py reads it
# Prefixes of the temporary folders a server owns (serving/work_folders.py): its work folder, and the verified
# digests serve hands to it (serving/verified_start.py).
WORK_PREFIX, VERIFIED_PREFIX = "model-factory-triton-", "model-factory-verified-"
RUNTIME_DIR_ENV = "MODEL_FACTORY_RUNTIME_DIR"  # backends/python_backend/batching/idle_cores.py keeps its ledger there

# The admin APIs closed to ordinary clients (--http-restricted-api / --grpc-restricted-protocol): only a
# caller that presents ADMIN_HEADER with the key may load, unload or list models, register shared
# memory, or change logging and tracing. Inference, health, metadata and statistics stay open.
RESTRICTED_APIS = ("model-repository", "shared-memory", "logging", "trace")
ADMIN_HEADER = "model-factory-admin-key"
# Over gRPC Triton expects the header under this prefix (Triton 2.51's grpc restricted protocol).
GRPC_ADMIN_HEADER = "triton-grpc-protocol-" + ADMIN_HEADER
ADMIN_KEY_ENV = "MODEL_FACTORY_ADMIN_KEY"


# Triton forwards headers matching this (RE2) as request parameters: the request id clients send, and the W3C
# trace context the backend's own tracing joins (backend/tracing.py).
FORWARDED_HEADER_PATTERN = "(?i)^(x-request-id|traceparent)$"


@dataclass(frozen=True)
class ServerOptions:
    """How to start the server. A port of 0 picks a free one."""

    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    log_verbose: int = 0
    startup_timeout_s: float = 180.0
    exit_timeout_s: int = 10
    host: str = "127.0.0.1"
    extra_args: tuple[str, ...] = ()
    # The GPU product this server runs on (the nvidia.com/gpu.product node label): the backend then
    # loads only TensorRT plans whose metadata says they were built on it. None: any plan.
    gpu_product: str | None = None
    # INT8 kernels on ONNX Runtime CPU (auto | integer | simulated; backend/cpu_features.py): None leaves
    # each model's int8_kernels parameter in force; acceptance replays the same choice.
    int8_kernels: str | None = None
    # The key of the restricted admin APIs: None generates one per run (held by this process only);
    # an operator's fleet passes its own (admin_key_from). restrict_admin=False opens them (tests only).
    admin_key: str | None = field(default=None, repr=False)
    restrict_admin: bool = True
    # Decision events (backend/events.py): the file they are appended to (None: Triton's log) and the rate
    # limit, events a second per instance (None: the backend's default).
    events_file: Path | None = None
    events_rate: float | None = None
    # OpenTelemetry: the OTLP/HTTP endpoint (host:port/v1/traces) spans are sent to (None: tracing off), the
    # sampling rate (one request in trace_rate) and who opens the request's span: "backend" (Triton's tracer
    # off: Triton 2.51's crashes the server under sustained traced load) or "triton" (backend/tracing.py).
    trace_endpoint: str | None = None
    trace_rate: int = 1
    trace_source: str = "backend"


def trace_arguments(endpoint: str | None, rate: int = 1, source: str = "backend") -> list[str]:
    """tritonserver's OpenTelemetry tracing flags: one request in ``rate`` sampled, spans sent to ``endpoint``
    (OTLP/HTTP, ``host:port/v1/traces``); none when ``endpoint`` is None or the backend is the trace source."""
    from model_factory.backend.operations.tracing import TRACE_SOURCES

    if source not in TRACE_SOURCES:
        raise FactoryError(f"trace source {source!r} is not one of {', '.join(TRACE_SOURCES)}. Fix: give backend "
                           "(the backend opens the request's span) or triton (Triton's tracer does)")
    if not endpoint:
        return []
    if int(rate) < 1:
        raise FactoryError(f"trace rate {rate} is not a sampling rate. Fix: give 1 (every request) or more "
                           "(one request in that many)")
    if source == "backend":
        return []
    return ["--trace-config=mode=opentelemetry", f"--trace-config=rate={int(rate)}", "--trace-config=level=TIMESTAMPS",
            "--trace-config=count=-1", f"--trace-config=opentelemetry,url={endpoint}",
            "--trace-config=opentelemetry,resource=service.name=model-factory-triton"]


def admin_key_from(key_file: Path | None = None, environ: dict[str, str] | None = None) -> str | None:
    """The operator's admin key: the first line of ``key_file``, else ``$MODEL_FACTORY_ADMIN_KEY``, else None.

    A key must be at least 16 printable characters without spaces, commas, colons or '=' (Triton reads
    it from its command line as ``<apis>:<header>=<key>``).
    """
    env = os.environ if environ is None else environ
    if key_file is not None:
        try:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise FactoryError(f"cannot read the admin key file {key_file} ({exc}). Fix: write the key on the "
                               "file's first line (e.g. python -c 'import secrets; print(secrets.token_hex(32))')"
                               ) from None
        key, source = (lines[0].strip() if lines else ""), f"admin key file {key_file}"
    elif env.get(ADMIN_KEY_ENV):
        key, source = env[ADMIN_KEY_ENV].strip(), f"${ADMIN_KEY_ENV}"
    else:
        return None
    if len(key) < 16 or not re.fullmatch(r"[A-Za-z0-9_.~+/-]+", key):
        raise FactoryError(f"the {source} is not a usable key (at least 16 characters of A-Z a-z 0-9 _ . ~ + / -). "
                           "Fix: generate one with python -c 'import secrets; print(secrets.token_hex(32))'")
    return key


@dataclass(frozen=True)
class TritonInstallation:
    """A ``tritonserver`` binary, its backend folder and the environment it needs."""

    binary: Path
    backend_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    bundled: bool = False


def free_port() -> int:
    """A TCP port that is free on loopback right now."""
    return free_ports(1)[0]


def free_ports(count: int, avoid: Sequence[int] = ()) -> list[int]:
    """``count`` distinct TCP ports free on loopback right now, none of them in ``avoid``.

    The sockets are held open together while the ports are read: asked for one at a time, the
    kernel may hand out the same port twice (seen in CI: Triton then refused to put HTTP and gRPC
    on one port).
    """
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            sock = socket.socket()
            held.append(sock)
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            if port not in avoid and port not in ports:
                ports.append(port)
    finally:
        for sock in held:
            sock.close()
    return ports


# Popen's process_group is Python 3.11's; on 3.10 the server gets a session of its own (autogroup: see start()).
_OWN_PROCESS_GROUP: dict[str, Any] = ({"process_group": 0} if sys.version_info >= (3, 11)
                                      else {"start_new_session": True})


def _bind_to_parent(parent_pid: int):
    """A ``preexec_fn``: the child gets SIGTERM when the process that started it dies, whatever kills it.

    Linux's PR_SET_PDEATHSIG; if the parent is already gone by the time the child runs this, the child
    exits at once (the signal would never come).
    """
    def preexec() -> None:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # not Linux: serve's own signal handling still stops the server
            return
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


def _in_main_thread() -> bool:
    # PR_SET_PDEATHSIG fires when the *thread* that forked exits: bind only to the main thread's lifetime.
    return threading.current_thread() is threading.main_thread()


# What tritonserver logs when a port it was given cannot be had (taken between our pick and its bind).
_PORT_TROUBLE = re.compile(r"already in use|same address and port|failed to bind|address in use", re.IGNORECASE)


def _python_env() -> dict[str, str]:
    # The Python-backend stub runs the first python3 on PATH: make it ours (numpy<2, onnxruntime,
    # tokenizers), whatever the shell had first.
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def find_tritonserver(work_dir: Path) -> TritonInstallation:
    """Locate ``tritonserver``: PATH first, else the nvidia-pytriton bundle (set up under ``work_dir``)."""
    on_path = shutil.which("tritonserver")
    if on_path:
        binary = Path(on_path).resolve()
        backends = binary.parent.parent / "backends"
        return TritonInstallation(binary, backends if backends.is_dir() else _SYSTEM_BACKENDS, _python_env())
    try:
        import pytriton  # noqa: F401  (only to find the bundled server)
    except ImportError as exc:
        raise FactoryError("no tritonserver on PATH and nvidia-pytriton is not installed. Fix: pip install "
                           "'model-factory[serve]', or run inside NVIDIA's Triton container") from exc
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    binary = root / "bin" / "tritonserver"
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not binary.is_file() or not stub.is_file():
        raise FactoryError(f"the nvidia-pytriton bundle lacks tritonserver or a Python {ver} stub ({root}). "
                           "Fix: reinstall nvidia-pytriton==0.7.0 on Python 3.8-3.13")
    # The bundled python backend expects its stub beside libtriton_python.so: assemble a backend folder.
    backend_dir = work_dir / "backends"
    py = backend_dir / "python"
    py.mkdir(parents=True, exist_ok=True)
    for src in (root / "backends" / "python" / "libtriton_python.so",
                root / "backends" / "python" / "triton_python_backend_utils.py", stub):
        dst = py / src.name
        if not dst.exists():
            shutil.copy2(src, dst)
    libs = Path(pytriton.__file__).resolve().parent.parent / "nvidia_pytriton.libs"
    env = _python_env()
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(libs), env.get("LD_LIBRARY_PATH", "")) if p)
    return TritonInstallation(binary, backend_dir, env, bundled=True)


class TritonServer:
    """A running ``tritonserver`` process; use as a context manager or call start()/stop()."""

    def __init__(self, repository: Path, models: Sequence[str] | None = None,
                 options: ServerOptions | None = None, log_file: Path | None = None,
                 env: dict[str, str] | None = None, queue_costs: Mapping[str, Sequence[float]] | None = None) -> None:
        """``queue_costs``: model -> cost model ``(a, b, c)`` measured on this machine, for the queue bound of
        a model packaged with ``queue_bound = auto`` (without one, the constants its configuration fixes, if
        any; else the signed bound stays). See :mod:`model_factory.serving.queue_bound`.
        """
        self.repository = Path(repository).resolve()
        if not self.repository.is_dir():
            raise FactoryError(f"model repository {self.repository} does not exist. Fix: run model-factory build first")
        self.models = list(models) if models is not None else discover_models(self.repository)
        opts = options or ServerOptions()
        self._requested = opts  # ports left at 0 are ours to pick (again, if one is taken before Triton binds)
        self.options = self._pick_ports(opts)
        from model_factory.serving.work_folders import make_owned, release, sweep_stale

        # Work folders of servers killed outright (SIGKILL: no finalizer ran) go first (serving/work_folders.py).
        self.swept = sweep_stale((WORK_PREFIX, VERIFIED_PREFIX))
        self._work, self._owner_fd = make_owned(WORK_PREFIX)
        # The work folder (a 3 MB copy of the Python backend, the default log, the served repository's copies)
        # lives as long as this object: the log stays readable after stop(), and nothing is left in the temp
        # folder once the object is gone. Its lock is held by this process and by each tritonserver it starts.
        weakref.finalize(self, release, self._work, self._owner_fd)
        self.log_file = Path(log_file) if log_file else self._work / "tritonserver.log"
        self.process: subprocess.Popen | None = None
        self._log: Any = None
        self.extra_env = {RUNTIME_DIR_ENV: str(self._work), **(env or {})}
        if opts.gpu_product:
            self.extra_env[GPU_PRODUCT_ENV] = opts.gpu_product
        if opts.int8_kernels:
            self.extra_env[INT8_KERNELS_ENV] = opts.int8_kernels
        if opts.events_file is not None:
            from model_factory.backend.operations.events import EVENTS_FILE_ENV

            self.extra_env[EVENTS_FILE_ENV] = str(Path(opts.events_file).resolve())
        if opts.trace_endpoint:
            from model_factory.backend.operations.tracing import TRACE_ENDPOINT_ENV, TRACE_RATE_ENV, TRACE_SOURCE_ENV

            self.extra_env[TRACE_ENDPOINT_ENV] = opts.trace_endpoint
            self.extra_env[TRACE_SOURCE_ENV] = opts.trace_source
            self.extra_env[TRACE_RATE_ENV] = str(int(opts.trace_rate))
        if opts.events_rate is not None:
            from model_factory.backend.operations.events import EVENTS_RATE_ENV

            self.extra_env[EVENTS_RATE_ENV] = str(float(opts.events_rate))
        self.work_dir = self._work
        # A second model repository, private to this server: candidates a rollout loads beside the served
        # versions (serving/rollout.py); and the folder where the backend's shadow mirrors keep their tallies.
        self.candidates_dir = self._work / "candidates"
        self.candidates_dir.mkdir()
        # The repository Triton reads: the served models' files linked from ``repository`` without their
        # signature files, brought in line at each load (serving/served_view.py: why a served version can then
        # stay loaded while a rollout loads the next one beside it).
        self.served_repository = self._work / "repository"
        self.served_repository.mkdir()
        (self._work / "shadow").mkdir()
        self.admin_key = (opts.admin_key or secrets.token_hex(32)) if opts.restrict_admin else None
        self.queue_costs = dict(queue_costs or {})
        # model -> the configuration (Triton JSON) each load of it carries: this deployment's queue bound.
        self.load_configs: dict[str, str] = {}
        self.load_errors: dict[str, str] = {}
        self.adapter_versions: dict[str, int] = {}  # LoRA adapter -> the version its base's loads serve (a rollout's)
        self._index_client: Any = None  # ready_versions' gRPC client, kept between the stub watch's polls

    @property
    def admin_headers(self) -> dict[str, str]:
        """HTTP headers that open the restricted admin APIs (empty when they are not restricted)."""
        return {ADMIN_HEADER: self.admin_key} if self.admin_key else {}

    @property
    def grpc_admin_headers(self) -> dict[str, str]:
        """gRPC metadata that opens the restricted admin protocols (empty when they are not restricted)."""
        return {GRPC_ADMIN_HEADER: self.admin_key} if self.admin_key else {}

    @staticmethod
    def _pick_ports(opts: ServerOptions) -> ServerOptions:
        given = [p for p in (opts.http_port, opts.grpc_port, opts.metrics_port) if p]
        auto = iter(free_ports(3 - len(given), avoid=given))
        return dataclasses.replace(opts, http_port=opts.http_port or next(auto),
                                   grpc_port=opts.grpc_port or next(auto), metrics_port=opts.metrics_port or next(auto))

    @property
    def http_url(self) -> str:
        return f"{self.options.host}:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.options.host}:{self.options.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.options.host}:{self.options.metrics_port}/metrics"

    def command(self, install: TritonInstallation) -> list[str]:
        """The tritonserver command line."""
        o = self.options
        cmd = [str(install.binary), f"--model-repository={self.served_repository}",
               f"--model-repository={self.candidates_dir}",
               f"--backend-directory={install.backend_dir}",
               f"--http-port={o.http_port}", f"--grpc-port={o.grpc_port}", f"--metrics-port={o.metrics_port}",
               f"--http-address={o.host}", f"--grpc-address={o.host}",
               "--model-control-mode=explicit", f"--exit-timeout-secs={o.exit_timeout_s}",
               f"--log-verbose={o.log_verbose}", "--strict-readiness=true", "--allow-metrics=true",
               # Our config.pbtxt is complete (written through the protobuf): without this flag the Python
               # backend starts one extra stub process per model load only to ask it to auto-complete
               # the config (~1 s of a 2 s start on 2 cores).
               "--disable-auto-complete-config",
               # A client's X-Request-ID and traceparent headers reach the backend as request parameters (its
               # events name the id; its spans join the trace).
               f"--http-header-forward-pattern={FORWARDED_HEADER_PATTERN}",
               f"--grpc-header-forward-pattern={FORWARDED_HEADER_PATTERN}"]
        if self.admin_key:
            apis = ",".join(RESTRICTED_APIS)
            cmd += [f"--http-restricted-api={apis}:{ADMIN_HEADER}={self.admin_key}",
                    f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={self.admin_key}"]
        cmd += trace_arguments(o.trace_endpoint, o.trace_rate, o.trace_source)
        # No --load-model: models are loaded one by one after start, so a model that fails to
        # load is reported with its reason instead of taking the whole server down.
        return cmd + list(o.extra_args)

    def start(self) -> "TritonServer":
        """Start the server and wait until it and every requested model are ready."""
        install = find_tritonserver(self._work)
        for attempt in (1, 2):
            self._log = self.log_file.open("wb")
            # Bound to this process from its first instruction: if we die (SIGKILL included, start-up
            # included) the server gets SIGTERM and shuts down, never left running as an orphan.
            # A process group of its own (stopped as one; a terminal's Ctrl-C reaches serve, which stops it in
            # order) but this process's session: Linux's autogroup scheduler (where sched_autogroup_enabled is 1)
            # shares the CPU between sessions as equals before any nice value counts, so with the server in a
            # session of its own serve's nice-19 work beside live traffic (a rollout's hashing, copying and
            # acceptance) ranked level with the whole server and took up to half the cores from it
            # (benchmarks/bench_session_share.py).
            self.process = subprocess.Popen(self.command(install), env={**install.env, **self.extra_env},
                                            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                            **_OWN_PROCESS_GROUP, pass_fds=(self._owner_fd,),
                                            preexec_fn=_bind_to_parent(os.getpid()) if _in_main_thread() else None)
            try:
                self._wait_ready()
                break
            except BaseException as exc:
                picked = (self._requested.http_port, self._requested.grpc_port, self._requested.metrics_port)
                retry = (isinstance(exc, FactoryError) and attempt == 1 and self.process.poll() is not None
                         and 0 in picked and _PORT_TROUBLE.search(self.log_tail()) is not None)
                self.stop()
                if not retry:
                    raise
                # Another process took a port we picked before tritonserver could bind it: pick again, once.
                self.options = self._pick_ports(self._requested)
        try:
            from model_factory.serving.queue_bound import load_configs

            self.load_configs = load_configs(self.repository, self.models, self.queue_costs)
            self.load_errors = {}
            for name in self.models:
                error = self.load_model(name)
                if error:
                    self.load_errors[name] = error
        except BaseException:
            self.stop()
            raise
        return self

    def load_model(self, name: str, timeout_s: float | None = None,
                   versions: Sequence[int] | None = None) -> str | None:
        """Ask the server to load (or reload) one model; return None when it is ready, else the reason.

        With a derived configuration for it (:attr:`load_configs`), the load carries that configuration
        (Triton's load API ``config`` parameter) instead of letting Triton read ``config.pbtxt``. ``timeout_s``:
        how long to wait for it (default: the start-up timeout). A model of :attr:`repository` is first brought
        in line in :attr:`served_repository` (its files as they are now). ``versions``: this load alone names
        these versions (its derived configuration's policy otherwise; the kept configuration is not changed):
        Triton keeps those already loaded as they are and unloads the others.
        """
        config = self.load_configs.get(name)
        loaded = self._config_dict(name)  # read once: its version policy and the precisions its loads read
        policy = None if loaded is None else loaded.get("version_policy")
        precisions = None if loaded is None else _read_precisions(loaded)
        if versions is not None:
            if config is None:
                return f"{name} has no derived configuration to load versions {list(versions)} with"
            policy = {"specific": {"versions": [int(v) for v in versions]}}
            config = json.dumps({**json.loads(config), "version_policy": policy})
        if name in self.models or (self.repository / name).is_dir():  # not a candidate (their own repository)
            from model_factory.serving.served_view import sync_adapter, sync_model

            from model_factory.backend.lora_contract import adapter_entries

            try:
                sync_model(self.repository, self.served_repository, name, policy, precisions)
                # Its LoRA adapters' entries beside it (the stub finds and verifies them there; Triton never loads
                # them): the version a rollout of the adapter set (adapter_versions), else the newest.
                for adapter, folder in adapter_entries(self.repository, name):
                    sync_adapter(self.repository, self.served_repository, adapter,
                                 self.adapter_versions.get(adapter, int(folder.name)))
            except FactoryError as exc:
                return str(exc)
        return self._repository_control("load", name, config, timeout_s)

    def _config_dict(self, name: str) -> dict | None:
        """``name``'s next load's configuration (Triton JSON): its derived one, else its ``config.pbtxt``."""
        if name in self.load_configs:
            return json.loads(self.load_configs[name])
        from google.protobuf import json_format

        from model_factory.build.repository import read_config

        try:
            return json_format.MessageToDict(read_config(self.repository / name), preserving_proto_field_name=True)
        except Exception:  # noqa: BLE001 - Triton itself reports an unreadable config.pbtxt at the load
            return None

    def unload_model(self, name: str) -> str | None:
        """Ask the server to unload one model; return None when done, else the reason."""
        return self._repository_control("unload", name)

    def _repository_control(self, action: str, name: str, config: str | None = None,
                            timeout_s: float | None = None) -> str | None:
        """Load or unload through gRPC, never HTTP: Triton 2.51's HTTP server runs a load inside the worker
        thread that received it, and every client connection served by that thread waits until the load ends
        (measured: 8 of 32 clients held 2.4-4.7 s per load under a rollout, benchmarks/bench_rollout.py). Its gRPC
        server runs repository control on a thread of its own."""
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            if action == "load":
                client.load_model(name, headers=self.grpc_admin_headers, config=config,
                                  client_timeout=timeout_s or self.options.startup_timeout_s)
            else:
                client.unload_model(name, headers=self.grpc_admin_headers,
                                    client_timeout=self.options.startup_timeout_s)
            return None
        except InferenceServerException as exc:
            return exc.message() or str(exc)
        finally:
            client.close()

    def drain(self, timeout_s: float | None = None) -> bool:
        """Stop taking requests and let those in flight finish: unload every served model and wait until
        none is left loaded (Triton unloads a model once its in-flight requests are answered; new ones are
        refused at once). Returns True when all drained within ``timeout_s`` (default: the exit timeout).

        Triton's own SIGTERM path waits first for every open HTTP connection (a keep-alive client that keeps
        sending keeps it waiting) and only then for in-flight requests, out of one exit timeout: draining
        first is what lets a rolling update lose nothing and still exit 0.
        """
        if self.process is None or self.process.poll() is not None:
            return True
        for name in self.ready_models:
            self.unload_model(name)
        deadline = time.monotonic() + (self.options.exit_timeout_s if timeout_s is None else timeout_s)
        while time.monotonic() < deadline:
            try:
                busy = [m for m in self.model_status() if m.get("state") in ("READY", "UNLOADING", "LOADING")]
            except (OSError, ValueError):
                return False
            if not busy:
                return True
            time.sleep(0.05)
        return False

    @property
    def ready_models(self) -> list[str]:
        """Requested models that loaded."""
        return [m for m in self.models if m not in self.load_errors]

    def _get(self, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
        url = f"http://{self.http_url}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:  # loopback only
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except (urllib.error.URLError, ConnectionError, TimeoutError, socket.timeout):
            return 0, b""

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.options.startup_timeout_s
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise FactoryError(f"tritonserver exited with code {self.process.returncode} while starting. "
                                   f"Its log ({self.log_file}) ends with:\n{self.log_tail()}")
            status, _ = self._get("/v2/health/ready")
            if status == 200:
                return
            # Short polls: the server is usually up within a few hundred ms, and every start (a scaled-out
            # replica, a healed stub) waits for it.
            time.sleep(0.02)
        raise FactoryError(f"tritonserver was not ready within {self.options.startup_timeout_s:.0f} s. "
                           f"Log tail:\n{self.log_tail()}")

    def model_status(self) -> list[dict]:
        """The repository index: name, version, state and reason of every model."""
        url = f"http://{self.http_url}/v2/repository/index"
        req = urllib.request.Request(url, data=b"{}", method="POST", headers=self.admin_headers)
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    def ready_versions(self) -> dict[str, set[str]]:
        """model -> its versions Triton reports READY (the repository index, through gRPC: an HTTP worker thread
        would hold its client connections if the index waited on a load)."""
        import tritonclient.grpc as grpcclient

        if self._index_client is None:
            self._index_client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            index = self._index_client.get_model_repository_index(headers=self.grpc_admin_headers, as_json=True,
                                                                  client_timeout=5)
        except Exception:
            self._close_index_client()  # a fresh one next time (the server may have restarted on other ports)
            raise
        out: dict[str, set[str]] = {}
        for m in index.get("models", []):
            if m.get("state") == "READY":
                out.setdefault(m["name"], set()).add(str(m.get("version", "")))
        return out

    def _close_index_client(self) -> None:
        if self._index_client is not None:
            self._index_client.close()
            self._index_client = None

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server log."""
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the server and wait; SIGKILL if it does not exit in time. Returns the exit code."""
        self._close_index_client()
        rc = None
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                rc = self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                rc = self.process.wait()
        elif self.process is not None:
            rc = self.process.returncode
        if self._log is not None:
            self._log.close()
        return rc

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _read_precisions(config: dict) -> frozenset[str] | None:
    """The precisions whose weight files a load of this configuration (Triton JSON) reads
    (``served_view.read_precisions``; None: every file)."""
    from model_factory.serving.served_view import read_precisions

    return read_precisions({k: str((v or {}).get("string_value", ""))
                            for k, v in (config.get("parameters") or {}).items()})
