"""Readers for the public LLM traces shipped in `simulator/data/traces/` and the train/eval split over them.

Where traces are found (one lookup order): an explicit folder (`TraceLibrary(root=...)`, the
`--traces-dir` flag, or `$ROUTEWISE_TRACES_DIR`), else the gzip-compressed copy shipped as package data.
In an explicit folder each file may be plain or gzip-compressed (`<name>.gz`); both are read directly.

Formats (see `simulator/data/traces/README.md`):
- Azure 2023 CSV `TIMESTAMP,ContextTokens,GeneratedTokens`; TIMESTAMP is a naive wall clock with up to
  7 fractional digits. It is parsed exactly, as integer 100 ns ticks, and made relative to the first row.
- Mooncake JSONL `{"timestamp": ms, "input_length", "output_length", "hash_ids"}`; `hash_ids` are
  512-token prefix blocks. The conversation trace's timestamps are quantised to ~3 s buckets; replay
  spreads the arrivals of a bucket uniformly over `[t, t + bucket_s)` with the caller's seeded RNG
  (see `spread_in_buckets`), so a bucket is never left and a seed reproduces the same arrivals.
- arXiv summarization lengths CSV `num_prefill_tokens,num_decode_tokens,...`: lengths only.

A malformed row raises `TraceError` naming file, line, field and value. `on_error="warn"` skips such
rows instead, with one warning that counts them, and records the messages in `Trace.skipped`.

Over 400 lines on purpose: three strict readers (each validating every field with one error shape), the
train/eval split, and the one lookup order of where traces live belong together; split, they would share
private helpers across modules.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import os
import re
import warnings
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import date
from pathlib import Path
from typing import IO, Callable, Literal

import numpy as np

OnError = Literal["raise", "warn"]

TRACES_DIR_ENV = "ROUTEWISE_TRACES_DIR"
SHIPPED_TRACES_DIR = Path(__file__).resolve().parent / "data" / "traces"
TRACES_DIR_HELP = f"read traces from this folder (default: ${TRACES_DIR_ENV}, else the copy shipped with routewise)"

# Train and tune only on timestamps < 2400 s after a trace's first request (600 s for Mooncake
# synthetic); the rest is evaluation. Untimed (lengths-only) traces are split by row: the first 70 %
# of rows train, the rest evaluate.
TRAIN_WINDOW: tuple[float, float] = (0.0, 2400.0)
MOONCAKE_SYNTHETIC_TRAIN_WINDOW: tuple[float, float] = (0.0, 600.0)
UNTIMED_TRAIN_FRACTION = 0.7
# Mooncake evaluation requests continue prefix chains that began earlier: replay this much before the window.
WARMUP_S = 600.0
WARMUP_TENANT = "warmup"

Split = Literal["train", "eval"]


class TraceError(ValueError):
    """A trace file that cannot be read as its format says; the message names file, line, field, value."""


def traces_dir() -> Path:
    """The folder traces are read from: `$ROUTEWISE_TRACES_DIR` when set, else the shipped copy."""
    env = os.environ.get(TRACES_DIR_ENV)
    return Path(env) if env else SHIPPED_TRACES_DIR


def use_traces_dir(folder: str | Path) -> None:
    """Point every later trace lookup in this process (and its children) at `folder`: a CLI's
    `--traces-dir`. Fails now, naming the flag, when the folder does not exist."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise TraceError(f"--traces-dir {folder}: no such folder (omit the flag to use the traces shipped with routewise)")
    os.environ[TRACES_DIR_ENV] = str(path.resolve())


