"""Router overhead benchmark: backend direct vs nginx vs vllm-router vs the routewise router (a script, not a test).

    .venv/bin/python tests/bench/router_bench.py [--duration 20] [--wrk-duration 10] [--workers 1,2]
        [--vllm-router .venv-vr/bin/vllm-router] [--policy least-outstanding] [--json]
    # the learned policy's added latency next to least-outstanding's, in one run:
    .venv/bin/python tests/bench/router_bench.py --policy least-outstanding,learned --replicas 16 --no-wrk
    # what the lean listener (router/http/server.py) saves: each router beside itself with it off
    .venv/bin/python tests/bench/router_bench.py --policy learned --workers 1,2 --aiohttp-listener
    # the latency floor of any Python router here: a bare proxy on raw asyncio protocols, beside the rest
    .venv/bin/python tests/bench/router_bench.py --policy learned --python-floor --no-wrk
    # streamed time to first token too; every proxy on core 1, the load and backend on core 0 (steadier on 2 cores)
    .venv/bin/python tests/bench/router_bench.py --policy learned --stream-latency --no-wrk --proxy-cpus 1 --load-cpus 0
    # this checkout beside an older commit, in one run (each router imports routewise_vllm from its own tree)
    V=$PWD/.venv/bin/python; git worktree add /tmp/before <commit> && (cd /tmp/before && $V setup.py build_ext --inplace)
    .venv/bin/python tests/bench/router_bench.py --policy learned --baseline-tree /tmp/before
    # a fixed amount of work through one router from a given checkout (for a whole-process timer, two trees in turn)
    .venv/bin/python tests/bench/router_bench.py --closed-loop 20000 --tree /tmp/before --proxy-cpus 1
    # what the shared fleet view's 10 ms sync costs the requests: each router beside itself with --shared-state
    .venv/bin/python tests/bench/router_bench.py --policy learned --shared-state --no-wrk

Starts a trivial fast backend (raw asyncio HTTP server answering OpenAI-shaped completions,
streamed or not, plus /health, /metrics, /v1/models), the router in a subprocess per --workers
count (`router serve --workers N --policy least-outstanding`, named routewise-wN), nginx (one
worker, proxy_buffering off) and, with --vllm-router (or .venv-vr/bin/vllm-router when present:
`python -m venv .venv-vr && .venv-vr/bin/pip install vllm-router==0.1.17`), vllm-router
(round_robin) in front of the same backend. Measures
  (a) added latency p50/p99 vs direct at a fixed open-loop rate (default 50 req/s, 20 s), with each proxy's CPU
      time per request over that phase (its process group's, from /proc), and
  (b) max requests/s with wrk, non-streaming and streaming, for direct, nginx and router, and (b') each proxy's
      CPU time per request at that maximum: requests per CPU-second, whatever number of threads a proxy runs.
On a many-core host pin the proxies to the same CPUs and the load elsewhere (--proxy-cpus, --load-cpus, with
--nginx-workers N --workers N, --wrk-threads, --backend-procs: tests/bench/README.md).
With --replicas N the backend also answers on 127.0.0.2 .. 127.0.0.N (loopback) and the routers see N replicas,
so a policy decides among N; with several --policy values each gets its own router (routewise-wN-<policy>).
Everything listens on loopback and runs in its own process group; all are stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from routewise_vllm.fleet.vllm import parse_cpu_list
from routewise_vllm.simulator.late_binding import split_late

REPO = Path(__file__).resolve().parents[2]
BODY = {"model": "tiny", "prompt": "Hello, how are you today? " * 4, "max_tokens": 16}
STREAM_EVENTS = 16



def tree_env(tree: Path, tmp: Path) -> dict[str, str]:
    """The environment in which `routewise_vllm` imports from `tree` (the editable install maps it to the checkout it
    was installed from, whichever tree a router starts in): a PYTHONPATH folder whose routewise_vllm links tree's
    folders. The tree's C extensions must be built there (`python setup.py build_ext --inplace`)."""
    shim = tmp / f"tree-{len(list(tmp.glob('tree-*')))}" / "routewise_vllm"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("")
    for folder in ("router", "simulator", "trainer", "fleet"):
        (shim / folder).symlink_to(tree / folder)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(shim.parent), os.environ.get("PYTHONPATH")]))}


# ----------------------------------------------------------------------------- the backend


