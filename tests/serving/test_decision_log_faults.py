"""The decision log when the disk says no: every record is either a whole line on disk or counted as dropped by
reason, one log line per failure episode, no partial line, no file number used up per record, and a directory
that cannot be written at start is one line and a non-zero exit of `router serve`.

A full disk is a real 256 KiB tmpfs where the tests may mount one (root) and an injected write that fails with
ENOSPC after N bytes everywhere; an unwritable directory is `chmod 555` (non-root), `chattr +i` (root), or an
injected open that fails."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from routewise_vllm.router.serving import decision_log as dl
from routewise_vllm.router.serving.decision_log import DecisionLogError, DecisionLogWriter, log_files
from routewise_vllm.router.serving.metrics import ServingMetrics

from .test_decision_log import pending

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def lines_on_disk(directory: Path) -> list[dict]:
    """Every line of every file, each of which must be a whole JSON record ending in a newline."""
    out = []
    for p in log_files(directory):
        data = p.read_bytes()
        assert not data or data.endswith(b"\n"), f"{p.name} ends mid-line: {data[-80:]!r}"
        out += [json.loads(line) for line in data.splitlines()]
    return out


def wait_settled(w: DecisionLogWriter, n: int, timeout_s: float = 60.0) -> None:
    """Until the writer has written or dropped all `n` records submitted so far (it works in its own thread)."""
    deadline = time.monotonic() + timeout_s
    while w.written + sum(w.dropped.values()) < n:
        assert time.monotonic() < deadline, w.describe()
        time.sleep(0.01)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "router.decision_log" and r.levelno >= logging.WARNING]


class Disk:
    """os.write with room for `room` more bytes: a write past it writes what fits, the next raises ENOSPC."""

    def __init__(self, room: int) -> None:
        self.room = room

    def write(self, fd: int, data) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = os.write(fd, data[: self.room])
        self.room -= n
        return n


def test_a_full_disk_drops_whole_records_counts_them_and_logs_once_per_episode(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="router.decision_log")
    reg = CollectorRegistry()
    disk = Disk(room=40_000)
    w = DecisionLogWriter(tmp_path, metrics=ServingMetrics(reg), os_write=disk.write)
    w.start()
    for i in range(300):
        assert w.submit(pending(i))
    wait_settled(w, 300)
    on_disk = lines_on_disk(tmp_path)
    dropped = w.dropped.get("no_space", 0)
    assert 0 < len(on_disk) == w.written < 300 and w.written + dropped == 300, w.describe()
    assert [r["id"] for r in on_disk] == [f"req-{i}" for i in range(w.written)]  # the first ones, in order
    assert reg.get_sample_value("llm_router_decision_log_records_total") == w.written
    assert reg.get_sample_value("llm_router_decision_log_dropped_total", {"reason": "no_space"}) == dropped
    assert len(warnings(caplog)) == 1 and "No space left" in warnings(caplog)[0] and "no_space" in warnings(caplog)[0]
    assert w.describe()["failing"] == "no_space"

    disk.room = 10**9  # space freed: writing resumes after the last complete line, with one more line logged
    for i in range(300, 350):
        assert w.submit(pending(i))
    w.close()
    on_disk = lines_on_disk(tmp_path)
    assert len(on_disk) == w.written and [r["id"] for r in on_disk][-50:] == [f"req-{i}" for i in range(300, 350)]
    assert w.written + dropped == 350 and w.dropped == {"no_space": dropped}
    assert len(warnings(caplog)) == 2 and f"after dropping {dropped} records" in warnings(caplog)[1]
    assert w.describe()["failing"] is None


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 256 KiB filesystem (needs root and mount(8)); skipped otherwise."""
    if os.geteuid() != 0:
        pytest.skip("mounting a 256 KiB tmpfs needs root; the injected full disk above always runs")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_real_256k_filesystem_filling_up(tiny_tmpfs, caplog):
    caplog.set_level(logging.INFO, logger="router.decision_log")
    reg = CollectorRegistry()
    w = DecisionLogWriter(tiny_tmpfs / "log", metrics=ServingMetrics(reg))
    w.start()
    n = 0
    for i in range(2000):  # ~1.1 MB of records: four times what the filesystem holds
        while not w.submit(pending(i)):  # the queue is 10,000 deep: this never spins, but count none twice
            time.sleep(0.01)
        n += 1
    w.close()
    on_disk = lines_on_disk(tiny_tmpfs / "log")
    assert 0 < len(on_disk) == w.written and w.written + w.dropped["no_space"] == n, w.describe()
    assert reg.get_sample_value("llm_router_decision_log_records_total") == w.written
    assert reg.get_sample_value("llm_router_decision_log_dropped_total", {"reason": "no_space"}) == w.dropped["no_space"]
    assert len(warnings(caplog)) == 1


