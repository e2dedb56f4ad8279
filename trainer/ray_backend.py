"""Rollouts and evaluation on a Ray cluster: the optional backend behind `trainer train|evaluate --ray ADDRESS`.

`RayWorkerPool` is `trainer.rollout.WorkerPool` with Ray actors in place of spawned processes: actor k
owns a `WorkerState` (environments + heuristic-curve cache) and runs exactly the command local worker k
would, with the same arguments and seeds, so the same config (seed, `run.workers`) gives bit-identical
results either way. `RayExecutor` runs `simulator.experiments.compare`'s tasks as Ray tasks.

Nothing here imports ray at module import time; `connect` does, and fails with a `RayBackendError`
naming the address when ray is missing or the cluster cannot be reached.

Addresses: `local` (start a private Ray instance on this machine, shut down afterwards), `auto`
(`RAY_ADDRESS` if set, else the cluster started here with `ray start`), `ray://HOST:10001` (Ray
client) or `HOST:6379` (a head node's GCS). On a remote cluster this process's `routewise_vllm.router`, `.simulator`
and `.trainer` packages are shipped to the workers (Ray `py_modules`), so the nodes run the driver's
code; they need routewise's `[train]` dependencies (torch, gymnasium, ...) installed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from routewise_vllm.simulator.traces import TRACES_DIR_ENV
from routewise_vllm.trainer.config import RAY_AUTO, RAY_LOCAL, TrainConfig, parse_ray_address

INSTALL_HINT = "pip install 'routewise-vllm[ray]'"
CONNECT_TIMEOUT_S = 5.0
# A private local instance stays small: it shares the machine with the learner.
LOCAL_OBJECT_STORE_BYTES = 200 * 1024**2


class RayBackendError(RuntimeError):
    """Ray was asked for but cannot be used (not installed, cluster unreachable, an actor died)."""


def _import_ray():
    try:
        import ray
    except ImportError:
        raise RayBackendError(f"ray is not installed in this environment ({sys.executable}); install the extra: {INSTALL_HINT}") from None
    return ray


def _describe(address: str) -> str:
    """How the address reads in errors: `auto` shows what it resolved to (RAY_ADDRESS)."""
    env = os.environ.get("RAY_ADDRESS")
    return f"{address} (RAY_ADDRESS={env})" if address == RAY_AUTO and env else address


def _check_reachable(address: str) -> None:
    """Fail fast, naming the address, when nothing listens there (Ray itself would retry for 30 s or more)."""
    target = os.environ.get("RAY_ADDRESS") or address if address == RAY_AUTO else address
    try:
        hp = parse_ray_address(target)
    except ValueError as exc:
        raise RayBackendError(f"--ray {_describe(address)}: {exc}") from None
    if hp is None:
        return
    try:
        socket.create_connection(hp, timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise RayBackendError(f"--ray {_describe(address)}: cannot reach the Ray cluster at {hp[0]}:{hp[1]} ({exc})") from None


def _shipped_runtime_env() -> dict:
    """This process's code (and trace folder choice) for the workers of a remote cluster.

    Ray imports a shipped folder by its own name, so the three packages are copied under a folder named as their
    namespace (routewise_vllm/router, ...): the workers import them as this process does."""
    from routewise_vllm import router, simulator, trainer

    staged = Path(tempfile.mkdtemp(prefix="routewise-ray-")) / "routewise_vllm"
    for package in (router, simulator, trainer):
        folder = Path(package.__file__).parent
        shutil.copytree(folder, staged / package.__name__.rpartition(".")[2], ignore=shutil.ignore_patterns("__pycache__"))
    env: dict[str, Any] = {"py_modules": [str(staged)]}
    if os.environ.get(TRACES_DIR_ENV):
        env["env_vars"] = {TRACES_DIR_ENV: os.environ[TRACES_DIR_ENV]}
    return env


@contextmanager
def connect(address: str, num_cpus: int | None = None) -> Iterator[Any]:
    """The `ray` module, connected to `address` for the duration of the block.

    Reuses a connection the caller already made (`ray.is_initialized()`), leaving it open; otherwise
    connects (or, for `local`, starts an instance with `num_cpus` CPUs) and disconnects at exit.
    """
    ray = _import_ray()
    if ray.is_initialized():
        yield ray
        return
    _check_reachable(address)
    quiet = {"log_to_driver": False, "include_dashboard": False, "configure_logging": False}
    try:
        if address == RAY_LOCAL:
            ray.init(address="local", num_cpus=num_cpus, object_store_memory=LOCAL_OBJECT_STORE_BYTES, **quiet)  # never an existing one
        else:
            ray.init(address=address, runtime_env=_shipped_runtime_env(), **quiet)
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as exc:
        raise RayBackendError(f"--ray {_describe(address)}: cannot connect to the Ray cluster: {str(exc).splitlines()[0]}") from None
    try:
        yield ray
    finally:
        ray.shutdown()


# ----------------------------------------------------------------------------------------------
# Training rollouts: one actor per worker
# ----------------------------------------------------------------------------------------------
class _RolloutActor:
    """A `trainer.rollout.WorkerState` in a Ray actor (one CPU, one torch thread, like a local worker)."""

    def __init__(self, cfg_json: str) -> None:
        from routewise_vllm.trainer.rollout import WorkerState

        self.state = WorkerState(TrainConfig.model_validate_json(cfg_json), torch_threads=1)

    def call(self, name: str, kwargs: dict, state_dict: dict | None = None) -> list:
        if state_dict is not None:  # passed on its own so Ray resolves it from the object store
            kwargs = kwargs | {"state_dict": state_dict}
        return getattr(self.state, f"cmd_{name}")(**kwargs)


class RayWorkerPool:
    """`WorkerPool`'s interface over `max(1, run.workers)` Ray actors on a connected cluster.

    Actor k gets exactly worker k's share of every command (same `split`, same seeds), so results match
    the local pool's bit for bit. Commands are deterministic in their arguments, so an actor lost with
    its node is restarted and the call retried (its cache is rebuilt on demand).
    """

    def __init__(self, ray, cfg: TrainConfig) -> None:
        from routewise_vllm.trainer.rollout import WorkerError

        self._ray = ray
        self._error = WorkerError
        self.cfg = cfg
        self.n = max(1, cfg.run.workers)
        cpus = ray.cluster_resources().get("CPU", 0)
        if cpus < self.n:
            print(f"warning: {self.n} rollout actors need {self.n} CPUs; the Ray cluster has {cpus:g} (actors wait for an autoscaler)",
                  file=sys.stderr, flush=True)  # fmt: skip
        actor = ray.remote(num_cpus=1, max_restarts=2, max_task_retries=2)(_RolloutActor)
        cfg_json = cfg.model_dump_json()
        self._actors = [actor.remote(cfg_json) for _ in range(self.n)]

    @property
    def size(self) -> int:
        return self.n

    def run(self, name: str, per_worker_kwargs: list[dict]) -> list:
        """Command `name` with per_worker_kwargs[k] on actor k; results concatenated in actor order."""
        # a shared object (the network's state_dict) goes to the object store once, not once per actor
        refs: dict[int, Any] = {}
        calls = []
        for actor, kw in zip(self._actors, per_worker_kwargs):
            sd = kw.get("state_dict")
            if sd is not None and id(sd) not in refs:
                refs[id(sd)] = self._ray.put(sd)
            rest = {k: v for k, v in kw.items() if k != "state_dict"}
            calls.append(actor.call.remote(name, rest, None if sd is None else refs[id(sd)]))
        out, errors = [], []
        for ref in calls:
            try:
                out.extend(self._ray.get(ref))
            except Exception as exc:  # noqa: BLE001 - RayTaskError / RayActorError: gathered and raised once
                errors.append(str(exc))
        if errors:
            raise self._error("a Ray rollout actor failed:\n" + "\n".join(errors))
        return out

    def split(self, items: list, key=None) -> list[list]:
        from routewise_vllm.trainer.rollout import split_items

        return split_items(items, self.size, key)

    def close(self) -> None:
        for a in self._actors:
            self._ray.kill(a)
        self._actors = []

    def __enter__(self) -> RayWorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------
# Evaluation: `simulator.experiments.compare` tasks as Ray tasks
# ----------------------------------------------------------------------------------------------
def _run_with_files(fn: Callable, args: tuple, files: dict[str, bytes]) -> Any:
    """`fn(*args)`, one `simulator.experiments._task`, on a node that may not see the driver's files: each policy
    path in `files` is replaced by a node-local copy (named by content), and results are keyed by the original path."""
    (item,) = args
    if not files:
        return fn(item)
    scenario, policies, *rest = item
    folder = Path(tempfile.gettempdir()) / "routewise-ray"
    folder.mkdir(exist_ok=True)
    local = {}
    for path, data in files.items():
        copy = folder / f"{hashlib.sha256(data).hexdigest()[:16]}-{Path(path).name}"
        if not copy.is_file():
            tmp = copy.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            tmp.replace(copy)  # atomic: tasks in other worker processes never read half a file
        local[path] = str(copy)
    back = {v: k for k, v in local.items()}
    sc, seed, per_policy = fn((scenario, tuple(local.get(p, p) for p in policies), *rest))
    return sc, seed, {back.get(k, k): v for k, v in per_policy.items()}


class RayExecutor(Executor):
    """`map` over Ray tasks (one CPU each), results in input order: what `compare(executor=...)` uses.

    `files`: paths named in the tasks (an exported ONNX policy) whose bytes travel with each task.
    """

    def __init__(self, ray, files: Iterable[str | Path] = ()) -> None:
        self._ray = ray
        self._files = {str(p): Path(p).read_bytes() for p in files}

    def map(self, fn: Callable, *iterables: Iterable, timeout: float | None = None, chunksize: int = 1) -> Iterator:
        task = self._ray.remote(num_cpus=1, max_retries=2)(_run_with_files)
        files = self._ray.put(self._files)
        refs = [task.remote(fn, item, files) for item in zip(*iterables)]
        for ref in refs:
            try:
                yield self._ray.get(ref)
            except Exception as exc:  # noqa: BLE001
                raise RayBackendError(f"a Ray evaluation task failed: {exc}") from None
