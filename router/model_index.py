"""What the router answers about the fleet's models, built once per list change rather than per request
(router.models reads the lists): the few names a 404 gives, whether every replica lists the same models, the
router's own /v1/models body (and its gzipped form, with an ETag), and the byte budget those bodies are sent under.

vLLM lists every LoRA adapter, so a list may hold 100,000 names (16 MB of JSON): a request's cost must not grow
with it. ReplicaSet and Replica (router.replicas, which imports router.models) are typed Any here.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import json
import math
import time
import weakref
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

LISTED = 20  # models named in a 404 (a fleet of many adapters lists the first ones, then the count)


def names_digest(names: Iterable[str]) -> str:
    """A short digest of a set of model names, the same for the same set in any order: a log line tells two lists
    apart, or two replicas' lists alike, without writing the names (a name is the replica's text, any length)."""
    h = hashlib.sha256()
    for name in sorted(names):
        h.update(name.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()[:12]


Lists = tuple[tuple[dict[str, Any], ...], ...]  # each replica's /v1/models entries, in replica order

_CHUNK = 2_000  # entries serialised between two turns of the event loop (~5 ms): no answer waits on a whole build


@dataclass(frozen=True, slots=True)
class ListBody:
    """The router's /v1/models answer, built once per list change: the JSON and its gzipped form."""

    raw: bytes
    gzipped: bytes
    etag: str  # a strong ETag of `raw`; the gzipped form's is gzip_etag

    @property
    def gzip_etag(self) -> str:
        return self.etag[:-1] + '-gzip"'


def _same(a: Lists | None, b: Lists) -> bool:
    return a is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b))


async def build_body(lists: Lists) -> ListBody:
    """The union of `lists` (a name's first listing wins), serialised a chunk at a time with the event loop's
    other work in between: 100,000 entries are ~0.3 s of CPU, which must not be one stall of every request, health
    probe and scrape."""
    seen: dict[str, dict[str, Any]] = {}
    for entries in lists:
        for i in range(0, len(entries), 10 * _CHUNK):
            for m in entries[i:i + 10 * _CHUNK]:
                seen.setdefault(m["id"], m)
            await asyncio.sleep(0)
    values = list(seen.values())
    parts = []
    for i in range(0, len(values), _CHUNK):
        parts.append(json.dumps(values[i:i + _CHUNK])[1:-1].encode())  # the entries, without the list's brackets
        await asyncio.sleep(0)
    raw = b'{"object": "list", "data": [' + b", ".join(parts) + b"]}"
    digest = hashlib.sha256()
    packer = zlib.compressobj(1, zlib.DEFLATED, 31)  # wbits 31: the gzip format
    zipped = []
    for i in range(0, len(raw), 1 << 20):
        digest.update(raw[i:i + (1 << 20)])
        zipped.append(packer.compress(raw[i:i + (1 << 20)]))
        await asyncio.sleep(0)
    zipped.append(packer.flush())
    return ListBody(raw, b"".join(zipped), '"' + digest.hexdigest()[:32] + '"')


