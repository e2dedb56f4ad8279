"""Iteration-time cost model of a vLLM replica: named hardware + model profiles and a roofline.

One engine iteration processes `prefill_tokens` prompt tokens (chunks) and `decode_seqs`
decode tokens while attending over `context_tokens` cached tokens. Its time is

    overhead + max(FLOPs / (peak * mfu), (weight bytes + KV bytes read) / (bandwidth * util))

or, for a profile measured from a live server whose hardware the roofline does not describe (a CPU
server with a tiny model), the measured linear form (`cost_model: {form: linear, ...}`)

    a + b * prefill tokens + c * decode sequences + d * context tokens + e * prefill sequences

(e: a fixed cost per request whose prefill runs in the iteration; on a CPU server it is most of a short
prompt's prefill.) Profiles live in `simulator/profiles/<name>.yaml`; the numbers and their sources are
documented in `simulator/PROFILES.md`. `fit()` refits overhead and efficiencies from
measurements of a real server (`simulator calibrate`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import yaml

PROFILES_DIR = Path(__file__).parent / "profiles"
GIB = 1024**3


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    gpu_name: str
    gpu_count: int  # tensor-parallel degree
    peak_flops: float  # whole replica, FLOP/s
    hbm_bandwidth: float  # whole replica, bytes/s
    memory_bytes: float  # whole replica
    model_name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    bytes_per_param: float
    max_model_len: int
    prefill_mfu: float
    decode_bw_util: float
    overhead_s: float
    activation_reserve_bytes: float  # whole replica
    sources: tuple[str, ...] = ()
    # Measured profiles (`fleet calibrate --server`); None/0 keep the roofline profiles unchanged.
    linear: "LinearCost | None" = None  # replaces the roofline when set
    kv_cache_tokens: int | None = None  # the server's measured KV capacity, instead of the memory budget
    request_overhead_s: float = 0.0  # HTTP + tokenisation before the engine sees a request (adds to TTFT)

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    def num_kv_blocks(self, block_size: int, gpu_memory_utilization: float = 0.9) -> int:
        """KV blocks vLLM would allocate: what is left of the memory budget after weights and activations."""
        if self.kv_cache_tokens is not None:
            return max(1, self.kv_cache_tokens // block_size)
        free = self.memory_bytes * gpu_memory_utilization - self.weight_bytes - self.activation_reserve_bytes
        n = int(free // (block_size * self.kv_bytes_per_token))
        if n <= 0:
            raise ValueError(
                f"profile {self.name}: no memory left for the KV cache at gpu_memory_utilization={gpu_memory_utilization}"
                f" ({self.memory_bytes / GIB:.1f} GiB total, weights {self.weight_bytes / GIB:.1f} GiB)"
            )
        return n

    def coefficients(self) -> "IterationCoefficients":
        if self.linear is not None:
            return self.linear.coefficients()
        return IterationCoefficients(
            overhead_s=self.overhead_s,
            s_per_flop=1.0 / (self.peak_flops * self.prefill_mfu),
            s_per_byte=1.0 / (self.hbm_bandwidth * self.decode_bw_util),
            flops_per_token=2.0 * self.params,
            attn_flops_per_token_pair=4.0 * self.layers * self.hidden,
            weight_bytes=self.weight_bytes,
            kv_bytes_per_token=self.kv_bytes_per_token,
        )

    def iteration_time(
        self, prefill_tokens: int, decode_seqs: int, context_tokens: int, attn_pairs: float = 0.0
    ) -> float:
        return self.coefficients().iteration_time(prefill_tokens, decode_seqs, context_tokens, attn_pairs)


@dataclass(frozen=True, slots=True)
class IterationCoefficients:
    """Precomputed constants of the roofline, the form the replica's hot loop uses."""

    overhead_s: float
    s_per_flop: float
    s_per_byte: float
    flops_per_token: float  # 2 * params (matmuls)
    attn_flops_per_token_pair: float  # 4 * layers * hidden (QK^T and AV per query/key pair)
    weight_bytes: float
    kv_bytes_per_token: float
    # Linear (measured) profiles only, 0 for the roofline: extra seconds per decode sequence and per context token.
    decode_extra_s: float = 0.0
    context_s: float = 0.0
    prefill_seq_s: float = 0.0

    def iteration_time(
        self, prefill_tokens: int, decode_seqs: int, context_tokens: int, attn_pairs: float = 0.0, prefill_seqs: int = 0
    ) -> float:
        """Seconds for one iteration. `attn_pairs` = sum over prefill chunks of n * (past + n/2)."""
        compute = (
            self.flops_per_token * (prefill_tokens + decode_seqs) + self.attn_flops_per_token_pair * attn_pairs
        ) * self.s_per_flop
        if self.decode_extra_s or self.context_s or self.prefill_seq_s:
            compute += self.decode_extra_s * decode_seqs + self.context_s * context_tokens + self.prefill_seq_s * prefill_seqs
        memory = (self.weight_bytes + self.kv_bytes_per_token * context_tokens) * self.s_per_byte
        return self.overhead_s + (compute if compute > memory else memory)


