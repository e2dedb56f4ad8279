"""The router's own tokenizer (`--tokenizer`) on the request path: latency of an 8k-token prompt's prefix blocks.

A cache miss tokenizes the prompt's longest 512 x 2^k-character prefix (HF `tokenizers`); a hit (the same system
prompt again) looks it up. Prints p50 / p99 of both, for chat (the template rendered first) and completions.

    .venv/bin/python tests/bench/tokenize_latency.py [--model-dir DIR] [--tokens 8192] [--n 200]

Without --model-dir it writes the tiny test model's tokenizer (needs `transformers`, as in the vLLM venv) or reuses
one under /tmp/routewise-tokenizer.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from routewise_vllm.router.kv.prompt_tokens import LocalTokenizer, PromptBlocks  # noqa: E402


def model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    out = Path("/tmp/routewise-tokenizer")
    if not (out / "tokenizer.json").exists():
        from routewise_vllm.fleet.vllm import ensure_tiny_model, vllm_python

        python = vllm_python()
        if python is None:
            raise SystemExit("give --model-dir (a folder with tokenizer.json), or install the vLLM venv")
        ensure_tiny_model(out, python)
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()
    local = LocalTokenizer(model_dir(args.model_dir))
    rng = random.Random(0)
    words = ["router", "replica", "cache", "prefix", "token", "model", "latency", "queue", "block", "stream"]
    text = ""
    while len(local.completion_ids(text)) < args.tokens:
        text += " ".join(rng.choice(words) for _ in range(500)) + " "
    print(f"prompt: {len(text)} characters, {len(local.completion_ids(text))} tokens")
    for kind in ("completion", "chat"):
        miss, hit = [], []
        for i in range(args.n):
            pb = PromptBlocks(lambda: 16, local)  # a fresh cache: every first call a miss
            body = ({"prompt": f"{i} " + text + " question?"} if kind == "completion" else
                    {"messages": [{"role": "system", "content": f"{i} " + text}, {"role": "user", "content": "q?"}]})
            chat = kind == "chat"
            t0 = time.perf_counter()
            blocks = pb.of(body, chat)
            miss.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            pb.of(body, chat)
            hit.append(time.perf_counter() - t0)
            assert blocks
        print(f"{kind:10s} miss p50 {statistics.median(miss) * 1e3:.2f} ms p99 {pct(miss, 0.99) * 1e3:.2f} ms | "
              f"hit p50 {statistics.median(hit) * 1e6:.0f} us p99 {pct(hit, 0.99) * 1e6:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
