"""The chaos benchmark's short run (tests/bench/chaos_bench.py, ~35 s): a real router process in front of
three healthy replicas (one killed and restarted every 10 s, one with garbage/hanging /metrics) and three
bad ones (500s, broken streams, hanging), with client errors in the mix. Every outcome target must hold; RSS
growth is a figure of the long benchmark run, not of 30 s on a shared host."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench.chaos_bench import parser, run, verdict  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


def test_chaos_short_run(tmp_path):
    args = parser().parse_args(["--duration", "30", "--rate", "20", "--kill-every", "10", "--recover-at", "0.6",
                                "--router-log", str(tmp_path / "router.log")])
    r = asyncio.run(run(args))
    assert verdict(r, memory=False) == [], r
    assert r["sent"] >= 400 and r["streams"]["ok"] > 100 and r["non_streaming"]["n"] > 100
    assert max(r["eject_s"].values()) < 15  # ejected within seconds