@dataclass(frozen=True, slots=True)
class LinearCost:
    """Measured iteration time a + b * prefill tokens + c * decode seqs + d * context tokens + e * prefill seqs."""

    a_s: float
    b_s_per_prefill_token: float
    c_s_per_decode_seq: float
    d_s_per_context_token: float
    e_s_per_prefill_seq: float = 0.0

    def iteration_time(self, prefill_tokens: int, decode_seqs: int, context_tokens: int, prefill_seqs: int = 0) -> float:
        return (
            self.a_s
            + self.b_s_per_prefill_token * prefill_tokens
            + self.c_s_per_decode_seq * decode_seqs
            + self.d_s_per_context_token * context_tokens
            + self.e_s_per_prefill_seq * prefill_seqs
        )

    def coefficients(self) -> "IterationCoefficients":
        """The linear form as roofline constants whose compute side always wins (the replica's closed form
        handles that case): overhead a, 'FLOPs' b * prefill + c * decode + d * context, no memory side."""
        return IterationCoefficients(
            overhead_s=self.a_s,
            s_per_flop=1.0,
            s_per_byte=0.0,
            flops_per_token=self.b_s_per_prefill_token,
            attn_flops_per_token_pair=0.0,
            weight_bytes=0.0,
            kv_bytes_per_token=0.0,
            decode_extra_s=self.c_s_per_decode_seq - self.b_s_per_prefill_token,
            context_s=self.d_s_per_context_token,
            prefill_seq_s=self.e_s_per_prefill_seq,
        )


_REQUIRED = {
    "gpu": ("name", "count", "peak_bf16_tflops", "hbm_bandwidth_gbs", "memory_gib"),
    "model": ("name", "params", "layers", "hidden", "kv_heads", "head_dim", "bytes_per_param", "max_model_len"),
    "efficiency": ("prefill_mfu", "decode_bw_util"),
}


def known_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def _positive(path: Path, field: str, value: object) -> float:
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{path}: field {field!r} must be a number, got {value!r}") from None
    if not v > 0 or not math.isfinite(v):
        raise ValueError(f"{path}: field {field!r} must be positive and finite, got {value!r}")
    return v