def _completion_json() -> bytes:
    return json.dumps({
        "id": "cmpl-b", "object": "text_completion", "created": 0, "model": "tiny",
        "choices": [{"index": 0, "text": " hello" * 16, "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 26, "completion_tokens": 16, "total_tokens": 42},
    }).encode()


def _stream_chunks() -> list[bytes]:
    """The streamed answer's HTTP chunks: one per SSE event, like vLLM's, then the last chunk."""
    parts = []
    for i in range(STREAM_EVENTS):
        ev = json.dumps({"id": "cmpl-b", "object": "text_completion", "created": 0, "model": "tiny",
                         "choices": [{"index": 0, "text": " hello", "logprobs": None,
                                      "finish_reason": "length" if i == STREAM_EVENTS - 1 else None}]}).encode()
        parts.append(b"data: " + ev + b"\n\n")
    parts.append(b"data: [DONE]\n\n")
    return [f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in parts] + [b"0\r\n\r\n"]


def _stream_body() -> bytes:
    return b"".join(_stream_chunks())


METRICS_PAGE = (
    b'vllm:num_requests_running{engine="0",model_name="tiny"} 1.0\n'
    b'vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0\n'
    b'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.1\n'
    b'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n'
)


def _resp(status: str, ctype: bytes, body: bytes) -> bytes:
    return (b"HTTP/1.1 " + status.encode() + b"\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


class Backend(asyncio.Protocol):
    COMPLETION = _resp("200 OK", b"application/json", _completion_json())
    STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n")
    STREAM = STREAM_HEAD + _stream_body()
    STREAM_CHUNKS = _stream_chunks()
    GAP_S = 0.0  # --token-gap-ms: a streamed answer's chunks this far apart, each its own write (0: all at once)
    HEALTH = _resp("200 OK", b"text/plain", b"")
    METRICS = _resp("200 OK", b"text/plain; version=0.0.4", METRICS_PAGE)
    MODELS = _resp("200 OK", b"application/json", b'{"object":"list","data":[{"id":"tiny","object":"model"}]}')
    NOT_FOUND = _resp("404 Not Found", b"text/plain", b"")

    def connection_made(self, transport):
        self.t = transport
        self.buf = b""

    def data_received(self, data):
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            m = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
            n = int(m.group(1)) if m else 0
            if len(self.buf) < end + 4 + n:
                return
            body = self.buf[end + 4:end + 4 + n]
            self.buf = self.buf[end + 4 + n:]
            path = head.split(b" ", 2)[1]
            if path.startswith(b"/v1/completions") or path.startswith(b"/v1/chat"):
                if b'"stream":true' not in body.replace(b" ", b""):
                    self.t.write(self.COMPLETION)
                elif self.GAP_S:
                    self._trickle()
                else:
                    self.t.write(self.STREAM)
            elif path == b"/health":
                self.t.write(self.HEALTH)
            elif path == b"/metrics":
                self.t.write(self.METRICS)
            elif path == b"/v1/models":
                self.t.write(self.MODELS)
            else:
                self.t.write(self.NOT_FOUND)


    def _trickle(self) -> None:
        """The streamed answer as a replica decodes it: the head now, then a token's chunk every GAP_S."""
        self.t.write(self.STREAM_HEAD)
        loop = asyncio.get_running_loop()
        for i, chunk in enumerate(self.STREAM_CHUNKS, 1):
            loop.call_later(self.GAP_S * i, self._send, chunk)

    def _send(self, data: bytes) -> None:
        if not self.t.is_closing():
            self.t.write(data)


def run_backend(port: int, hosts_n: int = 1, reuse_port: bool = False, gap_s: float = 0.0) -> None:
    Backend.GAP_S = gap_s
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass

    async def main():
        hosts = [f"127.0.0.{i}" for i in range(1, hosts_n + 1)]
        server = await asyncio.get_running_loop().create_server(Backend, hosts, port, backlog=1024,
                                                                reuse_port=reuse_port or None)
        async with server:
            await server.serve_forever()

    asyncio.run(main())

# ----------------------------------------------------------------------------- the Python floor


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def run_python_floor(port: int, backend_port: int) -> None:
    """A bare Python proxy (uvloop, raw asyncio protocols, keep-alive upstream, no routing, nothing parsed beyond
    Content-Length framing): what any Python router pays for the two hops on this host, as a yardstick."""
    import uvloop

    idle: list[asyncio.Protocol] = []

    class Upstream(asyncio.Protocol):
        def __init__(self) -> None:
            self.buf, self.client, self.need = b"", None, None

        def connection_made(self, transport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.buf += data
            end = self.buf.find(b"\r\n\r\n")
            if self.need is None and end >= 0:
                self.need = end + 4 + _content_length(self.buf[:end])
            if self.need is not None and len(self.buf) >= self.need:
                out, self.buf, self.need = self.buf[:self.need], self.buf[self.need:], None
                client, self.client = self.client, None
                idle.append(self)
                client.transport.write(out)

    class Client(asyncio.Protocol):
        def __init__(self) -> None:
            self.buf = b""

        def connection_made(self, transport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.buf += data
            end = self.buf.find(b"\r\n\r\n")
            if end >= 0 and len(self.buf) >= (n := end + 4 + _content_length(self.buf[:end])):
                request, self.buf = self.buf[:n], self.buf[n:]
                asyncio.ensure_future(self.forward(request))

        async def forward(self, request: bytes) -> None:
            if idle:
                up = idle.pop()
            else:
                _, up = await asyncio.get_running_loop().create_connection(Upstream, "127.0.0.1", backend_port)
            up.client = self
            up.transport.write(request)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Client, "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(main())

# ----------------------------------------------------------------------------- process helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, path: str = "/health", timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"nothing answered 200 on 127.0.0.1:{port}{path} within {timeout}s")


def wait_tcp(port: int, timeout: float = 30.0) -> None:
    """Until a Redis on the port answers PING."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"no redis-server answered on 127.0.0.1:{port} within {timeout}s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


NGINX_CONF = """
worker_processes {workers};
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy; fastcgi_temp_path {tmp}/fcgi;
  uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
  upstream backend {{ server 127.0.0.1:{backend}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://backend;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_cache off;
    }}
  }}
}}
"""

# ----------------------------------------------------------------------------- measurements


WARMUP = 20  # requests sent before each timed slice, on the same connections


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) the live processes of a process group have used (Linux /proc; clock ticks)."""
    total = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # from the state on: the name may hold spaces
            except OSError:
                continue
            if int(fields[2]) == pgid:
                total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


async def open_loop(url: str, rate: float, duration: float, stream: bool = False) -> list[float]:
    """Latencies (s) of completions sent at fixed intervals, regardless of answers: to the whole answer, or with
    `stream` to the first chunk carrying an SSE `data:` event (the client's time to first token)."""
    import aiohttp

    payload = json.dumps({**BODY, "stream": True} if stream else BODY).encode()
    headers = {"Content-Type": "application/json"}
    lat: list[float] = []
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for _ in range(WARMUP):  # warm up connections
            async with s.post(url, data=payload, headers=headers) as r:
                await r.read()

        async def one():
            t = time.perf_counter()
            first = None
            async with s.post(url, data=payload, headers=headers) as r:
                assert r.status == 200, r.status
                if stream:
                    async for chunk in r.content.iter_any():
                        if first is None and b"data:" in chunk:
                            first = time.perf_counter()
                else:
                    await r.read()
            lat.append((first if stream else time.perf_counter()) - t)

        tasks = []
        t0 = loop.time()
        n = int(rate * duration)
        for i in range(n):
            delay = t0 + i / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return lat


async def closed_loop(port: int, n: int, conns: int) -> float:
    """Seconds for `n` non-streamed completions on `conns` kept-alive connections, each sending its next request once
    its answer is whole (a raw client: little of the host's CPU goes to the load)."""
    payload = json.dumps(BODY).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(payload)) + payload
    left = n

    async def one() -> None:
        nonlocal left
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while left > 0:
            left -= 1
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head[:100]
            await reader.readexactly(_content_length(head))
        writer.close()

    t = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(conns)))
    return time.perf_counter() - t


