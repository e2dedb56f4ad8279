"""A decision log that owns its files, against someone who can write to its directory: a symlink planted at the
next file's name leaves its target untouched, planted files with higher numbers are neither counted by `keep`
nor deleted, and the router's own files hold every record it counted as written. Each refusal, failed
deletion or lost file shows in describe() (/admin/serving) and is logged once."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from routewise_vllm.router.serving.decision_log import DecisionLogWriter, log_files

from .test_decision_log import pending
from .test_decision_log_faults import lines_on_disk, wait_settled, warnings

pytestmark = pytest.mark.timeout(120)

# A record's line is about 1,050 bytes: with max_bytes=4096 a file takes 4 records.


def own_files(w: DecisionLogWriter, directory: Path) -> list[Path]:
    return [p for p in sorted(directory.iterdir()) if p.name.startswith("decisions-") and p.stat().st_uid == os.getuid()
            and not p.is_symlink() and p.name != "decisions-999999.jsonl"]


def submit(w: DecisionLogWriter, start: int, n: int) -> None:
    for i in range(start, start + n):
        assert w.submit(pending(i))
        wait_settled(w, i + 1)  # one batch per record: every rotation happens at a known record


def test_a_symlink_planted_at_the_next_name_leaves_its_target_untouched(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="router.decision_log")
    log_dir, outside = tmp_path / "log", tmp_path / "precious.txt"
    log_dir.mkdir()
    outside.write_text("keep me\n")
    w = DecisionLogWriter(log_dir, max_bytes=4096, keep=10)
    w.start()
    assert w.current_path.name == "decisions-000001.jsonl"
    (log_dir / "decisions-000002.jsonl").symlink_to(outside)  # where the writer goes next
    (log_dir / "decisions-000003.jsonl").symlink_to(tmp_path / "dangling")  # and a dangling one after it
    submit(w, 0, 20)
    w.close()
    assert outside.read_text() == "keep me\n" and not (tmp_path / "dangling").exists()
    assert (log_dir / "decisions-000002.jsonl").is_symlink() and (log_dir / "decisions-000003.jsonl").is_symlink()
    ids = [r["id"] for p in log_files(log_dir) if not p.is_symlink()
           for r in map(json.loads, p.read_text().splitlines())]
    assert ids == [f"req-{i}" for i in range(20)] and w.written == 20 and w.dropped == {}
    d = w.describe()
    assert d["files_refused"] == 2 and d["rotation_errors"] == 0
    assert [x for x in warnings(caplog) if "exists" in x and "decisions-000002" in x], warnings(caplog)
    assert len(warnings(caplog)) == 1, warnings(caplog)  # one line, not one per refused name


def test_planted_high_numbered_files_are_not_rotated_out_and_the_routers_own_files_stay_complete(tmp_path):
    w = DecisionLogWriter(tmp_path, max_bytes=4096, keep=3)
    w.start()
    submit(w, 0, 2)
    planted = tmp_path / "decisions-999999.jsonl"
    planted.write_text('{"planted": true}\n')
    (tmp_path / "decisions-999998.jsonl").symlink_to(tmp_path / "decisions-999999.jsonl")
    submit(w, 2, 7)  # into files 1 to 3 (4, 4, 1 records): rotation counts 3 files, all of them the writer's
    assert w.current_path.exists() and os.fstat(w._fd).st_nlink == 1  # it writes to a file with a name
    w.close()
    assert planted.read_text() == '{"planted": true}\n' and (tmp_path / "decisions-999998.jsonl").is_symlink()
    mine = own_files(w, tmp_path)
    assert [p.name for p in mine] == ["decisions-000001.jsonl", "decisions-000002.jsonl", "decisions-000003.jsonl"]
    lines = [r["id"] for p in mine for r in map(json.loads, p.read_text().splitlines())]
    assert lines == [f"req-{i}" for i in range(9)] and w.written == 9  # records written = lines on disk
    assert w.describe()["rotation_errors"] == 0


def test_keep_rotates_out_the_writers_oldest_files_only_and_a_restart_numbers_after_the_planted_ones(tmp_path):
    w = DecisionLogWriter(tmp_path, max_bytes=4096, keep=2)
    w.start()
    planted = tmp_path / "decisions-999999.jsonl"
    planted.write_text("x\n")
    submit(w, 0, 12)  # 3 files: the first rotated out, the planted one counted by nothing
    w.close()
    assert planted.read_text() == "x\n"
    assert [p.name for p in own_files(w, tmp_path)] == ["decisions-000002.jsonl", "decisions-000003.jsonl"]
    assert [r["id"] for r in lines_on_disk_except(tmp_path, planted)] == [f"req-{i}" for i in range(4, 12)]
    # a restart never appends to a file: it numbers after the highest name there
    w2 = DecisionLogWriter(tmp_path, max_bytes=4096, keep=2)
    w2.start()
    assert w2.current_path.name == "decisions-1000000.jsonl"
    w2.close()


def lines_on_disk_except(directory: Path, planted: Path) -> list[dict]:
    return [json.loads(line) for p in log_files(directory) if p != planted for line in p.read_text().splitlines()]


def test_a_file_replaced_under_an_old_name_is_left_alone_and_counted(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="router.decision_log")
    w = DecisionLogWriter(tmp_path, max_bytes=4096, keep=2)
    w.start()
    first = w.current_path
    submit(w, 0, 5)  # file 1 full, file 2 current
    first.unlink()
    first.write_text("someone else's\n")  # same name, another file
    submit(w, 5, 4)  # rotation to file 3 would delete file 1: it is not the writer's any more
    w.close()
    assert first.read_text() == "someone else's\n"
    assert w.describe()["rotation_errors"] == 1 and len(warnings(caplog)) == 1


def test_a_current_file_deleted_by_someone_else_is_noticed_counted_and_replaced(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="router.decision_log")
    w = DecisionLogWriter(tmp_path, max_bytes=1 << 20, keep=10)
    w.start()
    submit(w, 0, 2)
    w.current_path.unlink()
    submit(w, 2, 3)
    w.close()
    assert w.describe()["files_lost"] == 1 and len(warnings(caplog)) == 1
    assert [r["id"] for r in lines_on_disk(tmp_path)] == ["req-2", "req-3", "req-4"]
