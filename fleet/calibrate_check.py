"""What a calibrated profile predicts, and the self-check that holds it to the server it was measured on.

`predict` simulates a request list on a fleet of one profile (least-outstanding routing, no scrape noise) and
returns TTFT and E2E p50/p99. The self-check after a calibration: `validation_requests` draws a short Poisson
workload at a stated share of the fitted profile's capacity, `fleet.calibrate.replay` sends it to the live server,
and `judge` simulates the same requests (their real prompt token counts, arrival offsets and output lengths) with
the fitted profile and sets predicted against measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from routewise_vllm.simulator import costmodel
from routewise_vllm.simulator.types import SimRequest

PERCENTILES = ("ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s")


@dataclass(frozen=True)
class Server:
    """The scheduler settings a simulated replica needs (from the calibrated profile's `server` section)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    max_model_len: int | None = None
    speed_factor: float = 1.0  # iteration-time multiplier (an emulator run at --speed S: 1 / S)


def lognormal_requests(n: int, rate_rps: float, prompt_median: float, output_median: float, seed: int,
                       prompt_sigma: float = 0.6, output_sigma: float = 0.5, max_len: int = 8192) -> list[SimRequest]:
    """Poisson arrivals, log-normal prompt and output lengths (the workload the calibration is judged on)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate_rps, n))
    prompt = np.clip(np.rint(rng.lognormal(math.log(prompt_median), prompt_sigma, n)), 1, max_len // 2)
    output = np.clip(np.rint(rng.lognormal(math.log(output_median), output_sigma, n)), 1, max_len // 2)
    return [SimRequest(request_id=i, arrival_s=float(arrivals[i] - arrivals[0]), prompt_tokens=int(prompt[i]),
                       output_tokens=int(output[i])) for i in range(n)]


def predict(profile: str | Path, requests: Sequence[SimRequest], replicas: int = 1, server: Server = Server(),
            seed: int = 0) -> dict[str, float]:
    """TTFT and E2E p50/p99 of `requests` on `replicas` replicas of `profile` (a name or a YAML path)."""
    from routewise_vllm.router.policy.served import served_policy
    from routewise_vllm.simulator.cluster import simulate
    from routewise_vllm.simulator.config import ClusterConfig, ReplicaGroup, ScrapeConfig
    from routewise_vllm.simulator.metrics import Slo, summarize

    group = ReplicaGroup(profile=str(profile), count=replicas, max_num_seqs=server.max_num_seqs,
                         max_num_batched_tokens=server.max_num_batched_tokens, block_size=server.block_size,
                         max_model_len=server.max_model_len, speed_factor=server.speed_factor)
    config = ClusterConfig(replicas=[group], scrape=ScrapeConfig(jitter_s=0.0), estimator_sigma=0.0)
    records = simulate(config, list(requests), served_policy("least-outstanding"), seed=seed)
    s = summarize(records, Slo(ttft_s=math.inf, tpot_s=math.inf))
    return {k: s[k] for k in PERCENTILES} | {"unfinished": s["unfinished"]}


def errors(fitted: dict[str, float], truth: dict[str, float]) -> dict[str, float]:
    """Relative error of each percentile."""
    return {k: abs(fitted[k] - truth[k]) / truth[k] for k in PERCENTILES}


def capacity_rps(profile: costmodel.Profile, batch: int, prompt: float, output: float) -> float:
    """Requests/s one replica sustains at full batches: each request's own prefill plus its share of the decode
    iterations it rides in."""
    co = profile.coefficients()
    t_pre = co.iteration_time(int(prompt), 0, int(prompt), prompt * prompt / 2, 1)
    t_dec = co.iteration_time(0, batch, int(batch * (prompt + output / 2)))
    return 1.0 / (t_pre + output * t_dec / batch)


@dataclass
class Validation:
    rate_rps: float
    requests: int
    seconds: float
    measured: dict[str, float]
    predicted: dict[str, float]

    @property
    def errors(self) -> dict[str, float]:
        return errors(self.predicted, self.measured)

    def worst(self) -> tuple[float, float]:
        """(worst p50 error, worst p99 error)."""
        e = self.errors
        return max(e["ttft_p50_s"], e["e2e_p50_s"]), max(e["ttft_p99_s"], e["e2e_p99_s"])

    def table(self) -> str:
        lines = [f"validation: {self.requests} requests, Poisson at {self.rate_rps:.2f} req/s for {self.seconds:.0f} s",
                 f"{'':10} {'measured':>10} {'predicted':>10} {'error':>7}"]
        for k in PERCENTILES:
            name = k.removesuffix("_s").replace("_", " ").upper().replace(" P", " p")
            lines.append(f"{name:10} {self.measured[k] * 1e3:8.1f}ms {self.predicted[k] * 1e3:8.1f}ms "
                         f"{self.errors[k]:6.1%}")
        return "\n".join(lines)


def validation_requests(profile_path: str | Path, server: Server, load: float, seconds: float, prompt_median: float,
                        output_median: float, seed: int = 0) -> tuple[float, list[SimRequest]]:
    """(rate, requests): `seconds` of Poisson arrivals at `load` x the fitted profile's capacity."""
    profile = costmodel.load_profile(str(profile_path))
    rate = load * capacity_rps(profile, server.max_num_seqs, prompt_median, output_median)
    n = max(20, int(rate * seconds))
    return rate, lognormal_requests(n, rate, prompt_median, output_median, seed,
                                    max_len=server.max_model_len or profile.max_model_len)


def judge(profile_path: str | Path, server: Server, rate: float, requests: Sequence[SimRequest],
          measured: Sequence[tuple[float, float, int]], seed: int = 0) -> Validation:
    """The replay's measured (client TTFT, client E2E, server-counted prompt tokens) per request against the same
    requests simulated with the profile."""
    replayed = [SimRequest(request_id=r.request_id, arrival_s=r.arrival_s, prompt_tokens=max(1, m[2]),
                           output_tokens=r.output_tokens) for r, m in zip(requests, measured)]
    ttft = np.array([m[0] for m in measured])
    e2e = np.array([m[1] for m in measured])
    got = {"ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
           "e2e_p50_s": float(np.percentile(e2e, 50)), "e2e_p99_s": float(np.percentile(e2e, 99))}
    return Validation(rate, len(requests), requests[-1].arrival_s, got, predict(profile_path, replayed, 1, server, seed))