def run_closed_loop(args: argparse.Namespace) -> int:
    """--closed-loop N: the backend and one router (from --tree), N requests as fast as the router answers them, one
    line of figures; a fixed amount of work per run, so that a whole-process timer can set runs of two trees side by
    side (A B A B)."""
    tmp = Path(tempfile.mkdtemp(prefix="router-bench-"))
    tree = Path(args.tree).resolve()
    pin = ["taskset", "-c", args.proxy_cpus] if args.proxy_cpus else []
    procs: list[subprocess.Popen] = []
    try:
        bport, rport = free_port(), free_port()
        procs.append(subprocess.Popen([sys.executable, __file__, "--backend-only", str(bport)], start_new_session=True))
        wait_port(bport)
        procs.append(subprocess.Popen(
            [*pin, sys.executable, "-m", "routewise_vllm.router", "serve", "--host", "127.0.0.1", "--port", str(rport),
             "--replica", f"http://127.0.0.1:{bport}", "--policy", args.policy, "--log-level", "warning"],
            cwd=tree, start_new_session=True, env={**os.environ, **tree_env(tree, tmp)}))
        wait_port(rport, "/ready")
        asyncio.run(closed_loop(rport, WARMUP * 10, args.connections))
        before = group_cpu_s(procs[-1].pid)
        seconds = asyncio.run(closed_loop(rport, args.closed_loop, args.connections))
        cpu = group_cpu_s(procs[-1].pid) - before
        print(f"closed loop, {tree.name}: {args.closed_loop} requests on {args.connections} connections in {seconds:.2f} s: "
              f"{args.closed_loop / seconds:.0f} req/s, router CPU {cpu / args.closed_loop * 1e6:.1f} us/request")
    finally:
        for p in reversed(procs):
            stop(p)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=1000)[int(q * 1000) - 1]


