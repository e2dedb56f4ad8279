"""Calibration against servers whose truth is known: the emulator runs a profile, `fleet calibrate` measures it,
and the fitted profile must predict what the known one predicts.

For each profile family (a roofline profile, fitted with another GPU's numbers as its starting shape, and a linear
one), start `fleet emulate` with the known profile, calibrate it, and simulate two workloads with the fitted and
the known profile: two replicas, Poisson arrivals, log-normal prompts (median 600 tokens) and outputs (median 120),
at about 47 % of the fleet's capacity (14 req/s on the A100 profile) and near saturation (83 %, 25 req/s). The
Both emulators run at half speed (`--speed 0.5`: every time doubled, the arrival rates halved to match). Prints
each percentile's relative error, and over several calibrations the spread of the fitted parameters.

    .venv/bin/python tests/bench/calibration_oracle.py --calibrations 3
    .venv/bin/python tests/bench/calibration_oracle.py --families linear --budget 60 --json out.json

The emulator steps in wall-clock time: on a host too busy to keep its iterations on time, the server really is
slower than its profile, and the calibration measures that (the errors then say more about the host than the fit).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from routewise_vllm.fleet import calibrate, calibrate_check, calibrate_fit  # noqa: E402
from routewise_vllm.simulator import costmodel  # noqa: E402
from tests.fakes.ports import announced_port  # noqa: E402

LINEAR_TRUTH = str(costmodel.PROFILES_DIR / "measured" / "cpu-tiny-linear.yaml")


@dataclass(frozen=True)
class Family:
    truth: str  # the profile the emulator runs
    shape: str | None  # the roofline start given to the calibration (None: linear form only)
    max_num_seqs: int
    speed: float = 1.0  # the emulator's --speed: below 1 its iterations take longer, so a host's lateness weighs less
    loads: tuple[float, float] = (14 / 30, 25 / 30)  # shares of the two-replica fleet's capacity


FAMILIES = {
    "roofline": Family("llama3-8b-a100", "llama3-8b-h100", 256, speed=0.5),
    "linear": Family(LINEAR_TRUTH, None, 64, speed=0.5),
}
PROMPT_MEDIAN, OUTPUT_MEDIAN, REPLICAS, REQUESTS = 600, 120, 2, 1500


def fleet_rates(family: Family) -> list[float]:
    """The workloads' arrival rates: shares of what two replicas of the known profile sustain at full batches."""
    truth = costmodel.load_profile(family.truth)
    cap = REPLICAS * calibrate_check.capacity_rps(truth, family.max_num_seqs, PROMPT_MEDIAN, OUTPUT_MEDIAN)
    return [load * cap * family.speed for load in family.loads]


def compare(family: Family, fitted_path: str, seed: int = 0) -> list[dict]:
    """Per workload: the known and fitted profiles' TTFT and E2E p50/p99 and the relative errors."""
    truth = costmodel.load_profile(family.truth)
    server = calibrate_check.Server(max_num_seqs=family.max_num_seqs, max_model_len=truth.max_model_len)
    slowed = calibrate_check.Server(max_num_seqs=family.max_num_seqs, max_model_len=truth.max_model_len,
                                    speed_factor=1 / family.speed)
    out = []
    for rate in fleet_rates(family):
        reqs = calibrate_check.lognormal_requests(REQUESTS, rate, PROMPT_MEDIAN, OUTPUT_MEDIAN, seed,
                                                  max_len=truth.max_model_len)
        known = calibrate_check.predict(family.truth, reqs, REPLICAS, slowed, seed)
        fitted = calibrate_check.predict(fitted_path, reqs, REPLICAS, server, seed)
        out.append({"rate_rps": rate, "known": known, "fitted": fitted, "errors": calibrate_check.errors(fitted, known)})
    return out


