"""The soak's CI run (tests/bench/soak.py, 60 s of load): a real router process with late binding and the decision
log on, in front of emulated replicas of which one is killed and restarted twice, one is broken and one slow.
Outcomes only (no RSS or timing figures, which depend on the host): no request hangs, in-flight and held requests
return to 0, the decision log's count equals its lines on disk with nothing dropped, the router exits 0."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench.soak import outcome_failures, parser, run  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_soak_60s(tmp_path):
    args = parser().parse_args(["--duration", "60", "--rate", "5", "--kill-every", "20", "--down-for", "5",
                                "--hang-s", "90", "--work-dir", str(tmp_path)])
    r = asyncio.run(run(args))
    assert outcome_failures(r) == [], r
    assert r["sent"] >= 150 and r["outcomes"].get("ok", 0) > 0.5 * r["sent"], r["outcomes"]
    assert len(r["kills_at_s"]) == 2, r["kills_at_s"]  # the chaos really happened
    assert r["requests_by_replica"]["broken"] > 0 and r["requests_by_replica"]["slow"] > 0, r["requests_by_replica"]
    assert r["end"]["decision_log_lines"] >= r["sent"], r  # one record per decision, retries add more
