"""The router's own tokenizer (`--tokenizer`): what the request path pays for an 8k-token prompt's prefix blocks.

A cache miss decides on the prompt's first 512 characters (tokenized on the path) and hands its longest
512 x 2^k-character prefix to the background thread (HF `tokenizers`); a hit (the same system prompt again) looks it up. Prints p50 / p99 of what the request
path pays on a miss and on a hit, for chat (the template rendered on the path) and completions; the background
tokenization's own time; and a hit's latency while the background thread tokenizes (does it hold the GIL?).

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


def ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.3f} ms p99 {pct(xs, 0.99) * 1e3:.3f} ms"


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
        def body(i: int) -> dict:
            return ({"prompt": f"{i} " + text + " question?"} if kind == "completion" else
                    {"messages": [{"role": "system", "content": f"{i} " + text}, {"role": "user", "content": "q?"}]})

        chat = kind == "chat"
        background: list[float] = []
        pb = PromptBlocks(lambda: 16, local, observe=lambda source, s: background.append(s))
        warm = body(-1)
        pb.of(warm, chat)
        pb.drain()
        miss, hit, during = [], [], []
        for i in range(args.n):
            t0 = time.perf_counter()
            blocks = pb.of(body(i), chat)
            miss.append(time.perf_counter() - t0)
            assert blocks  # its head's blocks; the long prefix goes to the background thread
            for _ in range(3):  # another prompt's hits while the background thread tokenizes this one
                t0 = time.perf_counter()
                pb.of(warm, chat)
                during.append(time.perf_counter() - t0)
            pb.drain()
            t0 = time.perf_counter()
            blocks = pb.of(body(i), chat)
            hit.append(time.perf_counter() - t0)
            assert blocks
        print(f"{kind:10s} request path: miss p50 {ms(miss)} | hit p50 {ms(hit)} | hit while the background "
              f"tokenizes p50 {ms(during)}")
        print(f"{'':10s} background tokenization (off the path): p50 {ms(background)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