@contextmanager
def _open_text(path: Path) -> Iterator[IO[str]]:
    """`path` as text, gunzipped on the fly when it ends in `.gz`; a corrupt or truncated file is a
    TraceError naming it (the partial rows read so far are discarded by the caller's exception)."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8", newline="") as f:
            yield f
    except (EOFError, gzip.BadGzipFile, zlib.error, UnicodeDecodeError) as e:
        raise TraceError(
            f"{path}: corrupt or truncated file ({type(e).__name__}: {e}); replace it with an intact copy"
            + (f" or unset {TRACES_DIR_ENV} to use the shipped traces" if os.environ.get(TRACES_DIR_ENV) else "")
        ) from None


@dataclass(frozen=True)
class Trace:
    """Parsed requests of one trace, in arrival order.

    `arrival_s` is relative to the trace's first request (None for lengths-only traces);
    `block_ids[i]` are the request's prefix block ids (empty tuples when the format has none).
    `bucket_s` > 0 means timestamps are quantised to buckets of that width.
    """

    name: str
    path: Path
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    arrival_s: np.ndarray | None = None
    block_ids: tuple[tuple[int, ...], ...] = ()
    block_tokens: int = 512
    bucket_s: float = 0.0
    skipped: tuple[str, ...] = field(default=(), repr=False)

    def __len__(self) -> int:
        return len(self.prompt_tokens)

    @property
    def timed(self) -> bool:
        return self.arrival_s is not None

    @property
    def duration_s(self) -> float:
        if self.arrival_s is None or len(self.arrival_s) == 0:
            return 0.0
        return float(self.arrival_s[-1] - self.arrival_s[0])

    def select(self, index: np.ndarray) -> Trace:
        """The rows at `index` (a boolean mask or sorted integer indices)."""
        idx = np.flatnonzero(index) if index.dtype == bool else np.asarray(index)
        return replace(
            self,
            prompt_tokens=self.prompt_tokens[idx],
            output_tokens=self.output_tokens[idx],
            arrival_s=None if self.arrival_s is None else self.arrival_s[idx],
            block_ids=tuple(self.block_ids[i] for i in idx) if self.block_ids else (),
        )

    def window(self, start_s: float, end_s: float) -> Trace:
        """Requests with (raw, unspread) timestamps in `[start_s, end_s)`; lengths-only traces: row fractions."""
        if self.arrival_s is None:
            raise TraceError(f"{self.path.name}: has no timestamps; use split_rows() for a lengths-only trace")
        return self.select((self.arrival_s >= start_s) & (self.arrival_s < end_s))

    def split_rows(self, split: Split) -> Trace:
        cut = int(len(self) * UNTIMED_TRAIN_FRACTION)
        idx = np.arange(cut) if split == "train" else np.arange(cut, len(self))
        return self.select(idx)


def spread_in_buckets(raw_s: np.ndarray, bucket_s: float, rng: np.random.Generator) -> np.ndarray:
    """Spread quantised timestamps uniformly inside their bucket `[t, min(t + bucket_s, next bucket))`, so
    buckets keep their order and a seed reproduces the result; sorted. `bucket_s == 0`: unchanged."""
    if bucket_s <= 0 or len(raw_s) == 0:
        return raw_s.astype(float, copy=True)
    distinct = np.unique(raw_s)
    nxt = np.append(distinct[1:], distinct[-1] + bucket_s)
    width = np.minimum(bucket_s, nxt - distinct)[np.searchsorted(distinct, raw_s)]
    return np.sort(raw_s + rng.uniform(0.0, 1.0, size=len(raw_s)) * width, kind="stable")


class _RowErrors:
    """Raise on the first bad row, or collect them (on_error='warn')."""

    def __init__(self, path: Path, on_error: OnError) -> None:
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
        self.path, self.on_error, self.messages = path, on_error, []

    def report(self, line: int, message: str) -> None:
        text = f"{self.path.name}:{line}: {message}"
        if self.on_error == "raise":
            raise TraceError(text)
        self.messages.append(text)

    def finish(self) -> tuple[str, ...]:
        if self.messages:
            warnings.warn(
                f"{self.path.name}: skipped {len(self.messages)} malformed row(s); first: {self.messages[0]}",
                stacklevel=3,
            )
        return tuple(self.messages)


class _BadField(Exception):
    def __init__(self, name: str, expected: str, value: object) -> None:
        shown = json.dumps(value) if isinstance(value, str) else repr(value)
        super().__init__(f"field {name!r}: expected {expected}, got {shown}")


def _int_field(name: str, raw: object, minimum: int = 0) -> int:
    """`raw` (an int, or text of one) as an int >= minimum; the error shows `raw` as read."""
    value = raw
    if isinstance(raw, str) and re.fullmatch(r"[+-]?\d+", raw.strip()):
        value = int(raw)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "positive" if minimum == 1 else "non-negative"
        raise _BadField(name, f"{kind} int", raw)
    return value


# Azure timestamps: 'YYYY-MM-DD HH:MM:SS[.fffffff]' (up to 7 fractional digits = 100 ns ticks).
_AZURE_TS = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,7}))?")
_TICKS_PER_S = 10_000_000


def _azure_ticks(value: str) -> int:
    m = _AZURE_TS.fullmatch(value.strip())
    if m is None:
        raise _BadField("TIMESTAMP", "'YYYY-MM-DD HH:MM:SS.fffffff'", value)
    y, mo, d, h, mi, s, frac = m.groups()
    try:
        days = date(int(y), int(mo), int(d)).toordinal()
    except ValueError:
        raise _BadField("TIMESTAMP", "a valid calendar date", value) from None
    if int(h) > 23 or int(mi) > 59 or int(s) > 59:
        raise _BadField("TIMESTAMP", "a valid time of day", value)
    seconds = ((days * 24 + int(h)) * 60 + int(mi)) * 60 + int(s)
    return seconds * _TICKS_PER_S + int((frac or "0").ljust(7, "0"))


def _check_header(path: Path, got: list[str] | None, want: list[str]) -> None:
    if got is None:
        raise TraceError(f"{path.name}:1: empty file, expected header {','.join(want)}")
    if [c.strip() for c in got[: len(want)]] != want:
        raise TraceError(f"{path.name}:1: expected header starting {','.join(want)}, got {','.join(got)!r}")


def read_azure_csv(path: str | Path, on_error: OnError = "raise", name: str | None = None) -> Trace:
    """Azure LLM inference trace 2023 (`TIMESTAMP,ContextTokens,GeneratedTokens`)."""
    path = Path(path)
    errors = _RowErrors(path, on_error)
    ticks: list[int] = []
    prompt: list[int] = []
    output: list[int] = []
    with _open_text(path) as f:
        reader = csv.reader(f)
        _check_header(path, next(reader, None), ["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for row in reader:
            line = reader.line_num
            if not row:
                continue  # a blank line is not a row
            try:
                if len(row) != 3:
                    raise _BadField("row", "3 columns", ",".join(row))
                t = _azure_ticks(row[0])
                p = _int_field("ContextTokens", row[1], minimum=1)
                o = _int_field("GeneratedTokens", row[2], minimum=1)
            except _BadField as e:
                errors.report(line, str(e))
                continue
            ticks.append(t)
            prompt.append(p)
            output.append(o)
    return _timed_trace(path, name, ticks, _TICKS_PER_S, prompt, output, None, errors.finish())


def _timed_trace(
    path: Path, name: str | None, times: list[int], units_per_s: float, prompt: list[int], output: list[int],
    blocks: list[tuple[int, ...]] | None, skipped: tuple[str, ...], **extra,
) -> Trace:
    """A Trace in arrival order from parallel per-row lists; `times` in integer units of 1/units_per_s."""
    if not times:
        raise TraceError(f"{path.name}: no requests")
    t = np.asarray(times, dtype=np.int64)
    order = np.argsort(t, kind="stable")
    t = t[order]
    return Trace(
        name=name or _stem(path),
        path=path,
        arrival_s=(t - t[0]) / units_per_s,
        prompt_tokens=np.asarray(prompt, dtype=np.int64)[order],
        output_tokens=np.asarray(output, dtype=np.int64)[order],
        block_ids=tuple(blocks[i] for i in order) if blocks is not None else tuple(() for _ in order),
        skipped=skipped,
        **extra,
    )


MOONCAKE_BLOCK_TOKENS = 512


def _detect_bucket_s(ms: np.ndarray) -> float:
    """Quantisation width of timestamps: > 0 when most rows share a timestamp with another row and
    the distinct timestamps are evenly spaced (the Mooncake conversation trace: ~3 s)."""
    distinct = np.unique(ms)
    if len(distinct) < 3 or len(distinct) > 0.5 * len(ms):
        return 0.0
    gaps = np.diff(distinct)
    step = float(np.median(gaps))
    if step <= 0 or np.mean(np.abs(gaps - step) <= 0.01 * step + 1) < 0.9:
        return 0.0
    return step / 1000.0


def read_mooncake_jsonl(
    path: str | Path, on_error: OnError = "raise", name: str | None = None, bucket_s: float | None = None
) -> Trace:
    """Mooncake FAST'25 trace. `bucket_s=None` detects timestamp quantisation (see `_detect_bucket_s`)."""
    path = Path(path)
    errors = _RowErrors(path, on_error)
    ms: list[int] = []
    prompt: list[int] = []
    output: list[int] = []
    blocks: list[tuple[int, ...]] = []
    with _open_text(path) as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                try:
                    row = json.loads(text)
                except json.JSONDecodeError as e:
                    raise _BadField("row", f"a JSON object ({e.msg})", text.strip()[:80]) from None
                if not isinstance(row, dict):
                    raise _BadField("row", "a JSON object", row)
                for key in ("timestamp", "input_length", "output_length", "hash_ids"):
                    if key not in row:
                        raise _BadField(key, "present", None)
                t = _int_field("timestamp", row["timestamp"])
                p = _int_field("input_length", row["input_length"], minimum=1)
                o = _int_field("output_length", row["output_length"], minimum=1)
                ids = row["hash_ids"]
                if not isinstance(ids, list) or any(isinstance(b, bool) or not isinstance(b, int) for b in ids):
                    raise _BadField("hash_ids", "a list of ints", ids)
                if len(ids) != math.ceil(p / MOONCAKE_BLOCK_TOKENS):
                    raise _BadField(
                        "hash_ids", f"ceil(input_length/{MOONCAKE_BLOCK_TOKENS}) = {math.ceil(p / 512)} ids", len(ids)
                    )
            except _BadField as e:
                errors.report(line, str(e))
                continue
            ms.append(t)
            prompt.append(p)
            output.append(o)
            blocks.append(tuple(ids))
    skipped = errors.finish()
    if bucket_s is None and ms:
        bucket_s = _detect_bucket_s(np.sort(np.asarray(ms, dtype=np.int64), kind="stable"))
    return _timed_trace(path, name, ms, 1000.0, prompt, output, blocks, skipped,
                        block_tokens=MOONCAKE_BLOCK_TOKENS, bucket_s=bucket_s)


