"""The metrics folders a killed `router serve --workers N` leaves (/tmp/routewise-metrics-<pid>-*) are removed at
the next start even when their pids live again in other processes: a container's router restarted gets the
same small pid (this very process's), and a busy host reuses pids. A folder is another process's when that
process started after the folder last changed; a live router's folder stays."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from routewise_vllm.router.scale.workers import PID_REUSE_MARGIN_S, clean_stale_metrics_dirs


def _folder(tmp: Path, name: str, files: list[str], age_s: float) -> Path:
    path = tmp / name
    path.mkdir()
    for f in files:
        (path / f).write_bytes(b"")
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_a_folder_named_with_this_processs_own_pid_is_a_dead_routers_when_it_is_older_than_the_process(tmp_path):
    me = os.getpid()
    started_long_before = 30 * 86400.0  # a container restarted: the same pid, the folder of its previous life
    stale = _folder(tmp_path, f"routewise-metrics-{me}-old", [f"counter_{me}.db"], started_long_before)
    assert clean_stale_metrics_dirs(str(tmp_path)) == [stale] and not stale.exists()


def test_a_pid_reused_by_a_process_started_after_the_folder_changed_does_not_keep_it(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pid = other.pid
        stale = _folder(tmp_path, f"routewise-metrics-{pid}-x", [f"counter_{pid}.db"], 3600.0)
        live = _folder(tmp_path, f"routewise-metrics-{pid}-y", [f"counter_{pid}.db"], 0.0)  # made by it: kept
        recent = _folder(tmp_path, f"routewise-metrics-{pid}-z", [], PID_REUSE_MARGIN_S / 2)  # within the margin
        assert clean_stale_metrics_dirs(str(tmp_path)) == [stale]
        assert not stale.exists() and live.is_dir() and recent.is_dir()
    finally:
        other.kill()
        other.wait()
