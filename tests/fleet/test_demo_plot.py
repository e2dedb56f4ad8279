"""The demo draws its result: a PNG with each arm's TTFT tail and p99 interval."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from routewise_vllm.fleet.demo import _plot  # noqa: E402
from routewise_vllm.fleet.loadgen import RequestResult  # noqa: E402


def test_the_demo_draws_both_arms(tmp_path):
    rng = np.random.default_rng(0)
    results = [RequestResult(group=arm, ok=True, ttft_s=float(t)) for arm, scale in (("control", 0.2), ("treatment", 0.1))
               for t in rng.exponential(scale, 300)]
    results.append(RequestResult(group="control", ok=False, error="timeout"))  # no TTFT: left out, not drawn as NaN
    line = _plot(results, ["control", "treatment"], {"control": [0.8, 1.1], "treatment": None}, "demo", tmp_path / "d.png")
    assert line == f"plot: {tmp_path / 'd.png'}"
    assert (tmp_path / "d.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / "d.png").stat().st_size > 10_000


def test_an_unwritable_path_is_a_line_not_a_traceback(tmp_path):
    line = _plot([RequestResult(group="control", ok=True, ttft_s=0.1)], ["control"], {}, "demo", tmp_path / "no/such/d.png")
    assert line.startswith("plot: none (") and "no/such" in line