def read_lengths_csv(path: str | Path, on_error: OnError = "raise", name: str | None = None) -> Trace:
    """Lengths-only CSV with `num_prefill_tokens,num_decode_tokens` leading columns (vidur format)."""
    path = Path(path)
    errors = _RowErrors(path, on_error)
    prompt: list[int] = []
    output: list[int] = []
    with _open_text(path) as f:
        reader = csv.reader(f)
        header = next(reader, None)
        _check_header(path, header, ["num_prefill_tokens", "num_decode_tokens"])
        for row in reader:
            if not row:
                continue
            try:
                if len(row) != len(header):
                    raise _BadField("row", f"{len(header)} columns", ",".join(row))
                p = _int_field("num_prefill_tokens", row[0], minimum=1)
                o = _int_field("num_decode_tokens", row[1], minimum=1)
            except _BadField as e:
                errors.report(reader.line_num, str(e))
                continue
            prompt.append(p)
            output.append(o)
    skipped = errors.finish()
    if not prompt:
        raise TraceError(f"{path.name}: no requests")
    return Trace(
        name=name or _stem(path),
        path=path,
        prompt_tokens=np.asarray(prompt, dtype=np.int64),
        output_tokens=np.asarray(output, dtype=np.int64),
        skipped=skipped,
    )


