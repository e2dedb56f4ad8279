"""A replica that writes exact bytes: each generation request's `prompt` names a script, a list of steps (bytes
to write, a pause, or the connection's end), so tests control framing, chunk boundaries, header spelling and
where the answer is cut. It also answers what the router asks of any replica: GET /health, /v1/models, /metrics.
Raw asyncio streams on loopback (TLS when given an ssl context); stopped by `stop`."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Sequence

from tests.fakes.fake_vllm import FakeVllm

CLOSE = object()  # a step: close the connection here


class Pause(float):
    """A step: wait this many seconds (the bytes before it arrive as a read of their own)."""


Step = bytes | Pause | object


def head(status: int, headers: Sequence[tuple[str, str | int]] = (), reason: str = "X") -> bytes:
    return (f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n").encode()


def sized(status: int, body: bytes, headers: Sequence[tuple[str, str | int]] = ()) -> list[Step]:
    return [head(status, [*headers, ("Content-Length", len(body))]) + body]


def chunked(status: int, pieces: Sequence[bytes], headers: Sequence[tuple[str, str | int]] = (),
            pause: float = 0.0) -> list[Step]:
    """Each piece a chunk of its own, written (with `pause` after it) as a read of its own."""
    steps: list[Step] = [head(status, [*headers, ("Transfer-Encoding", "chunked")])]
    for p in pieces:
        steps.append(b"%x\r\n%s\r\n" % (len(p), p))
        if pause:
            steps.append(Pause(pause))
    steps.append(b"0\r\n\r\n")
    return steps


def until_close(status: int, body: bytes, headers: Sequence[tuple[str, str | int]] = ()) -> list[Step]:
    return [head(status, [*headers, ("Connection", "close")]) + body, CLOSE]


class ScriptedReplica:
    def __init__(self, scripts: dict[str, list[Step]], model: str = "tiny", tls: ssl.SSLContext | None = None) -> None:
        self.scripts = scripts
        self.model = model
        self.tls = tls
        self.requests: list[str] = []  # the scripts asked for, in order
        self.connections = 0
        self.drops = 0  # connections the router dropped while an answer was being written
        self.url = ""
        self._server: asyncio.Server | None = None
        self._metrics = FakeVllm(model).metrics_text().encode()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                raw = await reader.readuntil(b"\r\n\r\n")
                lines = raw.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                body = await reader.readexactly(length) if length else b""
                if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                    name = json.loads(body)["prompt" if path == "/v1/completions" else "messages"]
                    name = name if isinstance(name, str) else name[0]["content"]
                    self.requests.append(name)
                    steps = self.scripts[name]
                elif path == "/v1/models":
                    steps = sized(200, json.dumps({"object": "list", "data": [{"id": self.model, "object": "model"}]})
                                  .encode(), [("Content-Type", "application/json")])
                elif path == "/metrics":
                    steps = sized(200, self._metrics, [("Content-Type", "text/plain")])
                else:  # /health and anything else
                    steps = sized(200, b"")
                for step in steps:
                    if step is CLOSE:
                        return
                    if isinstance(step, Pause):
                        await writer.drain()
                        await asyncio.sleep(step)
                    else:
                        writer.write(step)  # type: ignore[arg-type]
                await writer.drain()
        except ConnectionError:
            self.drops += 1
        except (asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            writer.close()