def wrk_script(tmp: Path, stream: bool) -> Path:
    """wrk's lua script: POST the bench's completion body, streamed or not."""
    script = tmp / f"post_{int(stream)}.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = '{json.dumps(dict(BODY, stream=stream), separators=(',', ':'))}'\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
    )
    return script


def wrk(url: str, stream: bool, duration: int, conns: int, tmp: Path, threads: int = 1, pin: list[str] = ()) -> float:
    script = wrk_script(tmp, stream)
    out = subprocess.run([*pin, "wrk", f"-t{threads}", f"-c{conns}", f"-d{duration}s", "-s", str(script), url],
                         capture_output=True, text=True, check=True).stdout
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    errs = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if errs:
        raise RuntimeError(f"wrk saw {errs.group(1)} error responses from {url}:\n{out}")
    return float(m.group(1))


def paired(urls: tuple[str, str], pgids: tuple[int, int], stream: bool, duration: int, conns: int, tmp: Path,
           pin: list[str] = (), swap: bool = False) -> tuple[float, float]:
    """CPU us per request of two proxies loaded at the same time, one wrk each (`conns` connections each): a
    change against its baseline under the same seconds of the same host, so the host's drift lands on both.
    The wrk started first costs its proxy more CPU per request (two copies of one tree measured 1.5-6 % apart,
    whichever went first): `swap` starts the second first, and the rounds alternate."""
    script = wrk_script(tmp, stream)
    before = [group_cpu_s(g) for g in pgids]
    order = (1, 0) if swap else (0, 1)
    started = {i: subprocess.Popen([*pin, "wrk", "-t1", f"-c{conns}", f"-d{duration}s", "-s", str(script), urls[i]],
                                   stdout=subprocess.PIPE, text=True) for i in order}
    runs = [started[0], started[1]]
    outs = [r.communicate()[0] for r in runs]
    cpu = [group_cpu_s(g) - b for g, b in zip(pgids, before)]
    if any(re.search(r"Non-2xx or 3xx responses", out) for out in outs):
        raise RuntimeError(f"wrk saw error responses in a paired run:\n{outs}")
    done = [int(re.search(r"(\d+) requests in", out).group(1)) for out in outs]
    return cpu[0] / done[0] * 1e6, cpu[1] / done[1] * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=50.0, help="open-loop request rate (req/s)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of open-loop load per target")
    ap.add_argument("--rounds", type=int, default=4, help="the targets take turns in this many slices of the duration")
    ap.add_argument("--wrk-duration", type=int, default=10, help="seconds per wrk run")
    ap.add_argument("--connections", type=int, default=32, help="wrk connections")
    ap.add_argument("--workers", default="1", help="comma-separated router worker counts, one target each (e.g. 1,2)")
    ap.add_argument("--policy", default="least-outstanding",
                    help="routewise policy, or several comma-separated (one router each, same run); NAME+late runs "
                    "NAME behind the router's late binding (what holding costs a request that is never held)")
    ap.add_argument("--replicas", type=int, default=1,
                    help="replicas the routers see (the one backend on 127.0.0.1..N; at most 250)")
    ap.add_argument("--prompt-chars", type=int, default=0, metavar="N",
                    help="a prompt of N characters instead of the 104 of the default body (the router estimates tokens "
                    "and hashes 256-character prefix blocks of it: a 2,000-token prompt is about 8,000)")
    ap.add_argument("--token-gap-ms", type=float, default=0.0, metavar="MS",
                    help="the backend writes a streamed answer's 17 chunks MS apart, one write each, as a replica "
                    "decodes (default 0: the whole answer in one write); the router then reads each token alone")
    ap.add_argument("--aiohttp-listener", action="store_true",
                    help="also run each router with the lean listener off (ROUTEWISE_LEAN_LISTENER=0: every request "
                    "through aiohttp's server side), named <router>-aiohttp, side by side")
    ap.add_argument("--baseline-tree", metavar="DIR",
                    help="also run each router from another checkout (e.g. `git worktree add DIR <commit>`; its C "
                    "extension built or copied into DIR/router/policy), named <router>-baseline, side by side")
    ap.add_argument("--paired", type=int, default=0, metavar="ROUNDS",
                    help="with --baseline-tree: also (c), each router and its baseline loaded at the same time by one wrk "
                    "each for ROUNDS rounds of --wrk-duration s, CPU per request side by side (give them the same "
                    "CPU: --proxy-cpus 1 --load-cpus 0 on two cores; an even ROUNDS, as the wrk started first "
                    "alternates)")
    ap.add_argument("--python-floor", action="store_true",
                    help="also measure a bare Python proxy (raw asyncio protocols, no routing): the latency floor "
                    "of any Python router on this host, and its max requests/s (non-streaming only: it frames by "
                    "Content-Length)")
    ap.add_argument("--shared-state", action="store_true",
                    help="each router beside itself with --shared-state on a redis-server (the bench starts one, and an "
                    "idle peer router publishing to it): what the shared fleet view's sync costs the requests")
    ap.add_argument("--no-wrk", action="store_true", help="skip (b), the wrk throughput runs")
    ap.add_argument("--stream-latency", action="store_true",
                    help="also (a'): the added time to first token of streamed completions at the same rate, the "
                    "first chunk with an SSE data event (the Python floor is left out: it frames by Content-Length)")
    ap.add_argument("--vllm-router", default=str(REPO / ".venv-vr/bin/vllm-router"),
                    help="vllm-router executable (skipped when absent)")
    ap.add_argument("--nice", type=int, default=0, help="run the proxies under nice -n N (shared machines)")
    ap.add_argument("--nginx-workers", type=int, default=1, help="nginx worker processes (compare N cores with N)")
    ap.add_argument("--wrk-threads", type=int, default=1, help="wrk threads (a many-core host needs more than one)")
    ap.add_argument("--backend-procs", type=int, default=1, help="backend processes sharing its port (SO_REUSEPORT)")
    ap.add_argument("--proxy-cpus", help="pin nginx, vllm-router and the routers to these CPUs (taskset list, e.g. 0-3)")
    ap.add_argument("--load-cpus", help="pin the backend, wrk and this script to these CPUs (e.g. 8-15)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--closed-loop", type=int, metavar="N",
                    help="only this: N requests on --connections connections through one router (from --tree), as fast "
                    "as it answers, and one line of figures (req/s, the router's CPU per request)")
    ap.add_argument("--tree", default=str(REPO), help="with --closed-loop: the checkout the router runs from (its C "
                    "extensions built there)")
    ap.add_argument("--backend-only", type=int, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--floor-only", type=int, nargs=2, metavar=("PORT", "BACKEND_PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.prompt_chars:
        words = "Hello, how are you today? " * (args.prompt_chars // 26 + 1)
        BODY["prompt"] = words[:args.prompt_chars]
    if args.backend_only:
        run_backend(args.backend_only, args.replicas, reuse_port=args.backend_procs > 1, gap_s=args.token_gap_ms / 1e3)
        return 0
    if args.floor_only:
        run_python_floor(*args.floor_only)
        return 0
    if args.closed_loop:
        return run_closed_loop(args)
    if not 1 <= args.replicas <= 250:
        sys.exit(f"--replicas {args.replicas}: must be 1..250")
    policies = args.policy.split(",")
    if args.baseline_tree and not list(Path(args.baseline_tree).glob("router/policy/_fastnet*.so")):
        sys.exit(f"--baseline-tree {args.baseline_tree}: no router/policy/_fastnet*.so there (the learned policy would run "
                 "on onnxruntime): copy the one from router/policy/ or build it in that tree")
    if args.paired and not args.baseline_tree:
        sys.exit("--paired needs --baseline-tree: it loads each router beside its baseline")
    if args.paired and shutil.which("wrk") is None:
        sys.exit("--paired needs wrk (apt-get install wrk)")
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if not args.no_wrk:  # (b) needs wrk, and nginx as the reference of its ratios
        for tool, found in (("nginx", nginx), ("wrk", shutil.which("wrk"))):
            if found is None:
                sys.exit(f"{tool} not found (--no-wrk runs the latency part without wrk, and without nginx's row)")
    elif nginx is None:
        print("nginx not found: its row is left out", file=sys.stderr)

    tmp = Path(tempfile.mkdtemp(prefix="router-bench-"))
    bport, nport = free_port(), free_port()
    nice = ["nice", "-n", str(args.nice)] if args.nice else []
    if args.proxy_cpus:
        nice = ["taskset", "-c", args.proxy_cpus, *nice]
    load_pin = ["taskset", "-c", args.load_cpus] if args.load_cpus else []
    if args.load_cpus:
        os.sched_setaffinity(0, parse_cpu_list(args.load_cpus))
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(args.backend_procs):
            procs.append(subprocess.Popen([sys.executable, __file__, "--backend-only", str(bport), "--replicas",
                                           str(args.replicas), "--backend-procs", str(args.backend_procs),
                                           "--token-gap-ms", str(args.token_gap_ms)],
                                          start_new_session=True))
        wait_port(bport)
        targets = {"direct": bport}
        groups: dict[str, int] = {}  # each proxy's process group (every Popen here starts its own session)
        if nginx is not None:
            targets["nginx"] = nport
            (tmp / "nginx.conf").write_text(NGINX_CONF.format(tmp=tmp, backend=bport, port=nport, workers=args.nginx_workers))
            procs.append(subprocess.Popen([*nice, nginx, "-c", str(tmp / "nginx.conf"), "-p", str(tmp), "-g", "daemon off;"],
                                          start_new_session=True))
            groups["nginx"] = procs[-1].pid
            wait_port(nport)
        if Path(args.vllm_router).exists():
            vport = targets["vllm-router"] = free_port()
            procs.append(subprocess.Popen(
                [*nice, args.vllm_router, "--host", "127.0.0.1", "--port", str(vport), "--worker-urls",
                 f"http://127.0.0.1:{bport}", "--policy", "round_robin", "--log-level", "warning"],
                start_new_session=True, stdout=subprocess.DEVNULL))
            groups["vllm-router"] = procs[-1].pid
            wait_port(vport, "/health", timeout=60)
        if args.python_floor:
            fport = targets["python-floor"] = free_port()
            procs.append(subprocess.Popen([*nice, sys.executable, __file__, "--floor-only", str(fport), str(bport)],
                                          start_new_session=True))
            groups["python-floor"] = procs[-1].pid
            wait_port(fport)
        replicas = [a for i in range(1, args.replicas + 1) for a in ("--replica", f"http://127.0.0.{i}:{bport}")]
        here = tree_env(REPO, tmp)
        variants = {"": (here, REPO)}
        if args.aiohttp_listener:
            variants["-aiohttp"] = ({**here, "ROUTEWISE_LEAN_LISTENER": "0"}, REPO)
        if args.baseline_tree:
            baseline = Path(args.baseline_tree).resolve()
            variants["-baseline"] = (tree_env(baseline, tmp), baseline)
        if args.shared_state:  # a redis-server of its own, and an idle peer router, so there is a share to read
            redis_port = free_port()
            procs.append(subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                           "--appendonly", "no"], stdout=subprocess.DEVNULL, start_new_session=True))
            wait_tcp(redis_port)
            shared = {"ROUTEWISE_SHARED_STATE": f"redis://127.0.0.1:{redis_port}/0"}
            variants["-shared"] = ({**here, **shared}, REPO)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "routewise_vllm.router", "serve", "--host", "127.0.0.1", "--port", str(free_port()), *replicas,
                 "--policy", "least-outstanding", "--log-level", "warning"], cwd=REPO, start_new_session=True,
                env={**os.environ, **shared}))
        for n in (int(w) for w in args.workers.split(",")):
            for policy in policies:
                for suffix, (env, tree) in variants.items():
                    name = f"routewise-w{n}" + (f"-{policy}" if len(policies) > 1 else "") + suffix
                    rport = targets[name] = free_port()
                    base, late = split_late(policy)
                    procs.append(subprocess.Popen(
                        [*nice, sys.executable, "-m", "routewise_vllm.router", "serve", "--workers", str(n), "--host", "127.0.0.1",
                         "--port", str(rport), *replicas, "--policy", base,
                         "--log-level", "warning"],
                        cwd=tree, start_new_session=True,
                        env={**os.environ, **env, "ROUTEWISE_LATE_BINDING": "1" if late else "0"}))
                    groups[name] = procs[-1].pid
                    wait_port(rport, "/ready")
        results: dict = {"rate": args.rate, "duration_s": args.duration, "latency_ms": {}, "rps": {}}
        # the targets take turns in `rounds` slices, so a drift of the machine over the run (or being measured
        # first) does not land on one target
        lats: dict[str, list[float]] = {name: [] for name in targets}
        cpu_s = {name: 0.0 for name in groups}
        for _ in range(args.rounds):
            for name, port in targets.items():
                before = group_cpu_s(groups[name]) if name in groups else 0.0
                lats[name] += asyncio.run(open_loop(f"http://127.0.0.1:{port}/v1/completions", args.rate,
                                                    args.duration / args.rounds))
                if name in groups:
                    cpu_s[name] += group_cpu_s(groups[name]) - before
        for name, lat in lats.items():
            results["latency_ms"][name] = {"p50": pct(lat, 0.5) * 1e3, "p99": pct(lat, 0.99) * 1e3, "n": len(lat)}
            if name in cpu_s:  # the warm-up requests of each slice were served too
                results["latency_ms"][name]["cpu_us_per_request"] = cpu_s[name] / (len(lat) + WARMUP * args.rounds) * 1e6
        if args.stream_latency:
            streamed = {name: port for name, port in targets.items() if name != "python-floor"}
            ttfts: dict[str, list[float]] = {name: [] for name in streamed}
            for _ in range(args.rounds):
                for name, port in streamed.items():
                    ttfts[name] += asyncio.run(open_loop(f"http://127.0.0.1:{port}/v1/completions", args.rate,
                                                         args.duration / args.rounds, stream=True))
            results["ttft_ms"] = {name: {"p50": pct(v, 0.5) * 1e3, "p99": pct(v, 0.99) * 1e3, "n": len(v)}
                                  for name, v in ttfts.items()}
        # each router's own view of its decisions over the latency phase (before wrk adds its load)
        from routewise_vllm.fleet.demo import router_stats

        results["decisions"] = {name: router_stats(f"http://127.0.0.1:{port}")[0] for name, port in targets.items()
                                if name.startswith("routewise")}
        results["cpu_us_at_max"] = {}
        for stream in () if args.no_wrk else (False, True):
            key = "streaming" if stream else "non_streaming"
            results["rps"][key], results["cpu_us_at_max"][key] = {}, {}
            for name, port in targets.items():
                if name == "python-floor" and stream:  # it frames by Content-Length only: no chunked streams
                    continue
                before = group_cpu_s(groups[name]) if name in groups else 0.0
                rps = results["rps"][key][name] = wrk(f"http://127.0.0.1:{port}/v1/completions", stream,
                                                      args.wrk_duration, args.connections, tmp, args.wrk_threads, load_pin)
                if name in groups:  # the proxy's CPU per request at its maximum: throughput per CPU, whatever its threads
                    results["cpu_us_at_max"][key][name] = (group_cpu_s(groups[name]) - before) / (rps * args.wrk_duration) * 1e6
        results["paired"] = {}
        for name in (t for t in targets if args.paired and f"{t}-baseline" in targets):
            for stream in (False, True):
                rows = [paired((f"http://127.0.0.1:{targets[name]}/v1/completions",
                                f"http://127.0.0.1:{targets[name + '-baseline']}/v1/completions"),
                               (groups[name], groups[name + "-baseline"]), stream, args.wrk_duration,
                               max(1, args.connections // 2), tmp, load_pin, swap=i % 2 == 1) for i in range(args.paired)]
                results["paired"][f"{name} {'streaming' if stream else 'non_streaming'}"] = rows
    finally:
        for p in reversed(procs):
            stop(p)
        shutil.rmtree(tmp, ignore_errors=True)

    proxies = [t for t in targets if t != "direct"]
    for table in ("latency_ms", "ttft_ms"):
        if table not in results:
            continue
        d = results[table]["direct"]
        for name in (t for t in proxies if t in results[table]):
            r = results[table][name]
            r["added_p50"], r["added_p99"] = r["p50"] - d["p50"], r["p99"] - d["p99"]
    results["rps_vs_nginx"] = {key: {t: row[t] / row["nginx"] for t in proxies if t in row}
                               for key, row in results["rps"].items()}
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"(a) latency at {args.rate:g} req/s open loop, {args.duration:g} s each in {args.rounds} turns, non-streaming (ms)")
    width = max(14, *(len(t) for t in targets))
    print(f"{'target':<{width}} {'p50':>8} {'p99':>8} {'+p50':>8} {'+p99':>8} {'CPU/req':>9}   ({args.replicas} replica(s);"
          " CPU/req: the proxy's processes' CPU time over the requests, background work included, in us)")
    for name in targets:
        r = results["latency_ms"][name]
        cpu = f"{r['cpu_us_per_request']:9.0f}" if "cpu_us_per_request" in r else f"{'':9}"
        print(f"{name:<{width}} {r['p50']:8.3f} {r['p99']:8.3f} {r.get('added_p50', 0):8.3f} {r.get('added_p99', 0):8.3f} {cpu}")
    if "ttft_ms" in results:
        print(f"\n(a') time to first token at {args.rate:g} req/s open loop, streamed ({STREAM_EVENTS} events), same turns (ms)")
        print(f"{'target':<{width}} {'p50':>8} {'p99':>8} {'+p50':>8} {'+p99':>8}")
        for name, r in results["ttft_ms"].items():
            print(f"{name:<{width}} {r['p50']:8.3f} {r['p99']:8.3f} {r.get('added_p50', 0):8.3f} {r.get('added_p99', 0):8.3f}")
    print("\nrouter decisions in (a), from each router's /metrics (llm_router_decision_latency_seconds: view + policy +"
          " fallback, wall time; p50/p99 are histogram bucket upper bounds)")
    for name, arms in results["decisions"].items():
        for arm, d in arms.items():
            fb = ", ".join(f"{k} {v}" for k, v in d["fallbacks"].items()) or "none"
            print(f"{name:<{width}} {d['decisions']:6d} decisions  p50 <= {d['decision_p50_s'] * 1e6:6.0f} us  "
                  f"p99 <= {d['decision_p99_s'] * 1e6:6.0f} us  fell back {d['fallback_share']:.1%} ({fb})")
    if results.get("paired"):
        print(f"\n(c) paired: CPU per request (us) of each router and its baseline, loaded together ({args.paired} rounds "
              f"of {args.wrk_duration} s, wrk -c{max(1, args.connections // 2)} each, the wrk started first alternating); "
              "the ratio's geometric mean over the rounds, and its range")
        for key, rows in results["paired"].items():
            ratios = sorted(a / b for a, b in rows)
            print(f"{key:<{width + 14}} {statistics.median(a for a, _ in rows):7.1f} against "
                  f"{statistics.median(b for _, b in rows):7.1f}: x{statistics.geometric_mean(ratios):.3f} "
                  f"({ratios[0]:.3f}-{ratios[-1]:.3f})")
    if not results["rps"]:
        return 0
    print(f"\n(b) max requests/s with wrk -t{args.wrk_threads} -c{args.connections} -d{args.wrk_duration}s (x nginx, "
          f"{args.nginx_workers} worker(s))")
    print(f"{'target':<{width}} " + " ".join(f"{key:>22}" for key in results["rps"]))
    for name in targets:
        cells = [f"{row[name]:9.0f} ({row[name] / row['nginx']:4.2f}x)" if name in row else "-"
                 for row in results["rps"].values()]
        print(f"{name:<{width}} " + " ".join(f"{c:>22}" for c in cells))
    cpu = results["cpu_us_at_max"]
    ref = "vllm-router" if "vllm-router" in cpu["non_streaming"] else "nginx"
    print(f"\n(b') the proxy's CPU per request at that maximum, in us (x {ref}'s requests per CPU-second: above 1 serves "
          "more per CPU; a proxy with several threads may use more than one CPU)")
    print(f"{'target':<{width}} " + " ".join(f"{key:>22}" for key in cpu))
    for name in (t for t in targets if t in groups):
        cells = [f"{row[name]:9.1f} ({row[ref] / row[name]:4.2f}x)" if name in row else "-" for row in cpu.values()]
        print(f"{name:<{width}} " + " ".join(f"{c:>22}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