class ModelIndex:
    """What the router answers about the fleet's models, rebuilt only when a list changes: the few names a 404
    gives, whether the replicas list the same models, and the /v1/models body; and the digest of each replica's
    last list, so that the same bytes read again are not parsed again. A request's cost is then the same at 100 or
    100,000 listed models.

    A change is seen by identity: ReplicaSet.update_models builds a new known_models after each read, and
    fetch_models keeps a replica's entries object while its list is unchanged."""

    def __init__(self) -> None:
        self._names_of: frozenset[str] | None = None
        self._listed = ""
        self._entries_of: Lists | None = None
        self._body: ListBody | None = None
        self._building_of: Lists | None = None
        self._building: asyncio.Task[ListBody] | None = None
        self._builds = 0  # builds started; the body kept is the latest started one's
        self._body_seq = 0
        self._same_of: frozenset[str] | None = None
        self._same = True
        self._answers: dict[str, tuple[Any, bytes]] = {}  # by replica id: (the replica, its last list's digest)

    def answered(self, rep: Any, digest: bytes) -> bool:
        """Whether `rep`'s last list read had this digest."""
        last = self._answers.get(rep.id)
        return last is not None and last[0] is rep and last[1] == digest != b""

    def remember(self, rep: Any, digest: bytes) -> None:
        self._answers[rep.id] = (rep, digest)

    def listed(self, known: frozenset[str]) -> str:
        """The first LISTED served names (in sort order) and how many more."""
        if known is not self._names_of:
            first = heapq.nsmallest(LISTED, known)
            more = len(known) - len(first)
            self._listed = ", ".join(first) + (f" and {more} more" if more else "")
            self._names_of = known
        return self._listed

    def same_lists(self, replicas: Any) -> bool:
        """Whether every replica whose list is known lists the same models (then a request without a model may go
        to any: vLLM serves its default, the same everywhere)."""
        if replicas.known_models is not self._same_of:
            self._same = len({r.models for r in replicas.ordered if r.models_known}) <= 1
            self._same_of = replicas.known_models
        return self._same

    async def body(self, lists: Lists) -> ListBody:
        """The /v1/models body of `lists`: the one built, or the one being built (a single build for every
        request that waits on it)."""
        if _same(self._entries_of, lists):
            return self._body  # type: ignore[return-value]
        if self._building is None or not _same(self._building_of, lists):
            self._builds += 1
            self._building_of = lists
            self._building = asyncio.get_running_loop().create_task(self._build(lists, self._builds))
        return await asyncio.shield(self._building)  # a client that goes away does not cancel the build

    async def _build(self, lists: Lists, seq: int) -> ListBody:
        try:
            body = await build_body(lists)
        finally:
            if self._building_of is lists:  # the newest build: no other is under way
                self._building = self._building_of = None
        if seq > self._body_seq:  # never replaced by an older build finishing later
            self._body, self._entries_of, self._body_seq = body, lists, seq
        return body


_INDEXES: weakref.WeakKeyDictionary[Any, ModelIndex] = weakref.WeakKeyDictionary()


def model_index(replicas: Any) -> ModelIndex:
    """The ModelIndex of a replica set (one per set, made on first use)."""
    index = _INDEXES.get(replicas)
    if index is None:
        index = _INDEXES[replicas] = ModelIndex()
    return index


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an Accept-Encoding header value takes gzip (named, or `*`, without q=0)."""
    for part in accept_encoding.split(","):
        name, _, params = part.partition(";")
        if name.strip().lower() in ("gzip", "*"):
            q = params.strip().lower()
            return not (q.startswith("q=") and q[2:].strip().rstrip("0").rstrip(".") in ("", "0"))
    return False


def etag_matches(if_none_match: str, etags: tuple[str, ...]) -> bool:
    """Whether an If-None-Match header value names one of `etags` (weak comparison, as RFC 9110 asks for it) or
    is `*`."""
    return any((t := tag.strip().removeprefix("W/")) == "*" or t in etags for tag in if_none_match.split(","))


class SendBudget:
    """A token bucket of bytes a second (0: no limit). A body goes while the bucket is not in debt, whatever its
    size, and the debt it leaves is waited out: the average stays at the rate, bursts at one second's worth."""

    def __init__(self, bytes_per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = bytes_per_s
        self._clock = clock
        self._tokens = bytes_per_s
        self._at = clock()

    def take(self, n: int) -> float:
        """0 when `n` bytes may be sent now (and they are counted), else the seconds until some may."""
        if self.rate <= 0:
            return 0.0
        now = self._clock()
        self._tokens = min(self.rate, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens < 0:
            return -self._tokens / self.rate
        self._tokens -= n
        return 0.0

    @staticmethod
    def retry_after(wait_s: float) -> str:
        """A Retry-After value (whole seconds, at least 1) for a wait."""
        return str(max(1, math.ceil(wait_s)))