def profile_from_file(path: str | Path) -> Profile:
    path = Path(path)
    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    if isinstance(doc.get("cost_model"), dict) and doc["cost_model"].get("form") == "linear":
        return _measured_profile(path, doc)
    for section, fields in _REQUIRED.items():
        sec = doc.get(section)
        if not isinstance(sec, dict):
            raise ValueError(f"{path}: missing section {section!r}")
        for f in fields:
            if f not in sec:
                raise ValueError(f"{path}: missing field {section}.{f}")
    for f in ("overhead_s", "activation_reserve_gib"):
        if f not in doc:
            raise ValueError(f"{path}: missing field {f!r}")
    g, m, e = doc["gpu"], doc["model"], doc["efficiency"]
    count = int(_positive(path, "gpu.count", g["count"]))
    for f, v in (("efficiency.prefill_mfu", e["prefill_mfu"]), ("efficiency.decode_bw_util", e["decode_bw_util"])):
        if not 0 < float(v) <= 1:
            raise ValueError(f"{path}: field {f!r} must be in (0, 1], got {v!r}")
    overhead = float(doc["overhead_s"])
    if not overhead >= 0:
        raise ValueError(f"{path}: field 'overhead_s' must be >= 0, got {overhead!r}")
    return Profile(
        name=str(doc.get("name", path.stem)),
        gpu_name=str(g["name"]),
        gpu_count=count,
        peak_flops=_positive(path, "gpu.peak_bf16_tflops", g["peak_bf16_tflops"]) * 1e12 * count,
        hbm_bandwidth=_positive(path, "gpu.hbm_bandwidth_gbs", g["hbm_bandwidth_gbs"]) * 1e9 * count,
        memory_bytes=_positive(path, "gpu.memory_gib", g["memory_gib"]) * GIB * count,
        model_name=str(m["name"]),
        params=_positive(path, "model.params", m["params"]),
        layers=int(_positive(path, "model.layers", m["layers"])),
        hidden=int(_positive(path, "model.hidden", m["hidden"])),
        kv_heads=int(_positive(path, "model.kv_heads", m["kv_heads"])),
        head_dim=int(_positive(path, "model.head_dim", m["head_dim"])),
        bytes_per_param=_positive(path, "model.bytes_per_param", m["bytes_per_param"]),
        max_model_len=int(_positive(path, "model.max_model_len", m["max_model_len"])),
        prefill_mfu=float(e["prefill_mfu"]),
        decode_bw_util=float(e["decode_bw_util"]),
        overhead_s=overhead,
        activation_reserve_bytes=float(doc["activation_reserve_gib"]) * GIB * count,
        sources=tuple(str(s) for s in doc.get("sources", ())),
        kv_cache_tokens=_measured_kv(path, doc),
        request_overhead_s=_nonnegative(path, "request_overhead_s", doc.get("request_overhead_s", 0.0)),
    )


def _measured_kv(path: Path, doc: dict) -> int | None:
    """A roofline profile fitted to a live server (`fleet calibrate --server --profile`) keeps the KV capacity the
    server reported (`server.kv_cache_tokens`) instead of the memory budget's estimate."""
    srv = doc.get("server")
    if not isinstance(srv, dict) or srv.get("kv_cache_tokens") is None:
        return None
    return int(_positive(path, "server.kv_cache_tokens", srv["kv_cache_tokens"]))


LINEAR_FIELDS = ("a_s", "b_s_per_prefill_token", "c_s_per_decode_seq", "d_s_per_context_token", "e_s_per_prefill_seq")


def _nonnegative(path: Path, field: str, value: object) -> float:
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{path}: field {field!r} must be a number, got {value!r}") from None
    if not v >= 0 or not math.isfinite(v):
        raise ValueError(f"{path}: field {field!r} must be >= 0 and finite, got {value!r}")
    return v


def _measured_profile(path: Path, doc: dict) -> Profile:
    """A profile measured from a live server (`fleet calibrate --server`): the linear cost form, the
    server's KV capacity and request overhead; the hardware it ran on is not described, so the roofline
    fields are NaN (nothing reads them when `linear` is set)."""
    cm, m, srv = doc["cost_model"], doc.get("model"), doc.get("server")
    if not isinstance(m, dict) or "max_model_len" not in m:
        raise ValueError(f"{path}: missing field model.max_model_len")
    if not isinstance(srv, dict) or "kv_cache_tokens" not in srv:
        raise ValueError(f"{path}: missing field server.kv_cache_tokens")
    for f in LINEAR_FIELDS[:4]:  # e is optional (0)
        if f not in cm:
            raise ValueError(f"{path}: missing field cost_model.{f}")
    linear = LinearCost(*(_nonnegative(path, f"cost_model.{f}", cm.get(f, 0.0)) for f in LINEAR_FIELDS))
    nan = math.nan
    return Profile(
        name=str(doc.get("name", path.stem)),
        gpu_name=str(doc.get("hardware", "measured")),
        gpu_count=1,
        peak_flops=nan,
        hbm_bandwidth=nan,
        memory_bytes=nan,
        model_name=str(m.get("name", "")),
        params=nan,
        layers=0,
        hidden=0,
        kv_heads=0,
        head_dim=0,
        bytes_per_param=nan,
        max_model_len=int(_positive(path, "model.max_model_len", m["max_model_len"])),
        prefill_mfu=nan,
        decode_bw_util=nan,
        overhead_s=linear.a_s,
        activation_reserve_bytes=0.0,
        sources=tuple(str(s) for s in doc.get("sources", ())),
        linear=linear,
        kv_cache_tokens=int(_positive(path, "server.kv_cache_tokens", srv["kv_cache_tokens"])),
        request_overhead_s=_nonnegative(path, "request_overhead_s", doc.get("request_overhead_s", 0.0)),
    )


