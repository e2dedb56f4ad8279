"""Hold a GPU profile of the simulator against that GPU: time a Llama-shaped forward pass per engine iteration.

The simulator's GPU profiles (`simulator/profiles/*.yaml`) turn an iteration's prefill tokens, decode
sequences and context tokens into seconds with a roofline whose efficiencies (prefill MFU, decode bandwidth
utilisation) were estimates. This script measures them where a GPU is at hand: it builds the profile's model
shape with random bf16 weights (no checkpoint, no download), runs the iterations a vLLM engine runs (one
prompt's prefill; B decode sequences over a KV cache of c tokens each; both mixed, as chunked prefill does)
as whole CUDA graphs, times them with CUDA events, and prints measured vs profile time per iteration, the
achieved TFLOP/s and bandwidth, and the efficiencies refitted by `simulator.costmodel.fit` on the timings.

What it is not: vLLM. There is no scheduler, sampler or detokeniser, so the profile's fixed per-iteration CPU
overhead (`overhead_s`) is not measured and is left out of the compared times; rotary embedding is left out
(elementwise, under 1 % of an iteration); attention is PyTorch's scaled_dot_product_attention (flash kernels)
over a contiguous per-sequence cache, which reads the same bytes as vLLM's paged cache. The GEMMs are cuBLAS,
as in vLLM. So the measured time is what the profile's roofline part should predict, and a lower bound for vLLM.

    python tests/bench/gpu_roofline.py [--profile llama3-8b-h100] [--out DIR]          # on a GPU machine, ~1 min
    python tests/bench/gpu_roofline.py --device cpu --tiny                               # the same code, a tiny shape
    python tests/bench/gpu_roofline.py --report simulator/profiles/measured/llama3-8b-h100-measured.yaml  # no GPU

Never needed by the project: the router, simulator and tests run without a GPU; this only checks a profile.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from routewise_vllm.simulator.costmodel import Profile, load_profile  # noqa: E402

GIB = 1024**3


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @property
    def params(self) -> int:
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (qkv + o + mlp + 2 * self.hidden) + 2 * self.vocab * self.hidden + self.hidden


@dataclass(frozen=True)
class Probe:
    prefill: int  # tokens of one prompt prefilled in this iteration (0: none)
    decodes: int  # sequences decoding one token each
    context: int  # tokens already cached per decoding sequence

    @property
    def label(self) -> str:
        parts = []
        if self.prefill:
            parts.append(f"prefill {self.prefill}")
        if self.decodes:
            parts.append(f"decode {self.decodes} x ctx {self.context}")
        return " + ".join(parts)

    def simulator_args(self) -> tuple[int, int, int, float, int]:
        """(prefill tokens, decode seqs, context tokens, attention pairs, prefill seqs) as simulator/replica.py
        passes them to the cost model for this iteration."""
        ctx = self.decodes * (self.context + 1) + self.prefill
        attn = self.prefill * (0.5 * self.prefill)
        return self.prefill, self.decodes, ctx, attn, 1 if self.prefill else 0


def shape_for(profile: Profile, intermediate: int, vocab: int) -> Shape:
    return Shape(
        layers=profile.layers,
        hidden=profile.hidden,
        heads=profile.hidden // profile.head_dim,
        kv_heads=profile.kv_heads,
        head_dim=profile.head_dim,
        intermediate=intermediate,
        vocab=vocab,
    )


TINY = Shape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256)


def default_probes(max_cache_tokens: int) -> list[Probe]:
    probes = [Probe(p, 0, 0) for p in (128, 512, 1024, 2048, 4096, 8192)]
    probes += [Probe(0, b, 1024) for b in (1, 8, 32, 64, 128, 256)]
    probes += [Probe(0, b, c) for b, c in ((1, 4096), (1, 8192), (16, 4096), (32, 8192), (64, 4096))]
    probes += [Probe(512, 64, 1024), Probe(2048, 32, 2048), Probe(1024, 128, 1024)]
    return [p for p in probes if p.decodes * (p.context + 1) <= max_cache_tokens]


def tiny_probes() -> list[Probe]:
    return [Probe(16, 0, 0), Probe(64, 0, 0), Probe(0, 2, 32), Probe(0, 8, 64), Probe(32, 4, 32)]


class Model:
    """A Llama-shaped decoder with random weights: fused qkv and gate/up projections, RMSNorm, SiLU-gated MLP,
    grouped-query attention, logits for each sequence's last token only (as vLLM computes them)."""

    def __init__(self, torch, shape: Shape, device: str, dtype) -> None:
        self.torch, self.s, self.device, self.dtype = torch, shape, device, dtype
        g = torch.Generator(device=device).manual_seed(0)

        def w(*dims: int):
            t = torch.empty(*dims, device=device, dtype=dtype)
            return t.normal_(0.0, 1.0 / math.sqrt(dims[0]), generator=g)

        s = shape
        qkv_out = (s.heads + 2 * s.kv_heads) * s.head_dim
        self.layers = [
            dict(
                wqkv=w(s.hidden, qkv_out),
                wo=w(s.heads * s.head_dim, s.hidden),
                wgu=w(s.hidden, 2 * s.intermediate),
                wdown=w(s.intermediate, s.hidden),
                n1=torch.ones(s.hidden, device=device, dtype=dtype),
                n2=torch.ones(s.hidden, device=device, dtype=dtype),
            )
            for _ in range(s.layers)
        ]
        self.embed = w(s.vocab, s.hidden)
        self.norm = torch.ones(s.hidden, device=device, dtype=dtype)
        self.lm_head = w(s.hidden, s.vocab)

    def _rmsnorm(self, x, weight):
        x32 = x.float()
        return (x32 * self.torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(self.dtype) * weight

    def kv_cache(self, probe: Probe):
        s, t = self.s, self.torch
        if not probe.decodes:
            return []
        dims = (probe.decodes, s.kv_heads, probe.context + 1, s.head_dim)
        return [
            (t.randn(dims, device=self.device, dtype=self.dtype), t.randn(dims, device=self.device, dtype=self.dtype))
            for _ in range(s.layers)
        ]

    def iteration(self, tokens, probe: Probe, cache):
        """One engine iteration: the prompt's `prefill` tokens first, then one token per decoding sequence."""
        t, s = self.torch, self.s
        F = t.nn.functional
        P, B, c = probe.prefill, probe.decodes, probe.context
        H, KV, D = s.heads, s.kv_heads, s.head_dim
        G = H // KV
        x = self.embed[tokens]
        for i, L in enumerate(self.layers):
            h = self._rmsnorm(x, L["n1"])
            qkv = h @ L["wqkv"]
            q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
            outs = []
            if P:
                qp = q[:P].view(P, H, D).transpose(0, 1).unsqueeze(0)
                kp = k[:P].view(P, KV, D).transpose(0, 1).unsqueeze(0)
                vp = v[:P].view(P, KV, D).transpose(0, 1).unsqueeze(0)
                op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
                outs.append(op.squeeze(0).transpose(0, 1).reshape(P, H * D))
            if B:
                kc, vc = cache[i]
                kc[:, :, c] = k[P:].view(B, KV, D)
                vc[:, :, c] = v[P:].view(B, KV, D)
                outs.append(decode_attention(F, q[P:].view(B, KV, G, D), kc, vc).reshape(B, H * D))
            attn = outs[0] if len(outs) == 1 else t.cat(outs)
            x = x + attn @ L["wo"]
            h = self._rmsnorm(x, L["n2"])
            gate, up = (h @ L["wgu"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ L["wdown"]
        last = x[P - 1 : P + B] if P else x  # each sequence's last token: the prompt's, then every decode's
        return self._rmsnorm(last, self.norm) @ self.lm_head


def decode_attention(F, q, k_cache, v_cache):
    """Grouped-query attention of one new token per sequence over its cache. q is (B, KV heads, G, D): the G
    query heads that share a KV head attend as G query rows of that head, which is grouped-query attention
    exactly (checked against `enable_gqa` by `self_check`) and lets the flash kernels read each KV head once.
    Measured on an H100 (2026-11-27) against two batched matrix products with a float32 softmax between them,
    this was faster at every probe (7.6 vs 8.6 ms at batch 1, 22 vs 44 ms at batch 256). Its one weak case is
    one sequence with a long context: a sequence's KV head goes to one block, so batch 1 at 8k context takes
    10.4 ms against 7.6 at 1k, where the extra cache is 0.4 ms of bandwidth; vLLM splits long contexts across
    blocks (flash-decoding) and would be faster there."""
    return F.scaled_dot_product_attention(q, k_cache, v_cache)


def self_check(torch, device: str, dtype) -> float:
    """Largest relative error of (a) `decode_attention` against SDPA's own grouped-query path and (b) a mixed
    iteration's logits against the same prefill and decodes run as separate iterations. Fresh random inputs."""
    F = torch.nn.functional
    B, KV, G, D, c = 3, 2, 4, 16, 40
    q = torch.randn(B, KV, G, D, device=device, dtype=dtype)
    k, v = (torch.randn(B, KV, c, D, device=device, dtype=dtype) for _ in range(2))
    ref = F.scaled_dot_product_attention(q.reshape(B, KV * G, 1, D), k, v, enable_gqa=True).reshape(B, KV, G, D)
    errs = [float((decode_attention(F, q, k, v) - ref).float().norm() / ref.float().norm())]
    model = Model(torch, TINY, device, dtype)
    probe = Probe(24, 5, 20)
    cache = model.kv_cache(probe)
    tokens = torch.randint(0, TINY.vocab, (probe.prefill + probe.decodes,), device=device)
    mixed = model.iteration(tokens, probe, cache).float()
    alone = torch.cat([
        model.iteration(tokens[: probe.prefill], Probe(probe.prefill, 0, 0), []),
        model.iteration(tokens[probe.prefill :], Probe(0, probe.decodes, probe.context), cache),
    ]).float()
    errs.append(float((mixed - alone).norm() / alone.norm()))
    return max(errs)


def timed(torch, fn, device: str, warmup: int, reps: int) -> list[float]:
    """Seconds per call: CUDA events around each call on a GPU, perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    out = []
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
    else:
        import time

        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def write_profile(path: Path, profile_name: str, fitted: Profile, summary: dict) -> None:
    """The profile refitted on this GPU's timings, in the roofline form the simulator loads by path: the named
    profile's file with its efficiencies and fixed cost replaced and what was measured beside them."""
    import yaml

    from routewise_vllm.simulator.costmodel import PROFILES_DIR

    doc = yaml.safe_load((PROFILES_DIR / f"{profile_name}.yaml").read_text())
    doc["name"] = f"{profile_name}-measured"
    doc["efficiency"] = {"prefill_mfu": round(fitted.prefill_mfu, 4), "decode_bw_util": round(fitted.decode_bw_util, 4)}
    doc["overhead_s"] = round(fitted.overhead_s, 6)
    doc["measured"] = {
        "by": "tests/bench/gpu_roofline.py (a Llama-shaped forward pass per iteration as CUDA graphs, not vLLM: "
              "overhead_s is the GPU's fixed cost per iteration, without vLLM's scheduler and sampler)",
        "device": summary["device"],
        "date": summary.get("date", ""),
        "ceilings": {k: round(v, 1) for k, v in summary["ceilings"].items()},
        "estimate_median_abs_error": round(summary["median_abs_error"], 4),
        "refit_median_abs_error": round(summary["refit_median_abs_error"], 4),
        "refit_max_abs_error": round(summary["refit_max_abs_error"], 4),
        "iterations": [
            {"prefill": r["prefill"], "decodes": r["decodes"], "context": r["context"], "ms": round(r["measured_ms"], 4)}
            for r in summary["rows"]
        ],
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"# {profile_name} refitted on a measured GPU; see the 'measured' section.\n"
                   + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=120))
    tmp.replace(path)


def measure_probe(torch, model: Model, probe: Probe, device: str, reps: int) -> float:
    cache = model.kv_cache(probe)
    n = probe.prefill + probe.decodes
    tokens = torch.randint(0, model.s.vocab, (n,), device=device)
    if device.startswith("cuda"):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (kernel selection, workspaces) outside the capture
            for _ in range(2):
                model.iteration(tokens, probe, cache)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model.iteration(tokens, probe, cache)
        times = timed(torch, graph.replay, device, warmup=2, reps=reps)
        del graph
    else:
        times = timed(torch, lambda: model.iteration(tokens, probe, cache), device, warmup=1, reps=reps)
    del cache
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the next probe's cache and graph pool need the room
    return statistics.median(times)


def ceilings(torch, device: str) -> dict[str, float]:
    """The two measured ceilings: a large bf16 matrix product (TFLOP/s) and a device-to-device copy (GB/s, bytes
    read plus written)."""
    if not device.startswith("cuda"):
        return {}
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm = statistics.median(timed(torch, lambda: a @ b, device, warmup=3, reps=10))
    src = torch.randn(2 * GIB // 4, device=device)
    dst = torch.empty_like(src)
    cp = statistics.median(timed(torch, lambda: dst.copy_(src), device, warmup=3, reps=10))
    return {"matmul_tflops": 2 * n**3 / mm / 1e12, "copy_gbs": 2 * src.numel() * 4 / cp / 1e9}


def flops_and_bytes(profile: Profile, probe: Probe) -> tuple[float, float]:
    """What the profile's roofline counts for this iteration: FLOPs (matmuls and attention) and bytes read."""
    co = profile.coefficients()
    p, d, ctx, attn, _ = probe.simulator_args()
    return co.flops_per_token * (p + d) + co.attn_flops_per_token_pair * attn, co.weight_bytes + co.kv_bytes_per_token * ctx


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="llama3-8b-h100", help="simulator profile to hold against this GPU")
    ap.add_argument("--intermediate", type=int, default=14336, help="MLP width (Llama-3-8B: 14336)")
    ap.add_argument("--vocab", type=int, default=128256, help="vocabulary size (Llama-3-8B: 128256)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (2 layers, hidden 64) to check the code anywhere")
    ap.add_argument("--reps", type=int, default=10, help="timed replays per probe (median reported)")
    ap.add_argument("--max-cache-gib", type=float, default=36.0, help="skip probes whose KV cache is larger")
    ap.add_argument("--out", type=Path, help="write roofline.json and PROFILE-measured.yaml (the refit) here")
    ap.add_argument("--report", type=Path, metavar="MEASURED.yaml",
                    help="no GPU: report again from the iterations a measured profile records (e.g. "
                         "simulator/profiles/measured/llama3-8b-h100-measured.yaml)")
    args = ap.parse_args(argv)
    profile = load_profile(args.profile)
    if args.report:
        device_name, date, ceil, rows = recorded(args.report)
        shape = shape_for(profile, args.intermediate, args.vocab)
        print(f"# recorded in {args.report}: {device_name}, {date}; profile {profile.name} ({profile.gpu_name})")
    else:
        measured = measure(args, profile)
        if isinstance(measured, int):
            return measured
        device_name, shape, ceil, rows = measured
        date = datetime.date.today().isoformat()
    summary, fitted = report(profile, rows, ceil, tiny=args.tiny)
    summary |= dict(device=device_name, date=date, shape=asdict(shape))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "roofline.json").write_text(json.dumps(summary, indent=2))
        if not args.tiny:
            write_profile(args.out / f"{profile.name}-measured.yaml", args.profile, fitted, summary)
    return 0


def recorded(path: Path) -> tuple[str, str, dict, list[tuple[Probe, float]]]:
    """(device, date, ceilings, timed probes) recorded in a measured profile's `measured` section."""
    import yaml

    doc = yaml.safe_load(Path(path).read_text())
    m = doc.get("measured") if isinstance(doc, dict) else None
    if not isinstance(m, dict) or not m.get("iterations"):
        raise SystemExit(f"error: {path}: no measured.iterations (write one with --out on a GPU)")
    rows = [(Probe(int(it["prefill"]), int(it["decodes"]), int(it["context"])), float(it["ms"]) / 1e3) for it in m["iterations"]]
    return str(m.get("device", "?")), str(m.get("date", "?")), dict(m.get("ceilings") or {}), rows


def measure(args: argparse.Namespace, profile: Profile):
    """Build the model on the device, check it, time every probe: (device, shape, ceilings, timed probes), or an
    exit status."""
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device (use --device cpu --tiny to check the code)", file=sys.stderr)
        return 2
    shape = TINY if args.tiny else shape_for(profile, args.intermediate, args.vocab)
    if not args.tiny and abs(shape.params / profile.params - 1) > 0.02:
        print(f"error: the shape has {shape.params:.3e} parameters, the profile {profile.params:.3e}: "
              f"give --intermediate/--vocab of {profile.model_name}", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    probes = tiny_probes() if args.tiny else default_probes(int(args.max_cache_gib * GIB // profile.kv_bytes_per_token))
    print(f"# {device_name}; profile {profile.name} ({profile.gpu_name}); shape {asdict(shape)}, {shape.params:.3e} params",
          flush=True)
    err = self_check(torch, args.device, dtype)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    print(f"# self-check: relative error {err:.1e} (tolerance {tolerance:.0e})", flush=True)
    if not err <= tolerance:
        print("error: the model's attention or batching is wrong; no timing taken", file=sys.stderr)
        return 1
    ceil = ceilings(torch, args.device)
    if ceil:
        print(f"# ceilings: bf16 matmul 8192^3 {ceil['matmul_tflops']:.0f} TFLOP/s, copy {ceil['copy_gbs']:.0f} GB/s "
              f"(profile: {profile.peak_flops / 1e12:.0f} TFLOP/s, {profile.hbm_bandwidth / 1e9:.0f} GB/s)", flush=True)
    model = Model(torch, shape, args.device, dtype)
    rows = []
    for i, probe in enumerate(probes, 1):
        t = measure_probe(torch, model, probe, args.device, args.reps)
        rows.append((probe, t))
        print(f"  [{i}/{len(probes)}] {probe.label}: {t * 1e3:.3f} ms", flush=True)
    return device_name, shape, ceil, rows


def _fit_rows(rows: list[tuple[Probe, float]]) -> list[tuple[int, int, int, float, int, float]]:
    """(prefill tokens, decode seqs, context tokens, attention pairs, prefill seqs, seconds): the rows fleet
    calibrate's fits take."""
    return [(p.prefill, p.decodes, *p.simulator_args()[2:], t) for p, t in rows]


def report(profile: Profile, rows: list[tuple[Probe, float]], ceil: dict, tiny: bool = False) -> tuple[dict, Profile]:
    """Print measured vs profile vs refit per iteration and the two cost-model forms' residuals; (the summary,
    the refitted profile)."""
    import numpy as np

    from routewise_vllm.fleet.calibrate_fit import fit_rows

    # both forms as `fleet calibrate` fits them, with their held-out RMS relative errors (the rule that picks a form)
    arr = np.asarray(_fit_rows(rows), dtype=np.float64)
    fits = fit_rows(arr, profile)
    fitted, roofline_rms, linear_rms = fits.roofline, fits.held_out["roofline"], fits.held_out["linear"]
    co, fco = profile.coefficients(), fitted.coefficients()
    table = []
    for probe, t in rows:
        p, d, ctx, attn, nseq = probe.simulator_args()
        predicted = co.iteration_time(p, d, ctx, attn, nseq) - co.overhead_s
        refit = fco.iteration_time(p, d, ctx, attn, nseq)
        flops, nbytes = flops_and_bytes(profile, probe)
        table.append(dict(probe=probe.label, prefill=probe.prefill, decodes=probe.decodes, context=probe.context,
                          measured_ms=t * 1e3, profile_ms=predicted * 1e3, error=predicted / t - 1,
                          refit_ms=refit * 1e3, refit_error=refit / t - 1,
                          tflops=flops / t / 1e12, gbs=nbytes / t / 1e9))
    print()
    if tiny:
        print("(--tiny: a check of the code; its times say nothing about the profile)")
    print(f"{'iteration':34} {'measured ms':>11} {'profile ms':>10} {'error':>7} {'refit ms':>9} {'error':>7} "
          f"{'TFLOP/s':>8} {'GB/s':>6}")
    for r in table:
        print(f"{r['probe']:34} {r['measured_ms']:11.3f} {r['profile_ms']:10.3f} {r['error']:+7.0%} "
              f"{r['refit_ms']:9.3f} {r['refit_error']:+7.0%} {r['tflops']:8.0f} {r['gbs']:6.0f}")
    errs = sorted(abs(r["error"]) for r in table)
    rerrs = sorted(abs(r["refit_error"]) for r in table)
    summary = dict(
        profile=profile.name, ceilings=ceil,
        profile_efficiency=dict(prefill_mfu=profile.prefill_mfu, decode_bw_util=profile.decode_bw_util),
        refit=dict(prefill_mfu=fitted.prefill_mfu, decode_bw_util=fitted.decode_bw_util, overhead_s=fitted.overhead_s),
        median_abs_error=statistics.median(errs), max_abs_error=errs[-1],
        refit_median_abs_error=statistics.median(rerrs), refit_max_abs_error=rerrs[-1],
        held_out_rms_relative_error={"roofline": roofline_rms, "linear": linear_rms}, rows=table,
    )
    print()
    print(f"profile (without its {profile.overhead_s * 1e3:.1f} ms CPU overhead): prefill MFU {profile.prefill_mfu:.2f}, "
          f"decode bandwidth utilisation {profile.decode_bw_util:.2f}; |error| median {summary['median_abs_error']:.0%}, "
          f"max {summary['max_abs_error']:.0%}")
    print(f"refit on these timings: prefill MFU {fitted.prefill_mfu:.2f}, decode bandwidth utilisation "
          f"{fitted.decode_bw_util:.2f}, fixed {fitted.overhead_s * 1e3:.2f} ms; |error| median "
          f"{summary['refit_median_abs_error']:.0%}, max {summary['refit_max_abs_error']:.0%}")
    chosen = "roofline" if roofline_rms < linear_rms else "linear"
    print(f"held-out RMS relative error: roofline {roofline_rms:.3f}, linear form {linear_rms:.3f}: fleet calibrate's rule "
          f"would choose the {chosen}")
    return summary, fitted


if __name__ == "__main__":
    raise SystemExit(main())
