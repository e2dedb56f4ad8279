"""What one worker of `router serve --workers N` repeats from the others: drain/restore and admin policy
reloads (router.scale.shared holds them). Every worker runs `follow_workers` every `interval_s`."""

from __future__ import annotations

import asyncio
import logging

from routewise_vllm.router.replicas import ReplicaSet
from routewise_vllm.router.serving.reload import PolicyReloader
from routewise_vllm.router.scale.shared import SharedLoad

log = logging.getLogger("router.worker_sync")


class WorkerSync:
    def __init__(self, load: SharedLoad, replicas: ReplicaSet, reloaders: dict[str, PolicyReloader]) -> None:
        self.load, self.replicas, self.reloaders = load, replicas, reloaders
        self.seen = load.last_command()[0]  # commands before this worker started are already in its settings

    def published_reload(self, arm: str, path: str) -> None:
        """This worker reloaded `arm` from `path` through its admin API: the others do the same."""
        self.seen = self.load.publish_command({"op": "reload", "arm": arm, "path": path})

    async def follow_once(self) -> None:
        self.replicas.follow_shared_draining()
        seq, cmd = self.load.last_command()
        if seq == self.seen or cmd is None:
            return
        self.seen = seq
        reloader = self.reloaders.get(cmd.get("arm", ""))
        if cmd.get("op") == "reload" and reloader is not None:
            res = await reloader.reload(cmd["path"])
            log.log(logging.INFO if res.ok else logging.ERROR, "reload of %s from another worker: %s",
                    cmd["arm"], res.message)

    async def run(self, interval_s: float = 0.1) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.follow_once()
            except Exception:  # noqa: BLE001 - the follower must outlive any single failure
                log.exception("following the other workers")