class Emulator:
    """`fleet emulate` in its own process group (its own event loop: the client's work does not delay its iterations)."""

    def __init__(self, family: Family) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="oracle-emulator-", suffix=".log")
        self.proc = subprocess.Popen(  # --port 0: it binds a free one and says which
            [sys.executable, "-m", "routewise_vllm.fleet", "emulate", "--port", "0", "--profile", family.truth,
             "--max-num-seqs", str(family.max_num_seqs), "--speed", str(family.speed)],
            stdout=subprocess.DEVNULL, stderr=self.log, start_new_session=True,
        )
        try:
            self.port = announced_port(self.proc, Path(self.log.name), "fleet emulate")
        except AssertionError as e:
            self.stop()
            raise RuntimeError(str(e)) from None
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    err = Path(self.log.name).read_text(errors="replace")[-500:]
                    self.stop()
                    raise RuntimeError(f"fleet emulate on port {self.port} did not start: {err}")
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> "Emulator":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def calibrate_once(family: Family, url: str, out: Path, budget_s: float, progress: bool = False) -> calibrate.Result:
    base = calibrate_fit.resolve_shape(family.shape, None)
    spec = calibrate.SweepSpec(budget_s=budget_s)
    res = calibrate.calibrate(url, None, spec, base, announce=lambda m: None, progress=progress)
    out.write_text(yaml.safe_dump(calibrate.profile_document(res, out.stem), sort_keys=False))
    return res


def parameters(res: calibrate.Result) -> dict[str, float]:
    """The chosen form's fitted parameters."""
    if res.chosen == "roofline" and res.roofline is not None:
        r = res.roofline
        return {"overhead_s": r.overhead_s, "prefill_mfu": r.prefill_mfu, "decode_bw_util": r.decode_bw_util}
    return {f: getattr(res.linear, f) for f in costmodel.LINEAR_FIELDS}


def spread(runs: list[dict[str, float]]) -> dict[str, float]:
    """(max - min) / median of each parameter over the calibrations (parameters fitted as 0 everywhere are left out)."""
    out = {}
    for k in runs[0]:
        v = np.array([r[k] for r in runs])
        if np.median(v) > 0:
            out[k] = float((v.max() - v.min()) / np.median(v))
    return out


def run(families: list[str], calibrations: int, budget_s: float, workdir: Path, progress: bool) -> dict:
    doc: dict = {}
    for name in families:
        family = FAMILIES[name]
        runs = []
        with Emulator(family) as emu:
            for k in range(calibrations):
                path = workdir / f"{name}-{k}.yaml"
                t0 = time.monotonic()
                res = calibrate_once(family, emu.url, path, budget_s, progress)
                runs.append({"seconds": time.monotonic() - t0, "chosen": res.chosen, "held_out": res.fits.held_out,
                             "rounds": res.rounds, "stopped": res.stopped, "parameters": parameters(res),
                             "workloads": compare(family, str(path))})
        doc[name] = {"runs": runs, "spread": spread([r["parameters"] for r in runs]) if len(runs) > 1 else {}}
    return doc


def report(doc: dict) -> str:
    lines = []
    for name, fam in doc.items():
        for k, r in enumerate(fam["runs"]):
            lines.append(f"{name} #{k}: {r['chosen']} form, {r['rounds']} rounds ({r['stopped']}) in {r['seconds']:.0f} s; "
                         f"held-out error {', '.join(f'{f} {e:.3f}' for f, e in r['held_out'].items() if e is not None)}")
            for w in r["workloads"]:
                e = w["errors"]
                lines.append(f"  {w['rate_rps']:5.1f} req/s: TTFT p50 {e['ttft_p50_s']:6.1%} p99 {e['ttft_p99_s']:6.1%}  "
                             f"E2E p50 {e['e2e_p50_s']:6.1%} p99 {e['e2e_p99_s']:6.1%}")
        if fam["spread"]:
            lines.append(f"{name} parameter spread (max-min)/median: "
                         + ", ".join(f"{k} {v:.1%}" for k, v in fam["spread"].items()))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="roofline,linear", help="comma-separated: roofline, linear")
    p.add_argument("--calibrations", type=int, default=3, help="calibrations per family (the spread needs 2 or more)")
    p.add_argument("--budget", type=float, default=120.0, help="seconds each calibration may take")
    p.add_argument("--workdir", default=None, help="where the fitted profiles go (default: a temporary directory)")
    p.add_argument("--json", help="write the figures here too")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args()

    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        p.error(f"--families: unknown {unknown}; known: {sorted(FAMILIES)}")
    with tempfile.TemporaryDirectory() as tmp:
        doc = run(families, args.calibrations, args.budget, Path(args.workdir or tmp), not args.quiet)
    print(report(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
