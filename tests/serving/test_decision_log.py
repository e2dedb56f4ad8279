"""The decision log: records round-trip, files rotate, a full queue drops and counts, never blocks."""

from __future__ import annotations

import json
import threading

import numpy as np
from prometheus_client import CollectorRegistry

from routewise_vllm.router.policy import build_features
from routewise_vllm.router.serving.decision_log import DecisionLogWriter, PendingRecord, decode_features, log_files
from routewise_vllm.router.serving.metrics import ServingMetrics

from .helpers import make_request, make_view


def pending(i: int, n_replicas: int = 4) -> PendingRecord:
    view = make_view([(i + k) % 7 for k in range(n_replicas)], healthy=[k != 1 for k in range(n_replicas)])
    return PendingRecord(
        time_s=1_700_000_000.0 + i * 0.25, request=make_request(i, prompt=100 + i, max_tokens=64), view=view,
        arm="control", policy="least-outstanding", index=0, primary_index=0, fallback_reason=None, decision_s=2e-5,
        shadow={"policy": "learned", "index": 2, "replica": "r2", "agree": False, "fallback": None},
        status=200, ok=True, ttft_s=0.05 + i / 1000, e2e_s=0.5, output_tokens=60 + i,
    )


def read_all(directory):
    return [json.loads(line) for p in log_files(directory) for line in p.read_text().splitlines()]


def test_records_round_trip(tmp_path):
    w = DecisionLogWriter(tmp_path)
    w.start()
    sent = [pending(i) for i in range(50)]
    for p in sent:
        assert w.submit(p)
    w.close()
    got = read_all(tmp_path)
    assert [r["id"] for r in got] == [p.request.request_id for p in sent]
    for r, p in zip(got, sent):
        assert np.array_equal(decode_features(r), build_features(p.view, p.request))
        assert r["mask"] == [1, 0, 1, 1] and r["replica"] == "r0" and r["arm"] == "control"
        assert r["shadow"]["index"] == 2 and r["prompt_tokens_est"] == p.request.prompt_tokens_est
        assert r["output_tokens"] == p.output_tokens and r["prefix_blocks"] == [11, 12, 13]
    assert w.written == 50 and w.dropped == {}


def test_rotation_keeps_n_files_and_continues_numbering(tmp_path):
    w = DecisionLogWriter(tmp_path, max_bytes=4096, keep=3)
    w.start()
    for i in range(200):
        w.submit(pending(i))
    w.close()
    files = log_files(tmp_path)
    assert len(files) == 3
    seqs = [int(p.stem.split("-")[1]) for p in files]
    assert seqs == sorted(seqs) and seqs[0] > 1  # the oldest were deleted
    ids = [int(r["id"].split("-")[1]) for r in read_all(tmp_path)]
    assert ids == list(range(200 - len(ids), 200))  # the newest survive, in order
    w2 = DecisionLogWriter(tmp_path, max_bytes=4096, keep=3)
    w2.start()
    w2.submit(pending(999))
    w2.close()
    assert int(log_files(tmp_path)[-1].stem.split("-")[1]) == seqs[-1] + 1  # a restart never appends to old files


def test_full_queue_drops_and_counts_without_blocking(tmp_path):
    reg = CollectorRegistry()
    w = DecisionLogWriter(tmp_path, queue_size=8, metrics=ServingMetrics(reg))
    gate = threading.Event()
    real_write = w._write

    def stuck_write(lines):  # the disk is stuck: the writer thread cannot drain the queue
        gate.wait(10)
        real_write(lines)

    w._write = stuck_write
    w.start()
    accepted = sum(w.submit(pending(i)) for i in range(500))  # returns at once even though nothing is written
    gate.set()
    w.close()
    assert accepted <= 8 + 512  # what the queue and one batch in the writer's hands can hold
    assert w.dropped["queue_full"] == 500 - accepted > 0
    assert reg.get_sample_value("llm_router_decision_log_dropped_total", {"reason": "queue_full"}) == 500 - accepted
    assert len(read_all(tmp_path)) == accepted == w.written


def test_bad_record_is_dropped_and_writer_survives(tmp_path):
    w = DecisionLogWriter(tmp_path)
    w.start()
    bad = pending(1)
    bad.features = np.zeros((2, 3), np.float32)  # wrong shape for the view
    w.submit(bad)
    w.submit(pending(2))
    w.close()
    assert w.dropped == {"encode_error": 1} and [r["id"] for r in read_all(tmp_path)] == ["req-2"]


def test_not_started_writer_drops(tmp_path):
    w = DecisionLogWriter(tmp_path)
    assert not w.submit(pending(0)) and w.dropped == {"not_running": 1}
