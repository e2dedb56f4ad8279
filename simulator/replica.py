"""One vLLM V1 replica: FCFS waiting queue, continuous batching with chunked prefill, paged KV
blocks, recompute preemption and automatic prefix caching, timed by the cost model.

Scheduling follows vLLM V1's scheduler per iteration: the running requests' decodes take
their token each first, then running partial prefills continue in running order, then (only
if nothing was preempted) waiting requests are admitted FCFS while the token budget
(`max_num_batched_tokens`), `max_num_seqs` and free KV blocks allow. When blocks run out, the
tail of the running list (the most recently admitted) is preempted: its KV is freed, its
computed tokens are lost and it goes back to the front of the waiting queue.

Speed: a decode-phase request's computed-token count is `base + step` (the replica's step
counter), so a decode-only iteration costs O(1) whatever the batch size. Residues of `base`
modulo the block size tell how many requests need a new KV block at any step, and a heap of
finish steps gives the next completion, so runs of decode-only iterations whose batch does not
change are advanced in closed form (a "jump"): bounded by the next completion and the last
step whose block allocations are sure to succeed, and cut short when a request is added or the
speed changes (`add`, `set_factor`). The owner (the cluster) calls `on_event()` at
`event_s` and reads `outputs` (first tokens and completions at their simulated times).

Prefix caching: KV block k of a request is content (chained id prefix, sub index) for the
blocks covered by `SimRequest.block_ids`; tokens beyond are unique to the request and never
cached. Cached blocks are kept per id block (up to block_tokens // block_size KV blocks, a
cache entry), reference counted, and entries nobody references are evicted LRU when blocks
are needed; the usage vLLM reports counts them as free.

LoRA adapters (`ReplicaGroup.lora`), as vLLM's scheduler and adapter manager: a request names an adapter by
its `model`; a waiting request whose adapter would make one more than `max_loras` distinct adapters among the
running requests is skipped (the queue behind it still admitted, as vLLM does); an adapter a newly admitted
request needs that is not in one of the `max_loras` GPU slots (least recently used first out, never one a running
request uses) stalls that iteration by `swap_s`, plus `load_s` when it is not among the `max_cpu_loras` kept in
host memory. Without `lora` none of this runs: the adapter checks sit behind one `is not None` test.

Over 400 lines on purpose: one scheduler state machine (planning, closed-form decode jumps, KV blocks, prefix
cache) whose private state is shared by every method on the hot path; the owners' interface is the public methods.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from typing import Sequence

from routewise_vllm.simulator.config import ReplicaGroup
from routewise_vllm.simulator.costmodel import Profile
from routewise_vllm.simulator.types import SimRequest

WAITING, PREFILL, DECODE, DONE = 0, 1, 2, 3
IDLE, ITER, JUMP, DOWN = 0, 1, 2, 3
FIRST, COMPLETE = 0, 1  # output kinds
_ADMISSIBLE, _BLOCKED, _NO_BLOCKS = 0, 1, 2  # the waiting head at the next iteration


def chained_keys(block_ids: Sequence[int]) -> tuple[int, ...]:
    """Content keys of a request's id blocks: identical leading ids give identical keys."""
    out = []
    k = 0
    for b in block_ids:
        k = hash((k, int(b)))
        out.append(k)
    return tuple(out)


class ReqState:
    """One dispatch attempt of a request on a replica."""

    __slots__ = (
        "req", "idx", "prompt", "output", "keys", "full_blocks", "ends",
        "g", "c", "base", "phase", "shared_blocks", "entries", "n_keyed",
        "dispatch_s", "first_scheduled_s", "first_token_s", "finish_s", "preemptions", "prefix_hit_tokens",
        "admitted", "epoch", "lora",
    )  # fmt: skip

    def __init__(self, req: SimRequest, idx: int, dispatch_s: float, keys: Sequence[int] | None = None) -> None:
        self.req = req
        self.idx = idx
        self.prompt = int(req.prompt_tokens)
        self.output = max(1, int(req.output_tokens))
        self.keys = tuple(keys) if keys is not None else chained_keys(req.block_ids)
        self.full_blocks: list[int] = []  # full KV blocks per id block (filled by the replica)
        self.ends: list[int] = []  # token position after the last full KV block of each id block
        self.g = 0  # output tokens generated
        self.c = 0  # computed (KV-cached) tokens; for DECODE it is base + replica.step
        self.base = 0
        self.phase = WAITING
        self.shared_blocks = 0  # KV blocks of this request accounted to cache entries
        self.entries: list[_Entry] = []  # cache entries this request references
        self.n_keyed = 0  # leading id blocks already looked up / registered
        self.dispatch_s = dispatch_s
        self.first_scheduled_s = math.nan
        self.first_token_s = math.nan
        self.finish_s = math.nan
        self.preemptions = 0
        self.prefix_hit_tokens = 0
        self.admitted = False
        self.epoch = 0
        self.lora = 0  # the adapter's id on the replica (0: the base model)


