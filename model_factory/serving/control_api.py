"""``serve``'s control endpoint (``serve --control-port``): rollouts, on loopback, behind the admin key.

Every request must carry the admin key in the ``model-factory-admin-key`` header (the key of Triton's
restricted admin APIs, ``serve --admin-key-file``); without it: 403. JSON in and out:

- ``POST /v1/rollouts`` ``{"model", "version", "gate"?, "min_requests"?, "share"?, "timeout_s"?, "grace_s"?}``:
  202 and the rollout's status, or 409 ``{"error": one line}`` when it is refused before anything loads;
- ``GET /v1/rollouts/<model>``: the status of the model's latest rollout (404: none);
- ``POST /v1/rollouts/<model>/undo``: 200 and the status once the previous version serves again, or 409.

The library client is :func:`call`; ``model-factory rollout`` drives it. Standard library only (``http.server``).
"""

from __future__ import annotations

import hmac
import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from model_factory.errors import FactoryError
from model_factory.serving.rollout import RolloutControl
from model_factory.serving.rollout_plan import RolloutRequest
from model_factory.serving.triton_process import ADMIN_HEADER


class ControlServer:
    """The endpoint on its own thread: ``ControlServer(control, key, host, port).start()`` / ``stop()``."""

    def __init__(self, control: RolloutControl, admin_key: str, host: str = "127.0.0.1", port: int = 0) -> None:
        if not admin_key:
            raise FactoryError("the control endpoint needs an admin key. Fix: pass serve --admin-key-file (or set "
                               "$MODEL_FACTORY_ADMIN_KEY) and give the same key to model-factory rollout")
        self.control, self.key = control, admin_key
        handler = _handler(self)
        try:
            self.httpd = ThreadingHTTPServer((host, int(port)), handler)
        except OSError as exc:
            raise FactoryError(f"the control endpoint cannot listen on {host}:{port} ({exc}). Fix: pick a free "
                               "--control-port") from None
        self.httpd.daemon_threads = True
        self.host, self.port = host, self.httpd.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ControlServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="mf-control", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.control.close()


def _handler(server: ControlServer) -> type:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_args: Any) -> None:  # no access log on stderr
            pass

        def _reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _allowed(self) -> bool:
            given = self.headers.get(ADMIN_HEADER, "")
            if hmac.compare_digest(given.encode(), server.key.encode()):
                return True
            self._reply(403, {"error": f"the control endpoint needs the admin key in header {ADMIN_HEADER}"})
            return False

        def _parts(self) -> list[str]:
            return [p for p in self.path.split("?", 1)[0].split("/") if p]

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if not self._allowed():
                return
            parts = self._parts()
            if len(parts) == 3 and parts[:2] == ["v1", "rollouts"]:
                status = server.control.status(parts[2])
                if status is None:
                    self._reply(404, {"error": f"no rollout of {parts[2]}"})
                else:
                    self._reply(200, status.to_dict())
                return
            self._reply(404, {"error": "unknown path"})

        def do_POST(self) -> None:  # noqa: N802
            if not self._allowed():
                return
            parts = self._parts()
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}") if length else {}
                if parts == ["v1", "rollouts"]:
                    self._reply(202, server.control.start(RolloutRequest.from_dict(body)).to_dict())
                elif len(parts) == 4 and parts[:2] == ["v1", "rollouts"] and parts[3] == "undo":
                    self._reply(200, server.control.undo(parts[2]).to_dict())
                else:
                    self._reply(404, {"error": "unknown path"})
            except FactoryError as exc:
                self._reply(409, {"error": " ".join(str(exc).split())})
            except ValueError as exc:
                self._reply(400, {"error": f"the body is not JSON: {exc}"})
            except Exception as exc:  # noqa: BLE001 - a bug here: answered as one line, serve keeps serving
                self._reply(500, {"error": f"internal error: {type(exc).__name__}: {exc}"})

    return Handler


def call(url: str, key: str, method: str, path: str, body: dict | None = None, timeout: float = 120.0
         ) -> tuple[int, dict]:
    """One request to a control endpoint: ``(status, JSON body)``; FactoryError when it cannot be reached."""
    data = json.dumps(body).encode() if body is not None else (b"{}" if method == "POST" else None)
    req = urllib.request.Request(url.rstrip("/") + path, data=data, method=method,
                                 headers={ADMIN_HEADER: key, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {"error": f"HTTP {e.code}"}
    except (urllib.error.URLError, OSError) as exc:
        raise FactoryError(f"cannot reach serve's control endpoint {url} ({getattr(exc, 'reason', exc)}). Fix: "
                           "start serve with --control-port and pass its URL as --serve-url") from None
