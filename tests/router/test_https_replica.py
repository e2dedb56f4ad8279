"""An https replica: generation requests (whole, 1 MB chunked, streamed with SSE split across reads) go through
aiohttp's client over TLS, whatever lean_client says (h1client speaks plain http only), and arrive whole.

The certificate is self-signed for 127.0.0.1, made by the openssl CLI. The router verifies replicas against the
system's trust store plus `replica_ca_file`: with the certificate there, everything passes; without it, the health
probe fails verification and no request reaches the replica; a file that holds no certificate is refused at start."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
from pathlib import Path

import pytest

from routewise_vllm.router.app import H1, REPLICAS
from tests.fakes.scripted_replica import ScriptedReplica, chunked, sized

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

MB = 1 << 20


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make a self-signed certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=30)
    return cert, key


def events(k: int) -> bytes:
    return b"".join(b'data: {"choices":[{"index":0,"text":" tok%d"}]}\n\n' % i for i in range(k)) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("lean_listener", [True, False], ids=["lean", "aiohttp"])
async def test_generation_through_an_https_replica(certificate, router_client, lean_listener):
    cert, key = certificate
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    small = json.dumps({"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "hi"}]}).encode()
    big = b'{"text": "' + b"y" * MB + b'"}'
    stream = events(5)
    replica = ScriptedReplica({
        "small": sized(200, small, [("Content-Type", "application/json")]),
        "big": chunked(200, [big[i:i + 65_000] for i in range(0, len(big), 65_000)], [("Content-Type", "application/json")]),
        "stream": chunked(200, [stream[:3], stream[3:70], stream[70:]], [("Content-Type", "text/event-stream")], pause=0.01),
    }, tls=server_ctx)
    url = await replica.start()
    assert url.startswith("https://")
    try:
        client = await router_client([url], lean_listener=lean_listener, lean_client=True, first_byte_timeout_s=10,
                                     replica_ca_file=cert)
        assert client.app[REPLICAS].ordered[0].routable  # its health probe passed over TLS
        got = {}
        for name in ("small", "big", "stream"):
            resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": name,
                                                              "stream": name == "stream"})
            got[name] = (resp.status, await resp.read())
    finally:
        await replica.stop()
    assert got == {"small": (200, small), "big": (200, big), "stream": (200, stream)}
    assert replica.requests == ["small", "big", "stream"]
    assert not client.app[H1]._pools  # h1client never saw an https replica


async def test_an_https_replica_whose_certificate_is_not_trusted_gets_no_request(certificate, router_client):
    cert, key = certificate
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    body = json.dumps({"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "hi"}]}).encode()
    replica = ScriptedReplica({"small": sized(200, body, [("Content-Type", "application/json")])}, tls=server_ctx)
    url = await replica.start()
    try:
        client = await router_client([url], first_byte_timeout_s=10, max_retries=0)
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "small"})
        status = resp.status
    finally:
        await replica.stop()
    assert not client.app[REPLICAS].ordered[0].routable  # the probe failed verification
    assert status >= 500 and replica.requests == []


async def test_a_replica_ca_file_without_a_certificate_is_refused_in_one_line(tmp_path):
    from routewise_vllm.router.settings import RouterSettings

    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=r"replica_ca_file='.*ca.pem': no PEM certificate read"):
        RouterSettings(replicas=["https://127.0.0.1:9"], replica_ca_file=bad)
    with pytest.raises(ValueError, match=r"replica_ca_file='.*missing.pem': No such file"):
        RouterSettings(replicas=["https://127.0.0.1:9"], replica_ca_file=tmp_path / "missing.pem")
