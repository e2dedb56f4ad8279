"""The admin API's bearer check against whatever bytes a client puts in Authorization, on a live router over
raw sockets: a wrong, odd or undecodable header is a 401 in the OpenAI error shape, never a 500."""

from __future__ import annotations

import json
import logging

import pytest

from tests.router.test_fuzz import assert_openai_error, raw_exchange, responses

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

TOKEN = "admin-token-\u00e9t\u00e9"  # non-ASCII on purpose: the header carries its UTF-8 bytes
GOOD = f"Bearer {TOKEN}".encode()


def get(path: str, *auth: bytes) -> bytes:
    lines = b"".join(b"Authorization: " + a + b"\r\n" for a in auth)
    return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + lines + b"Connection: close\r\n\r\n"


ODD = {
    "non-utf8-byte": b"Bearer \xff\xfe",
    "right-token-then-non-utf8": GOOD + b"\x80",
    "latin1-of-the-token": f"Bearer {TOKEN}".encode("latin-1"),
    "only-non-utf8": b"\xc3\x28\xa0\xa1",
    "empty": b"",
    "scheme-only": b"Bearer",
    "basic-scheme": b"Basic YWRtaW46YWRtaW4=",
    "overlong-utf8": b"Bearer \xc0\xaf\xe0\x80\xaf",
    "8k-of-0xff": b"Bearer " + b"\xff" * 8000,
}


@pytest.mark.parametrize("path", ["/admin/status", "/admin/policy", "/admin/replicas"])
@pytest.mark.parametrize("auth", list(ODD.values()), ids=list(ODD))
async def test_odd_authorization_is_a_401_in_the_openai_shape(fakes, router_client, caplog, auth, path):
    (a,) = await fakes(1)
    client = await router_client([a.url], admin_token=TOKEN)
    caplog.set_level(logging.ERROR)
    got = responses(await raw_exchange(client.port, get(path, auth)))
    assert len(got) == 1 and got[0][0] == 401, got
    err = assert_openai_error(*got[0])
    assert err["type"] == "authentication_error" and got[0][1].get("www-authenticate") == "Bearer"
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


async def test_two_authorization_headers_are_refused_whichever_comes_first(fakes, router_client):
    (a,) = await fakes(1)
    client = await router_client([a.url], admin_token=TOKEN)
    for pair in ((GOOD, b"Bearer wrong"), (b"Bearer wrong", GOOD), (GOOD, GOOD + b"\xff")):
        got = responses(await raw_exchange(client.port, get("/admin/status", *pair)))
        assert got[0][0] == 401, (pair, got)
        assert_openai_error(*got[0])


async def test_the_right_token_in_utf8_is_let_in(fakes, router_client):
    (a,) = await fakes(1)
    client = await router_client([a.url], admin_token=TOKEN)
    got = responses(await raw_exchange(client.port, get("/admin/status", GOOD)))
    assert got[0][0] == 200, got
    assert json.loads(got[0][2])["replicas"]["total"] == 1