class _Entry:
    __slots__ = ("key", "blocks", "refs")

    def __init__(self, key: int, blocks: int) -> None:
        self.key = key
        self.blocks = blocks
        self.refs = 1


class Replica:
    def __init__(
        self, replica_id: str, group: ReplicaGroup, profile: Profile, closed_form: bool = True
    ) -> None:
        if group.max_num_seqs > group.max_num_batched_tokens:
            raise ValueError(
                f"replica {replica_id}: max_num_seqs={group.max_num_seqs} exceeds "
                f"max_num_batched_tokens={group.max_num_batched_tokens} (vLLM rejects this too)"
            )
        self.replica_id = replica_id
        self.profile = profile
        self.co = profile.coefficients()
        self.bs = group.block_size
        self.max_seqs = group.max_num_seqs
        self.budget = group.max_num_batched_tokens
        self.prefix_caching = group.enable_prefix_caching
        self.num_blocks = profile.num_kv_blocks(group.block_size, group.gpu_memory_utilization)
        self.model_len_limit = group.max_model_len or profile.max_model_len
        self.base_factor = group.speed_factor
        self.closed_form = closed_form
        self.factor = group.speed_factor
        self.outputs: list[tuple[int, ReqState, float]] = []
        self.n_iterations = 0  # engine iterations simulated (jumps count all their steps)
        self.n_preemptions = 0
        self.n_jumps = 0  # closed-form multi-iteration advances
        lora = group.lora
        self.lora_ids: dict[str, int] | None = None if lora is None else {a: k for k, a in enumerate(lora.adapters, 1)}
        self.lora_names = [""] + list(lora.adapters) if lora is not None else [""]
        self.max_loras = lora.max_loras if lora is not None else 0
        self.max_cpu_loras = (lora.max_cpu_loras or lora.max_loras) if lora is not None else 0
        self.lora_load_s = lora.load_s if lora is not None else 0.0
        self.lora_swap_s = lora.swap_s if lora is not None else 0.0
        self.n_lora_loads = 0  # adapters read into host memory
        self.n_lora_swaps = 0  # adapters copied into a GPU slot
        self._reset_state()

    # ---- state -----------------------------------------------------------------------------

    def _reset_state(self) -> None:
        self._kv_capacity = self.num_blocks * self.bs  # here: the emulator resizes num_blocks, then resets
        # vLLM refuses to start when one max_model_len sequence does not fit the KV cache (or, with
        # automatic sizing, lowers max_model_len to what fits): the context limit it enforces
        self.max_model_len = min(self.model_len_limit, self._kv_capacity)
        self.waiting: deque[ReqState] = deque()
        self.running: list[ReqState] = []  # admission order; preemption takes the tail
        self.prefilling: list[ReqState] = []  # running requests still in prefill, running order
        self.step = 0
        self.hist = [0] * self.bs  # decode requests by base % block_size
        self.n_dec = 0
        self.sum_base = 0
        self.finish_heap: list[tuple[int, int, ReqState]] = []
        self._seq = 0
        self.num_free = self.num_blocks
        self.cache: dict[int, _Entry] = {}
        self.lru: OrderedDict[int, _Entry] = OrderedDict()  # unreferenced entries, oldest first
        self.evictable = 0
        self.mode = IDLE
        self.event_s: float | None = None
        self._plan: list[tuple[ReqState, int]] = []
        self._jump: tuple[float, int, float, float, float, int] | None = None  # t0, k, a, b, c, jstar
        # LoRA: running requests per adapter id (None: no adapters), and the adapters in GPU slots and host memory
        self.lora_running: dict[int, int] | None = None if self.lora_ids is None else {}
        self._gpu_loras: OrderedDict[int, None] = OrderedDict()
        self._cpu_loras: OrderedDict[int, None] = OrderedDict()

    @property
    def kv_capacity_tokens(self) -> int:
        return self._kv_capacity

    def kv_usage(self) -> float:
        return (self.num_blocks - self.num_free - self.evictable) / self.num_blocks

    def sample(self, now: float) -> tuple[int, int, float]:
        """(waiting, running, kv_cache_usage) as vLLM's /metrics would report at `now`."""
        used = self.num_blocks - self.num_free - self.evictable
        if self.mode == JUMP:
            t0, k, *_ = self._jump  # type: ignore[misc]
            used += self._blocks_needed(min(k, self._steps_before(now - t0)))
        return len(self.waiting), len(self.running), used / self.num_blocks

    def lora_sample(self) -> tuple[tuple[str, ...], tuple[str, ...], int] | None:
        """(adapters with running requests, adapters with waiting ones, max_loras) as vLLM's
        vllm:lora_requests_info reports them; None without adapters."""
        if self.lora_running is None:
            return None
        names = self.lora_names
        waiting = sorted({names[st.lora] for st in self.waiting if st.lora})
        return tuple(sorted(names[a] for a in self.lora_running)), tuple(waiting), self.max_loras

    def in_flight(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- the owner's interface ---------------------------------------------------------------

    def add(self, st: ReqState, now: float) -> None:
        """A request dispatched to this replica at `now`."""
        mode = self.mode
        if mode == DOWN:
            raise RuntimeError(f"replica {self.replica_id} is down")
        if st.prompt + st.output - 1 > self._kv_capacity:
            raise ValueError(
                f"request {st.req.request_id}: {st.prompt} prompt + {st.output} output tokens exceed the KV cache of "
                f"replica {self.replica_id} ({self.kv_capacity_tokens} tokens); pick a larger profile or shorter requests"
            )
        if st.keys:
            self._prepare_keys(st)
        if self.lora_ids is not None:
            st.lora = self.lora_ids.get(st.req.model, 0)  # type: ignore[arg-type]
        st.dispatch_s = now
        self.waiting.append(st)
        if mode == IDLE:
            self._plan_next(now)
        elif mode == JUMP:
            self._cut(now)

    def on_event(self, now: float) -> None:
        """Finish the iteration or jump that ends at `now` and start the next one."""
        if self.mode == ITER:
            self._finish_iteration(now)
        elif self.mode == JUMP:
            self._commit_jump(now)
        else:
            return
        self._plan_next(now)

    def set_factor(self, now: float, factor: float) -> None:
        """Iteration-time multiplier for iterations starting from `now` (slow-down faults)."""
        new = self.base_factor * factor
        if self.mode == JUMP:
            t0, k, *_ = self._jump  # type: ignore[misc]
            m = min(k, self._steps_before(now - t0))
            self.factor = new
            if m == 0:
                self._plan_next(t0)
            elif m < k:
                self._shrink_jump(m)
        else:
            self.factor = new

    def crash(self) -> list[ReqState]:
        """Drop everything; returns the in-flight requests (their progress is lost)."""
        lost = list(self.running) + list(self.waiting)
        for st in lost:
            st.phase = DONE
            st.epoch += 1
        self._reset_state()
        self.mode = DOWN
        return lost

    def recover(self) -> None:
        self._reset_state()

    # ---- the wall-clock owner's interface (fleet.emulator: one iteration at a time, closed_form=False) --------

    def resize_kv(self, num_blocks: int) -> None:
        """Set the KV cache to `num_blocks` blocks; only before the first request (it resets the state)."""
        if num_blocks < 1:
            raise ValueError(f"kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._reset_state()

    def abort(self, st: ReqState) -> None:
        """Drop a request whose client went away, freeing its slot and KV blocks.

        A waiting request may leave at any time; a scheduled one only between iterations (inside `advance`,
        or while no iteration is planned), when none of its blocks is half-allocated.
        """
        if st.phase == WAITING:
            self.waiting.remove(st)
            if self.mode == IDLE and not self.running and not self.waiting:
                self.event_s = None
        elif st.phase in (PREFILL, DECODE):
            if self.mode == ITER:
                raise RuntimeError(f"replica {self.replica_id}: abort of a scheduled request during an iteration")
            self._release(st)
            self.running.remove(st)
            if st in self.prefilling:
                self.prefilling.remove(st)
        st.phase = DONE

    def advance(self, now: float, aborts: Sequence[ReqState] = ()) -> None:
        """Finish the planned iteration (if any) at `now`, drop `aborts`, and plan the next iteration."""
        if self.mode == JUMP:
            raise RuntimeError(f"replica {self.replica_id}: advance() needs closed_form=False")
        if self.mode == ITER:
            self._finish_iteration(now)
            self.mode = IDLE  # between iterations: scheduled requests may be aborted
        for st in aborts:
            self.abort(st)
        self._plan_next(now)

    def tokens_generated(self, st: ReqState) -> int:
        """Output tokens a decoding request has produced after the last finished iteration."""
        return st.base + self.step - st.prompt + 1

    def take_outputs(self) -> list[tuple[int, ReqState, float]]:
        """The (FIRST | COMPLETE, request, time) events since the last call, oldest first."""
        out, self.outputs = self.outputs, []
        return out

    # ---- planning ----------------------------------------------------------------------------

    def _plan_next(self, now: float) -> None:
        if not self.running and not self.waiting:
            self.mode = IDLE
            self.event_s = None
            return
        n_dec = self.n_dec
        if n_dec and self.closed_form and not self.prefilling:
            head = self._head_state() if self.waiting else _BLOCKED
            free = self.num_free + self.evictable
            if head != _ADMISSIBLE and self.hist[(-self.step) % self.bs] <= free:
                # A head blocked for want of blocks can become admissible when an eviction drops a
                # cached entry it would have pinned (its chunk is budget-capped): no evictions then.
                avail = self.num_free if head == _NO_BLOCKS else free
                k = self._next_finish() - self.step
                # _max_block_steps(avail) >= (avail // n_dec) * bs: skip its loop when the completion comes first
                if k > (avail // n_dec) * self.bs:
                    k = min(k, self._max_block_steps(avail))
                if k >= 1:
                    self._start_jump(now, k)
                    return
        self._start_iteration(now)

    def _next_finish(self) -> int:
        h = self.finish_heap
        while h:
            fs, _, st = h[0]
            if st.phase == DECODE and st.output + st.prompt - 1 - st.base == fs:
                return fs
            heapq.heappop(h)
        return 1 << 62

    def _head_state(self) -> int:
        """Whether the next iteration would admit the head of the waiting queue, and if not, why."""
        if not self.waiting or len(self.running) >= self.max_seqs or self.budget - self.n_dec <= 0:
            return _BLOCKED
        st = self.waiting[0]
        if (lora := self.lora_running) is not None and len(lora) >= self.max_loras:
            # the first waiting request the adapter limit lets in (only a completion changes the running adapters)
            st = next((w for w in self.waiting if not w.lora or w.lora in lora), None)  # type: ignore[assignment]
            if st is None:
                return _BLOCKED
        hit, _, lost_evictable = self._lookup(st)
        n = min(st.prompt + st.g - hit, self.budget - self.n_dec)
        nb = -(-(hit + n) // self.bs) - hit // self.bs
        return _ADMISSIBLE if nb <= self.num_free + self.evictable - lost_evictable else _NO_BLOCKS

    def _max_block_steps(self, avail: int) -> int:
        """Most decode-only steps from now whose block allocations fit in `avail` blocks."""
        n = self.n_dec
        cycles = avail // n
        left = avail - cycles * n
        k = cycles * self.bs
        hist, bs, s = self.hist, self.bs, self.step + k
        for i in range(bs):
            need = hist[(-(s + i)) % bs]
            if need > left:
                return k + i
            left -= need
        return k + bs  # unreachable: a full cycle needs n > left blocks

    def _blocks_needed(self, m: int) -> int:
        """Blocks the decode requests need over the next `m` steps."""
        bs = self.bs
        q, r = divmod(m, bs)
        need = q * self.n_dec
        if r:
            # steps s, s+1, ..., s+r-1 need hist[-s % bs], hist[(-s-1) % bs], ...: a cyclic slice read backwards
            hist = self.hist
            hi = (-self.step) % bs + 1
            lo = hi - r
            need += sum(hist[lo:hi]) if lo >= 0 else sum(hist[:hi]) + sum(hist[bs + lo :])
        return need

    # ---- closed-form decode jumps --------------------------------------------------------------

    def _start_jump(self, now: float, k: int) -> None:
        co, f, D = self.co, self.factor, self.n_dec
        ctx0 = self.sum_base + D * (self.step + 1)
        c = f * (co.overhead_s + co.flops_per_token * D * co.s_per_flop)
        a = f * (co.overhead_s + (co.weight_bytes + co.kv_bytes_per_token * ctx0) * co.s_per_byte)
        b = f * co.kv_bytes_per_token * D * co.s_per_byte
        if co.decode_extra_s or co.context_s:  # measured linear form: step j takes a + b * j, nothing to cross
            a = c + f * (co.decode_extra_s * D + co.context_s * ctx0)
            b, c = f * co.context_s * D, 0.0
        if a >= c:
            jstar = 0
        elif b <= 0:
            jstar = k
        else:
            jstar = min(k, math.ceil((c - a) / b))
        self._jump = (now, k, a, b, c, jstar)
        self.n_jumps += 1
        self.mode = JUMP
        span = c * (k if k < jstar else jstar)  # _span(k), inlined
        if k > jstar:
            x = k - jstar
            span += x * (a + b * jstar) + b * x * (x - 1) * 0.5
        self.event_s = now + span

    def _span(self, m: int) -> float:
        """Seconds taken by the first `m` steps of the current jump."""
        _, _, a, b, c, jstar = self._jump  # type: ignore[misc]
        p = m if m < jstar else jstar
        s = c * p
        if m > jstar:
            x = m - jstar
            s += x * (a + b * jstar) + b * x * (x - 1) * 0.5
        return s

    def _steps_before(self, horizon: float) -> int:
        """Number of the jump's steps that start strictly before t0 + horizon."""
        if horizon <= 0:
            return 0
        _, k, a, b, c, jstar = self._jump  # type: ignore[misc]
        if c * jstar >= horizon:
            m = math.ceil(horizon / c)
        else:
            h2 = horizon - c * jstar
            a2 = a + b * jstar
            if b <= 0:
                x = math.ceil(h2 / a2)
            else:
                lin = a2 - 0.5 * b
                x = math.ceil((-lin + math.sqrt(lin * lin + 2.0 * b * h2)) / b)
            m = jstar + max(0, x)
        m = min(m, k + 1)
        while m > 0 and self._span(m - 1) >= horizon:
            m -= 1
        while m <= k and self._span(m) < horizon:
            m += 1
        return m

    def _cut(self, now: float) -> None:
        t0, k, *_ = self._jump  # type: ignore[misc]
        m = self._steps_before(now - t0)
        if m == 0:
            self._plan_next(t0)
        elif m < k:
            self._shrink_jump(m)

    def _shrink_jump(self, m: int) -> None:
        t0, _, a, b, c, jstar = self._jump  # type: ignore[misc]
        self._jump = (t0, m, a, b, c, min(jstar, m))
        self.event_s = t0 + self._span(m)

    def _commit_jump(self, now: float) -> None:
        k = self._jump[1]  # type: ignore[index]
        need = self._blocks_needed(k)
        if self.num_free >= need:  # _allocate without evictions
            self.num_free -= need
        else:
            self._allocate(need)
        self.step += k
        self.n_iterations += k
        self._jump = None
        self._complete_decodes(now)

    # ---- one general iteration -----------------------------------------------------------------

    def _start_iteration(self, now: float) -> None:
        bs = self.bs
        preempted = False
        while True:
            budget = self.budget - self.n_dec
            plan = []
            need = self.hist[(-self.step) % bs]
            for st in self.prefilling:
                if budget <= 0:
                    break
                c = st.c
                n = st.prompt + st.g - c
                if n > budget:
                    n = budget
                budget -= n
                need += -(-(c + n) // bs) - (-(-c // bs))
                plan.append((st, n))
            if need <= self.num_free + self.evictable:
                break
            self._preempt(self.running[-1])
            preempted = True
        if self.num_free >= need:  # _allocate without evictions
            self.num_free -= need
        else:
            self._allocate(need)
        stall = 0.0
        if not preempted:
            waiting, running, max_seqs = self.waiting, self.running, self.max_seqs
            lora = self.lora_running
            skipped: list[ReqState] = []
            while waiting and budget > 0 and len(running) < max_seqs:
                st = waiting[0]
                if lora is not None and st.lora and st.lora not in lora and len(lora) >= self.max_loras:
                    skipped.append(waiting.popleft())  # one adapter too many: vLLM skips it, admits those behind
                    continue
                if st.keys:
                    hit, entries, lost_evictable = self._lookup(st)
                else:
                    hit, entries, lost_evictable = 0, [], 0
                n = st.prompt + st.g - hit
                if n > budget:
                    n = budget
                nb = -(-(hit + n) // bs) - hit // bs
                if nb > self.num_free + self.evictable - lost_evictable:
                    break
                waiting.popleft()
                for e in entries:
                    if e.refs == 0:
                        del self.lru[e.key]
                        self.evictable -= e.blocks
                    e.refs += 1
                st.entries = entries
                st.n_keyed = len(entries)
                st.shared_blocks = hit // bs
                st.c = hit
                st.phase = PREFILL
                if not st.admitted:
                    st.admitted = True
                    st.first_scheduled_s = now
                    st.prefix_hit_tokens = hit
                if self.num_free >= nb:
                    self.num_free -= nb
                else:
                    self._allocate(nb)
                running.append(st)
                self.prefilling.append(st)
                plan.append((st, n))
                budget -= n
                if lora is not None and st.lora:
                    a = st.lora
                    if a in lora:
                        lora[a] += 1
                    else:
                        lora[a] = 1
                        stall += self._activate(a)
            if skipped:
                waiting.extendleft(reversed(skipped))
        D = self.n_dec
        if not plan and not D:
            if self.running or self.waiting:
                raise RuntimeError(f"replica {self.replica_id}: scheduler made no progress")  # pragma: no cover
            self.mode = IDLE
            self.event_s = None
            return
        prefill = 0
        ctx = self.sum_base + D * (self.step + 1)
        attn = 0.0
        for st, n in plan:
            c = st.c
            prefill += n
            ctx += c + n
            attn += n * (c + 0.5 * n)
        self._plan = plan
        self.mode = ITER
        self.event_s = now + self.factor * self.co.iteration_time(prefill, D, ctx, attn, len(plan)) + stall

    def _finish_iteration(self, now: float) -> None:
        self.step = step = self.step + 1
        self.n_iterations += 1
        for st, n in self._plan:
            if st.phase != PREFILL:
                continue  # pragma: no cover - a planned request cannot leave mid-iteration
            st.c = c = st.c + n
            if st.keys and self.prefix_caching and st.n_keyed < len(st.keys):
                self._register(st)
            if c == st.prompt + st.g:
                st.g = g = st.g + 1
                if g == 1:
                    st.first_token_s = now
                    self.outputs.append((FIRST, st, now))
                self.prefilling.remove(st)
                if g >= st.output:
                    self._complete(st, now)
                else:
                    st.phase = DECODE
                    st.base = base = c - step
                    self.hist[base % self.bs] += 1
                    self.n_dec += 1
                    self.sum_base += base
                    self._seq = seq = self._seq + 1
                    heapq.heappush(self.finish_heap, (st.prompt + st.output - 1 - base, seq, st))
        self._plan = []
        h = self.finish_heap
        if h and h[0][0] <= step:
            self._complete_decodes(now)

    def _complete_decodes(self, now: float) -> None:
        h = self.finish_heap
        step = self.step
        while h and h[0][0] <= step:
            fs, _, st = heapq.heappop(h)
            if st.phase == DECODE and st.prompt + st.output - 1 - st.base == fs:
                st.c = st.base + step
                st.g = st.c - st.prompt + 1
                self._complete(st, now)

    def _complete(self, st: ReqState, now: float) -> None:
        self._release(st)
        self.running.remove(st)
        st.phase = DONE
        st.finish_s = now
        self.outputs.append((COMPLETE, st, now))

    # ---- KV blocks -----------------------------------------------------------------------------

    def _allocate(self, n: int) -> None:
        if self.num_free < n:
            lru = self.lru
            while self.num_free < n:
                _, e = lru.popitem(last=False)
                del self.cache[e.key]
                self.num_free += e.blocks
                self.evictable -= e.blocks
        self.num_free -= n

    def _release(self, st: ReqState) -> None:
        """Free a running request's own blocks and drop its cache references."""
        if st.lora:
            lora = self.lora_running
            if lora[st.lora] == 1:  # type: ignore[index]
                del lora[st.lora]  # type: ignore[union-attr]
            else:
                lora[st.lora] -= 1  # type: ignore[index]
        if st.phase == DECODE:
            st.c = st.base + self.step
            self.hist[st.base % self.bs] -= 1
            self.n_dec -= 1
            self.sum_base -= st.base
        self.num_free += -(-st.c // self.bs) - st.shared_blocks
        for e in st.entries:
            e.refs -= 1
            if e.refs == 0:
                self.lru[e.key] = e
                self.evictable += e.blocks
        st.entries = []
        st.shared_blocks = 0

    def _preempt(self, st: ReqState) -> None:
        self._release(st)
        self.running.pop()  # st is the tail
        if st.phase == PREFILL:
            self.prefilling.remove(st)
        st.phase = WAITING
        st.c = 0
        st.n_keyed = 0
        st.epoch += 1
        st.preemptions += 1
        self.n_preemptions += 1
        self.waiting.appendleft(st)

    # ---- LoRA adapters -------------------------------------------------------------------------

    def _activate(self, a: int) -> float:
        """Adapter `a` into a GPU slot for the batch being planned: the seconds that stalls the iteration."""
        gpu = self._gpu_loras
        if a in gpu:
            gpu.move_to_end(a)
            return 0.0
        if len(gpu) >= self.max_loras:  # a slot no running request uses (admission keeps one free for `a`)
            running = self.lora_running
            del gpu[next(b for b in gpu if b not in running)]  # type: ignore[operator]
        gpu[a] = None
        self.n_lora_swaps += 1
        cost = self.lora_swap_s
        cpu = self._cpu_loras
        if a in cpu:
            cpu.move_to_end(a)
        else:
            cpu[a] = None
            self.n_lora_loads += 1
            cost += self.lora_load_s
            if len(cpu) > self.max_cpu_loras:
                del cpu[next(b for b in cpu if b not in gpu)]
        return cost

    # ---- prefix cache --------------------------------------------------------------------------

    def _prepare_keys(self, st: ReqState) -> None:
        if not self.prefix_caching or not st.keys:
            st.keys = ()
            return
        bt = st.req.block_tokens
        if bt % self.bs:
            raise ValueError(
                f"request {st.req.request_id}: block_tokens={bt} is not a multiple of the KV block size {self.bs}"
            )
        full, ends = [], []
        for j in range(len(st.keys)):
            start = j * bt
            n = max(0, min(bt, st.prompt - start)) // self.bs
            if n == 0:
                break
            full.append(n)
            ends.append(start + n * self.bs)
            if n < bt // self.bs:
                break
        st.keys = st.keys[: len(full)]
        st.full_blocks = full
        st.ends = ends

    def _lookup(self, st: ReqState) -> tuple[int, list[_Entry], int]:
        """(cached prefix tokens usable now, entries to reference, their evictable blocks)."""
        if not st.keys:
            return 0, [], 0
        cache = self.cache
        cap = ((st.prompt + st.g - 1) // self.bs) * self.bs  # vLLM recomputes at least one token
        hit = 0
        entries: list[_Entry] = []
        lost = 0
        for key, full in zip(st.keys, st.full_blocks):
            if hit >= cap:
                break
            e = cache.get(key)
            if e is None:
                break
            use = min(e.blocks, full, (cap - hit) // self.bs)
            if use <= 0:
                break
            hit += use * self.bs
            entries.append(e)
            if e.refs == 0:
                lost += e.blocks
            if use < full:
                break
        return hit, entries, lost

    def _register(self, st: ReqState) -> None:
        """Publish the request's fully computed id blocks to the cache (as vLLM hashes full blocks)."""
        j = st.n_keyed
        # an entry the request references only partially may be extended with the blocks it computed
        if j > 0 and st.entries and len(st.entries) == j:
            e = st.entries[-1]
            if e.blocks < st.full_blocks[j - 1] and st.c >= st.ends[j - 1] and e.refs == 1:
                st.shared_blocks += st.full_blocks[j - 1] - e.blocks
                e.blocks = st.full_blocks[j - 1]
        cache = self.cache
        while j < len(st.keys) and st.c >= st.ends[j]:
            key = st.keys[j]
            if key in cache or len(st.entries) != j:
                break  # computed twice concurrently: this copy stays private to the request
            e = _Entry(key, st.full_blocks[j])
            cache[key] = e
            st.entries.append(e)
            st.shared_blocks += e.blocks
            j += 1
        st.n_keyed = j