def _stem(path: Path) -> str:
    """`conv.csv.gz` -> `conv`, `conv.csv` -> `conv`."""
    return Path(path.name.removesuffix(".gz")).stem


@dataclass(frozen=True)
class TraceSource:
    relative_path: str  # as published; the shipped copy adds `.gz`
    reader: Callable[..., Trace]
    train_window: tuple[float, float] | None  # None: lengths only, split by rows
    requests: int  # rows in the published file
    sha256: str  # of the published (uncompressed) bytes: the shipped copy must gunzip to exactly these


KNOWN_TRACES: dict[str, TraceSource] = {
    "azure-conv": TraceSource(
        "azure_llm_2023/AzureLLMInferenceTrace_conv.csv", read_azure_csv, TRAIN_WINDOW,
        19_366, "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8",
    ),
    "azure-code": TraceSource(
        "azure_llm_2023/AzureLLMInferenceTrace_code.csv", read_azure_csv, TRAIN_WINDOW,
        8_819, "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6",
    ),
    "mooncake-conversation": TraceSource(
        "mooncake_fast25/conversation_trace.jsonl", read_mooncake_jsonl, TRAIN_WINDOW,
        12_031, "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
    ),
    "mooncake-synthetic": TraceSource(
        "mooncake_fast25/synthetic_trace.jsonl", read_mooncake_jsonl, MOONCAKE_SYNTHETIC_TRAIN_WINDOW,
        3_993, "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
    ),
    "arxiv-lengths": TraceSource(
        "arxiv_summarization_lengths/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv", read_lengths_csv, None,
        28_257, "9d3580538d915ca75e4aaaa54590b42dbb17abc6d74c8913310cf07c232adcdc",
    ),
}


