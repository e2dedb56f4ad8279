"""`trainer follow`: fine-tune again whenever the decision log has grown by `every_records`, and hand
each candidate to the live router as its A/B treatment.

A separate process that only reads the log and talks to the router's admin API over HTTP, so it can
never block the router. Each round:
1. the base model is the router's current primary (the last candidate the router reports as promoted
   in `GET /admin/ab`), else `--init`;
2. `finetune` writes `candidate-NNNNNN.onnx` + `.json` atomically (a failed round leaves no file);
3. a candidate that does not beat its base on the held-out part of the log is kept on disk but not
   handed over; otherwise `POST /admin/policy/reload {"arm": "treatment", "path": ...}` makes it the
   treatment; the router's promotion controller (router/serving/promotion.py) promotes it when its
   A/B window is no worse than the primary, or rolls it back.
The follower's progress is `follow-state.json` in the models directory (written atomically), so a
restarted follower continues the numbering and does not refit on records it has already seen.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path

from routewise_vllm.router.policy.registry import DEFAULT_MODEL_PATH
from routewise_vllm.simulator.replay import log_paths
from routewise_vllm.trainer.finetune import FinetuneConfig, FinetuneError, finetune
from routewise_vllm.trainer.fleet_log import FleetLogError

log = logging.getLogger("trainer.follow")


def _line_counts(directory: Path) -> dict[str, int]:
    try:
        files = log_paths(directory)
    except ValueError:
        return {}
    out = {}
    for f in files:
        try:
            with open(f, "rb") as fh:
                out[f.name] = sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 20), b""))
        except OSError:
            continue
    return out


class Follower:
    def __init__(
        self, decision_log: str | Path, models: str | Path, *, init: str | Path | None = None, router: str | None = None,
        admin_token: str | None = None, every_records: int = 5000, min_improvement: float = 0.0,
        config: FinetuneConfig = FinetuneConfig(), timeout_s: float = 10.0,
    ) -> None:
        if every_records < 1:
            raise FinetuneError(f"--every-records={every_records}: must be >= 1")
        self.log_dir = Path(decision_log)
        self.models = Path(models)
        self.models.mkdir(parents=True, exist_ok=True)
        self.init = Path(init) if init is not None else DEFAULT_MODEL_PATH
        self.router = router.rstrip("/") if router else None
        self.token = admin_token
        self.every_records = every_records
        self.min_improvement = min_improvement
        self.config = config
        self.timeout_s = timeout_s
        self.state_path = self.models / "follow-state.json"
        self.state = self._load_state()

    def _load_state(self) -> dict:
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {"seq": 0, "seen_lines": {}, "rounds": []}

    def _save_state(self) -> None:
        tmp = self.state_path.with_name(f".{self.state_path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self.state, indent=2) + "\n")
        os.replace(tmp, self.state_path)

    def new_records(self) -> tuple[int, dict[str, int]]:
        now = _line_counts(self.log_dir)
        seen = self.state["seen_lines"]
        return sum(max(0, n - seen.get(name, 0)) for name, n in now.items()), now

    # ---------------------------------------------------------------- the router's admin API
    def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        req = urllib.request.Request(self.router + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            try:
                return exc.code, json.loads(exc.read() or b"{}")
            except ValueError:
                return exc.code, {}

    def base_model(self) -> Path:
        """The router's current primary if it promoted one of our candidates, else --init."""
        if self.router is not None:
            try:
                _, ab = self._call("GET", "/admin/ab")
            except (OSError, ValueError) as exc:
                log.warning("router %s unreachable (%s); fine-tuning from the last known base", self.router, exc)
                return Path(self.state.get("base") or self.init)
            promoted = [h for h in ((ab.get("promotion") or {}).get("history") or []) if h.get("result") == "promoted"]
            if promoted and promoted[-1].get("candidate") and Path(promoted[-1]["candidate"]).is_file():
                return Path(promoted[-1]["candidate"])
        return Path(self.state.get("base") or self.init) if self.router is not None else self.init

    # ---------------------------------------------------------------- one round
    def step(self) -> dict:
        """Fine-tune if the log grew by `every_records`; returns what happened."""
        new, counts = self.new_records()
        if new < self.every_records:
            return {"action": "wait", "new_records": new, "every_records": self.every_records}
        base = self.base_model()
        seq = self.state["seq"] + 1
        out = self.models / f"candidate-{seq:06d}.onnx"
        round_doc: dict = {"seq": seq, "base": str(base), "new_records": new, "at_unix_s": round(time.time(), 3)}
        try:
            report = finetune(self.log_dir, base, out, self.config)
        except (FinetuneError, FleetLogError) as exc:
            log.error("fine-tune round %d failed, nothing handed over: %s", seq, exc)
            round_doc |= {"action": "failed", "error": str(exc)}
            self._finish(round_doc, counts, seq=self.state["seq"])  # do not retry on the same records
            return round_doc
        key = report.criterion
        gain = report.before[key] - report.after[key]
        round_doc |= {"candidate": str(out), "report": asdict(report)}
        if gain < self.min_improvement:
            round_doc["action"] = "kept_base"
            log.info("candidate %s not handed over: held-out %s %.4f -> %.4f", out, key, report.before[key], report.after[key])
        elif self.router is None:
            round_doc["action"] = "written"
        else:
            status, body = self._call("POST", "/admin/policy/reload", {"path": str(out.resolve()), "arm": "treatment"})
            round_doc |= {"action": "handed_over" if status == 200 else "refused", "router_status": status,
                          "router_message": body.get("message") or body.get("error")}
            (log.info if status == 200 else log.warning)("candidate %s -> router: %s %s", out, status, round_doc["router_message"])
        self.state["base"] = str(base)
        self._finish(round_doc, counts, seq=seq)
        return round_doc

    def _finish(self, round_doc: dict, counts: dict[str, int], seq: int) -> None:
        self.state["seq"] = seq
        self.state["seen_lines"] = counts
        self.state["rounds"] = (self.state.get("rounds") or [])[-19:] + [
            {k: v for k, v in round_doc.items() if k != "report"}
            | ({"before": round_doc["report"]["before"], "after": round_doc["report"]["after"]} if "report" in round_doc else {})
        ]
        self._save_state()

    def run(self, interval_s: float) -> None:
        if not interval_s > 0:
            raise FinetuneError(f"--interval-s={interval_s}: must be > 0")
        while True:
            try:
                doc = self.step()
                if doc["action"] != "wait":
                    print(json.dumps({k: v for k, v in doc.items() if k != "report"}), flush=True)
            except OSError as exc:  # a router or volume hiccup must not end the loop
                log.warning("follow round: %s", exc)
            time.sleep(interval_s)
