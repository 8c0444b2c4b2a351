"""The OpenAI API's error: the HTTP status, a message naming the problem, the parameter (shared by the frontend's
modules: ``openai_protocol``, ``openai_guided``, ``openai_tools``)."""

from __future__ import annotations

from typing import Any


class OpenAIError(Exception):
    """An OpenAI-style error: HTTP ``status``, a message naming the problem, the parameter if one."""

    def __init__(self, status: int, message: str, param: str | None = None, retry_after_s: float | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after_s = status, message, param, retry_after_s
        self.kind = kind or {400: "invalid_request_error", 404: "not_found_error", 503: "server_busy"}.get(
            status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}