@contextlib.contextmanager
def unwritable(directory: Path):
    """No new file can be created in `directory`: chmod 555 for a normal user, the immutable flag for root."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(0o755)
        return
    r = subprocess.run(["chattr", "+i", str(directory)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"root cannot make a directory unwritable here (chattr: {r.stderr.strip()})")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True)


def test_rotation_into_an_unwritable_directory_uses_no_file_numbers_and_logs_once(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(dl, "REOPEN_RETRY_S", 0.0)  # retry on every batch: the numbering must hold even so
    caplog.set_level(logging.INFO, logger="router.decision_log")
    w = DecisionLogWriter(tmp_path, max_bytes=4096)
    w.start()
    with unwritable(tmp_path):
        for i in range(200):
            w.submit(pending(i))
            if i % 20 == 0:
                wait_settled(w, i + 1)  # many batches, so rotation is tried many times
        wait_settled(w, 200)
    assert [p.name for p in log_files(tmp_path)] == ["decisions-000001.jsonl"]
    assert w.written + w.dropped["write_error"] == 200 and len(lines_on_disk(tmp_path)) == w.written
    assert len(warnings(caplog)) == 1, warnings(caplog)
    w.submit(pending(200))
    w.close()
    assert [p.name for p in log_files(tmp_path)] == ["decisions-000001.jsonl", "decisions-000002.jsonl"]
    assert lines_on_disk(tmp_path)[-1]["id"] == "req-200" and len(warnings(caplog)) == 2


def test_a_failing_create_is_retried_once_a_second_not_per_record(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="router.decision_log")
    opens = []
    allowed = {"n": 1}

    def os_open(path, flags, mode):
        opens.append(path)
        if len(opens) > allowed["n"]:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return os.open(path, flags, mode)

    w = DecisionLogWriter(tmp_path, max_bytes=1024, os_open=os_open)
    w.start()
    for i in range(100):
        w.submit(pending(i))
        wait_settled(w, i + 1)  # one batch per record
    assert len(opens) <= 3, opens  # the start, then one try, plus one more if the run took over a second
    assert w.written == 1 and w.dropped == {"write_error": 99} and len(warnings(caplog)) == 1
    w.close()
    assert len(lines_on_disk(tmp_path)) == 1


def test_a_bad_directory_at_start_is_one_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(DecisionLogError, match=r"^decision_log_dir='.*a-file/log': cannot create it \(Not a directory\)$"):
        DecisionLogWriter(blocker / "log").start()
    ro = tmp_path / "ro"
    ro.mkdir()
    with unwritable(ro), pytest.raises(DecisionLogError, match=r"^decision_log_dir='.*ro': cannot write there \(.+\)$"):
        DecisionLogWriter(ro).start()


def serve_with_log_dir(directory: Path, workers: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "routewise_vllm.router", "serve", "--host", "127.0.0.1", "--port", "0", "--policy", "least-outstanding",
         "--replica", "http://127.0.0.1:9", "--decision-log", str(directory), "--workers", str(workers)],
        cwd=REPO, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_router_serve_exits_with_one_line_when_the_log_dir_cannot_be_created(tmp_path, workers):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    r = serve_with_log_dir(blocker / "log", workers)  # with workers: refused before any starts, not restarted for ever
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert r.stderr.strip().splitlines()[-1].startswith("router: decision_log_dir=")
    assert "Traceback" not in r.stderr and len([ln for ln in r.stderr.splitlines() if "decision_log_dir" in ln]) == 1


@pytest.mark.parametrize("workers", [1, 2])
def test_router_serve_exits_with_one_line_on_a_read_only_log_dir(tmp_path, workers):
    ro = tmp_path / "ro"
    ro.mkdir()
    with unwritable(ro):
        r = serve_with_log_dir(ro, workers)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and r.stderr.strip().splitlines()[-1].startswith("router: decision_log_dir=")
    assert list(ro.iterdir()) == []  # the check left nothing behind