def load_profile(name: str) -> Profile:
    """A named profile from simulator/profiles/, or a path to a profile YAML file."""
    if name.endswith((".yaml", ".yml")) and Path(name).is_file():
        return profile_from_file(name)
    path = PROFILES_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown hardware profile {name!r}; known: {', '.join(known_profiles())}")
    return profile_from_file(path)


def fit(profile: Profile, measurements: Iterable[Sequence[float]], max_rounds: int = 20) -> Profile:
    """Least-squares refit of overhead, prefill MFU and decode bandwidth utilisation.

    `measurements` rows are (prefill_tokens, decode_seqs, context_tokens, seconds) of single
    iterations of a real server, or (prefill_tokens, decode_seqs, context_tokens, attn_pairs, seconds)
    where the sweep knows each prefill chunk's attention pairs (n * (past + n / 2), as the replica
    counts them; at 8k prompt tokens attention is ~13 % of a Llama-3-8B prefill's FLOPs). The model
    t = o + max(a * FLOPs, c * bytes) is linear in (o, a, c) once each row's bound (compute or memory)
    is known, so we alternate: assign each row to its bound under the current fit, solve linear least
    squares, repeat until the assignment is stable. Rows are weighted by 1/seconds (timing noise is
    relative).
    """
    rows = np.asarray([tuple(map(float, r)) for r in measurements], dtype=np.float64)
    if rows.ndim != 2 or rows.shape[1] not in (4, 5):
        raise ValueError("measurements must be rows of (prefill_tokens, decode_seqs, context_tokens[, attn_pairs], seconds)")
    attn = rows[:, 3] if rows.shape[1] == 5 else np.zeros(len(rows))
    rows = rows[:, [0, 1, 2, -1]]
    if len(rows) < 3:
        raise ValueError(f"need at least 3 measurements to fit 3 parameters, got {len(rows)}")
    if np.any(rows < 0) or not np.all(np.isfinite(rows)):
        raise ValueError("measurements must be finite and non-negative")
    co = profile.coefficients()
    flops = co.flops_per_token * (rows[:, 0] + rows[:, 1]) + co.attn_flops_per_token_pair * attn
    nbytes = co.weight_bytes + co.kv_bytes_per_token * rows[:, 2]
    t = rows[:, 3]
    o, a, c = co.overhead_s, co.s_per_flop, co.s_per_byte
    bound = None
    for _ in range(max_rounds):
        new_bound = a * flops > c * nbytes
        if bound is not None and np.array_equal(new_bound, bound):
            break
        bound = new_bound
        design = np.column_stack([np.ones_like(t), np.where(bound, flops, 0.0), np.where(bound, 0.0, nbytes)])
        cols = [0] + [j for j in (1, 2) if np.any(design[:, j] > 0)]
        scale = design[:, cols].max(axis=0)  # columns span 1 .. 1e13: normalise or the rank cut drops the overhead
        w = 1.0 / np.maximum(t, 1e-9)[:, None]  # relative errors: timing noise scales with the iteration
        sol, *_ = np.linalg.lstsq(design[:, cols] / scale * w, t * w[:, 0], rcond=None)
        fitted = dict(zip(cols, sol / scale))
        o = max(0.0, float(fitted.get(0, o)))
        a = float(fitted.get(1, a)) if fitted.get(1, a) > 0 else a
        c = float(fitted.get(2, c)) if fitted.get(2, c) > 0 else c
    return dataclasses.replace(
        profile,
        overhead_s=o,
        prefill_mfu=min(1.0, 1.0 / (a * profile.peak_flops)),
        decode_bw_util=min(1.0, 1.0 / (c * profile.hbm_bandwidth)),
    )