def trace_path(name: str, root: str | Path | None = None) -> Path:
    """The file `name` is read from. An explicit `root` (else `$ROUTEWISE_TRACES_DIR`) must exist and hold the
    published file, plain or `.gz`; without either, the shipped compressed copy. Errors say what to set."""
    source = _source(name)
    env = os.environ.get(TRACES_DIR_ENV)
    if root is None and not env:
        return SHIPPED_TRACES_DIR / f"{source.relative_path}.gz"
    folder = Path(root if root is not None else env).expanduser()  # type: ignore[arg-type]
    where = f"traces folder {folder}" if root is not None else f"{TRACES_DIR_ENV}={env}"
    fix = "point it at a folder laid out like the shipped one, or leave it unset to use the traces shipped with routewise"
    if not folder.is_dir():
        raise TraceError(f"{where}: no such folder; {fix}")
    for candidate in (folder / source.relative_path, folder / f"{source.relative_path}.gz"):
        if candidate.is_file():
            return candidate
    raise TraceError(f"{where}: trace {name!r} not found (looked for {source.relative_path}[.gz]); {fix}")


def split_window(name: str, split: Split) -> tuple[float, float] | None:
    """The `[start, end)` seconds a split may use for a known timed trace (None for lengths-only traces)."""
    source = _source(name)
    if source.train_window is None:
        return None
    if split == "train":
        return source.train_window
    if split == "eval":
        return (source.train_window[1], math.inf)
    raise ValueError(f"unknown split {split!r}; known: train, eval")


def needs_warmup(name: str) -> bool:
    """Traces whose requests continue prefix chains from earlier ones (replay WARMUP_S before a window)."""
    return name.startswith("mooncake-")


def _source(name: str) -> TraceSource:
    if name not in KNOWN_TRACES:
        raise KeyError(f"unknown trace {name!r}; known: {', '.join(KNOWN_TRACES)}")
    return KNOWN_TRACES[name]


class TraceLibrary:
    """Parses each known trace once per instance (pass one library around instead of re-parsing)."""

    def __init__(self, root: str | Path | None = None, on_error: OnError = "raise") -> None:
        self.root = Path(root) if root is not None else None  # None: $ROUTEWISE_TRACES_DIR, else the shipped copy
        self.on_error = on_error
        self._cache: dict[str, Trace] = {}

    def load(self, name: str) -> Trace:
        if name not in self._cache:
            path = trace_path(name, self.root)
            self._cache[name] = _source(name).reader(path, on_error=self.on_error, name=name)
        return self._cache[name]

    def split(self, name: str, split: Split) -> Trace:
        """The requests of `name` that `split` may use (timed: the split's window; untimed: its rows)."""
        trace = self.load(name)
        window = split_window(name, split)
        return trace.split_rows(split) if window is None else trace.window(*window)
