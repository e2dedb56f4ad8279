"""`trainer finetune` wall time on a 50k-record decision log (target: under 2 minutes on 2 cores).

    .venv/bin/python tests/bench/finetune_speed.py [--records 50000] [--scenario heterogeneous] [--log DIR]

The log is written once by a simulated fleet with the router's own encoder (trainer/simlog.py; about
1.5 s of simulation per 600 records) into --log (default /tmp/routewise-ft-bench-log, reused when it
already holds enough records); then `trainer finetune` runs as a subprocess with torch limited to 2
threads, timed from the outside, default settings (4 epochs, 20 % held out).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def ensure_log(directory: Path, records: int, scenario: str, episode_requests: int = 2000) -> int:
    from routewise_vllm.trainer.simlog import simulate_log

    f = directory / "decisions-000001.jsonl"
    have = sum(1 for _ in open(f)) if f.is_file() else 0
    if have < records:
        f.unlink(missing_ok=True)
        episodes = -(-records // episode_requests)
        start = time.perf_counter()
        simulate_log(scenario, directory, episodes=episodes, max_requests=episode_requests, epsilon=0.1, seed=1)
        have = sum(1 for _ in open(f))
        print(f"wrote {have} records to {f} in {time.perf_counter() - start:.0f}s")
    return have


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=50_000)
    ap.add_argument("--scenario", default="heterogeneous")
    ap.add_argument("--log", default="/tmp/routewise-ft-bench-log")
    args = ap.parse_args()
    log = Path(args.log)
    log.mkdir(parents=True, exist_ok=True)
    have = ensure_log(log, args.records, args.scenario)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="2", MKL_NUM_THREADS="2")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ft.onnx"
        cmd = [sys.executable, "-m", "routewise_vllm.trainer", "finetune", "--decision-log", str(log), "--init",
               str(REPO / "router/policy/models/suite-fleet.onnx"), "-o", str(out), "--max-records", str(args.records), "--json"]
        start = time.perf_counter()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        if r.returncode != 0:
            print(r.stderr, file=sys.stderr)
            return 1
        doc = json.loads(r.stdout)
    print(f"log: {have} records ({args.scenario}); used {doc['train_samples'] + doc['val_samples']} samples")
    print(f"finetune wall time: {wall:.1f}s (whole process, torch 2 threads; target < 120 s) "
          f"{'OK' if wall < 120 else 'MISSED'}")
    print(f"CPU time: {cpu:.1f}s user+sys (on 2 otherwise idle cores wall is about half of it; the wall figure includes "
          f"waiting for cores another job holds: load average {os.getloadavg()[0]:.1f})")
    print(f"held-out MAE of log TTFT {doc['before']['mae_log_ttft']:.4f} -> {doc['after']['mae_log_ttft']:.4f}; "
          f"pair order accuracy {doc['before']['pair_order_accuracy']} -> {doc['after']['pair_order_accuracy']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
