"""A server that dies leaves no stub behind. Triton 2.51's stubs outlived a tritonserver that crashed under load
(holding their models in memory, and a little CPU) until the backend's orphan watch ended them."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

pytestmark = pytest.mark.integration


def test_the_stubs_of_a_server_killed_under_load_exit(minilm_repository) -> None:
    import psutil
    import tritonclient.http as httpclient

    from model_factory.serving.server import ServerOptions, TritonServer

    server = TritonServer(minilm_repository, options=ServerOptions(0, 0, 0)).start()
    stop = threading.Event()

    def load() -> None:  # requests in flight when the server dies, as in a crash under traffic
        ids = np.random.default_rng(0).integers(1000, 20000, (1, 128)).astype(np.int64)
        with httpclient.InferenceServerClient(server.http_url, concurrency=4) as client:
            while not stop.is_set():
                inputs = [httpclient.InferInput("input_ids", [1, 128], "INT64"),
                          httpclient.InferInput("attention_mask", [1, 128], "INT64")]
                inputs[0].set_data_from_numpy(ids)
                inputs[1].set_data_from_numpy(np.ones_like(ids))
                try:
                    [client.async_infer("minilm", inputs) for _ in range(4)]
                    time.sleep(0.01)
                except Exception:  # noqa: BLE001 - the server is killed under it
                    time.sleep(0.05)

    clients = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    try:
        stubs = [p for p in psutil.Process(server.process.pid).children(recursive=True)
                 if "triton_python_backend_stub" in " ".join(p.cmdline())]
        assert stubs, "the model's instances run in stub processes"
        # The server and its stubs: a process group of their own (stopped as one), in the session of the process
        # that started them. Linux's autogroup scheduler shares the CPU between sessions as equals before a nice
        # value counts, so in a session of its own the server ranked level with serve's nice-19 work beside live
        # traffic (a rollout's hashing, copying and acceptance), which then took up to half the cores.
        for pid in [server.process.pid, *(s.pid for s in stubs)]:
            assert os.getpgid(pid) == server.process.pid
            assert os.getsid(pid) == os.getsid(0)
        for c in clients:
            c.start()
        time.sleep(3)
        server.process.send_signal(signal.SIGKILL)  # as a crash would: no shutdown, no message to the stubs
        server.process.wait(timeout=30)
        gone, alive = psutil.wait_procs(stubs, timeout=20)
        assert not alive, [p.pid for p in alive]
    finally:
        stop.set()
        server.stop()
