"""Values from replicas, clients and Redis are escaped and cut in log lines: a newline, a carriage return or an
escape sequence in one cannot forge a log line or rewrite a terminal, and a long one cannot fill a screen."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from routewise_vllm.router.scale.fleet_view import ROUTERS_KEY, FleetSync, FleetViewConfig, load_key
from routewise_vllm.router.logsafe import MAX_CHARS, safe, safe_exc
from routewise_vllm.router.policy.remote_load import RemoteLoad
from routewise_vllm.router.policy.tracking import ClusterTracker
from tests.fakes.redis_server import redis_server

FORGED = "llama\n2026-01-01 00:00:00 ERROR router: forged line\r\x1b[2J\x1b]0;title\x07"


def one_line(text: str) -> bool:
    return not any(c in text for c in "\n\r\x1b\x00\x07\u2028\u2029\x85")


def test_control_and_format_characters_are_escaped_as_repr_would():
    out = safe(FORGED)
    assert one_line(out)
    assert out == "llama\\n2026-01-01 00:00:00 ERROR router: forged line\\r\\x1b[2J\\x1b]0;title\\x07"
    assert safe("a\x00b\u2028c\u202ed\\e\tf") == "a\\x00b\\u2028c\\u202ed\\\\e\\tf"  # bidi override, backslash too
    assert safe("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"  # unchanged
    assert safe("模型-ñ") == "模型-ñ"  # printable text of any script stays readable
    assert safe(None) == "None" and safe(42) == "42"


def test_a_long_value_is_cut_and_says_how_much_was_left_out():
    out = safe("m" * 1_200_000)
    assert len(out) < MAX_CHARS + 40 and out.endswith(f"...({1_200_000 - MAX_CHARS} more chars)")
    out = safe("\x1b" * 1000, limit=40)  # escapes count in the bound
    assert len(out) < 40 + 40 and one_line(out)


def test_an_exception_is_its_type_and_its_escaped_message():
    assert safe_exc(ValueError("bad\nvalue")) == "ValueError: bad\\nvalue"
    assert safe_exc(TimeoutError()) == "TimeoutError"


def test_a_formatted_log_record_with_a_forged_value_is_one_line():
    record = logging.LogRecord("router.models", logging.INFO, __file__, 1, "replica %s serves model %s",
                               ("10.0.0.1:8000", safe(FORGED)), None)
    text = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s").format(record)
    assert one_line(text) and "forged line" in text


@pytest.mark.timeout(60)
async def test_a_router_id_from_redis_with_a_newline_and_an_escape_is_logged_on_one_line(caplog):
    import redis as redis_py

    caplog.set_level(logging.INFO, logger="router.fleet_view")
    with redis_server() as server:
        r = redis_py.Redis.from_url(server.url)
        r.sadd(ROUTERS_KEY, FORGED)
        r.hset(load_key(FORGED), mapping={"_hb": "1", "r0:1": "-5 0 0 0 0"})
        r.close()
        sync = FleetSync(FleetViewConfig(server.url, 0.01, 5.0, 2.0), RemoteLoad(ClusterTracker(["r0:1"])),
                         CollectorRegistry(), router_id="me", publisher=True)
        try:
            await sync.tick()
        finally:
            await sync.close()
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert one_line(line) and "llama\\n2026-01-01" in line, line
