"""The test fakes' own guarantees: a server started for a test is the one the test talks to."""

from __future__ import annotations

import pytest

from tests.fakes.redis_server import RedisServer, redis_server, require_redis

pytestmark = pytest.mark.timeout(60)


def test_a_redis_port_taken_before_the_start_moves_to_another_port():
    """Another redis-server takes the port picked for ours before ours starts: ours must not take the other one's
    answers for its own, and starts on a fresh port."""
    with redis_server() as first:
        second = RedisServer(require_redis())
        second.port = first.port  # the race, made certain
        try:
            second.start(attempts=3)
            assert second.port != first.port
            assert second.proc is not None and second.proc.poll() is None
            assert second._answers_as_ours() and first._answers_as_ours()
        finally:
            second.stop()


def test_a_restart_keeps_the_port():
    with redis_server() as server:
        port = server.port
        server.stop()
        server.start()
        assert server.port == port and server._answers_as_ours()
