"""OpenAI-style error responses: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json

from aiohttp import web


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


def error_response(
    status: int, message: str, type_: str | None = None, param: str | None = None, code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    if type_ is None:
        type_ = "invalid_request_error" if status < 500 else "server_error"
    return web.Response(
        status=status, body=error_body(message, type_, param, code), content_type="application/json", headers=headers
    )


def sse_error_event(message: str, code: str = "upstream_error") -> bytes:
    """An SSE event the OpenAI clients turn into an APIError, sent when a stream breaks after its first byte."""
    return b"data: " + error_body(message, "server_error", None, code) + b"\n\n"


class BadRequest(Exception):
    """Client input the router rejects with a 4xx before contacting any replica."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code

    def response(self) -> web.Response:
        return error_response(self.status, self.message, "invalid_request_error", self.param, self.code)
