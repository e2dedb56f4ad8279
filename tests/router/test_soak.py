"""The soak's test runs (tests/bench/soak.py), both in the `bench` tier: 20 s and 60 s of load (CI runs the chaos
run, tests/router/test_chaos.py, per change). A real router process with late binding and the decision
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


# (seconds of load, seconds between kills, seconds down, fewest requests sent): two kills in each
RUNS = {
    "20s": (20, 6, 3, 50),
    "60s": (60, 20, 5, 150),
}


@pytest.mark.parametrize("length", [pytest.param("20s", marks=pytest.mark.bench), pytest.param("60s", marks=pytest.mark.bench)])
def test_soak(length: str, tmp_path: Path) -> None:
    duration, kill_every, down_for, least_sent = RUNS[length]
    args = parser().parse_args(["--duration", str(duration), "--rate", "5", "--kill-every", str(kill_every),
                                "--down-for", str(down_for), "--hang-s", "90", "--work-dir", str(tmp_path)])
    r = asyncio.run(run(args))
    assert outcome_failures(r) == [], r
    assert r["sent"] >= least_sent and r["outcomes"].get("ok", 0) > 0.5 * r["sent"], r["outcomes"]
    assert len(r["kills_at_s"]) == 2, r["kills_at_s"]  # the chaos really happened
    assert r["requests_by_replica"]["broken"] > 0 and r["requests_by_replica"]["slow"] > 0, r["requests_by_replica"]
    assert r["end"]["decision_log_lines"] >= r["sent"], r  # one record per decision, retries add more
