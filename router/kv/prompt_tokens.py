"""A request's prefix blocks from its token ids, as the replica will tokenize it, for the KV view to match.

Two sources of token ids, both cached by prompt prefix (a bounded LRU), so a system prompt is tokenized once, and
both off the request path: a request whose prefix is not cached yet decides on the longest shorter prefix that is,
or on the character estimate, while its prefix is tokenized in the background for the next request that shares it.
With a local tokenizer the request's first 512 characters (its shortest prefix, about 0.1 ms) are tokenized on the
path when nothing shorter is cached, so even a prompt's first request matches the replicas' views on its leading
blocks (another router may have sent the same system prompt before).
- `LocalTokenizer` (`--tokenizer PATH`): the model's tokenizer.json with the HF `tokenizers` library, and its chat
  template rendered with jinja2 as transformers' `apply_chat_template(add_generation_prompt=True)` does, which is
  what vLLM tokenizes (completions with the tokenizer's special tokens, chat without: the template has them). A
  miss is tokenized on one background thread (`encode_batch` releases the GIL, so the event loop runs meanwhile),
  at most MAX_QUEUED prefixes waiting; its result is picked up by the next request.
- a replica's `POST /tokenize` (no tokenizer configured): asked once per distinct prefix, at most max_fetches at once.
Where each request's blocks came from is counted (`sources`: cached, prefix, head, estimate, ids).

The prefix: for a text prompt (or a chat request's rendered text), its first 2^k * 512 characters, cut before a
space (a word's tokens do not depend on what follows it), the last token dropped (the cut's own token may merge
differently); a prompt of at most 512 characters whole. For chat through a replica's /tokenize (no template here):
the messages before the last one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from routewise_vllm.router.policy.kv_view import TokenBlocks, token_prefix_blocks

log = logging.getLogger("router.prompt_tokens")

MIN_PREFIX_CHARS = 512
MAX_PREFIX_CHARS = 1 << 17
MAX_TOKEN_BLOCKS = 1024
MAX_QUEUED = 16  # local tokenizations waiting for the background thread; more misses keep the estimate
# Where a request's prefix blocks came from: its longest prefix cached, a shorter cached prefix, its first 512
# characters tokenized on the path (local tokenizer, nothing cached), nothing (the character estimate), or the token
# ids the request sent
BLOCK_SOURCES = ("cached", "prefix", "head", "estimate", "ids")


def prefix_cuts(n_chars: int) -> list[int]:
    """Prefix lengths (characters) to look up, longest first: 512 * 2^k below n_chars."""
    cuts = []
    c = MIN_PREFIX_CHARS
    while c < n_chars and c <= MAX_PREFIX_CHARS:
        cuts.append(c)
        c *= 2
    return cuts[::-1]


def cut_before_space(text: str, n: int) -> int:
    """The position of the last space at or before n (0: none in the first n characters)."""
    i = text.rfind(" ", 0, n + 1)
    return max(i, 0)


class LocalTokenizer:
    """A model folder's tokenizer.json and chat template (tokenizer_config.json's `chat_template`, or
    chat_template.jinja beside it). No hub: the files are read from `path`."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer  # the router imports these only with --tokenizer

        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer: {folder} has no tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").is_file():
            config = json.loads((folder / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        self.special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.template = None if template is None else _compile(template)

    def completion_ids(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids

    def completion_ids_nogil(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """As completion_ids, with the GIL released while it tokenizes (for a background thread)."""
        return self.tokenizer.encode_batch([prompt], add_special_tokens=add_special_tokens)[0].ids

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if self.template is None:
            raise ValueError("the tokenizer has no chat template")
        return self.template.render(messages=[_string_content(m) for m in messages],
                                    add_generation_prompt=add_generation_prompt, **self.special, **kwargs)

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True, add_special_tokens: bool = False,
                 **kwargs: Any) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt, **kwargs)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def _token_text(v: Any) -> str | None:
    if isinstance(v, dict):  # an AddedToken serialised
        return v.get("content")
    return v if isinstance(v, str) else None


def _string_content(message: Any) -> Any:
    """vLLM's "string" content format: text parts joined with newlines."""
    if isinstance(message, dict) and isinstance(message.get("content"), list):
        parts = [p.get("text", "") if isinstance(p, dict) else str(p) for p in message["content"]]
        return {**message, "content": "\n".join(parts)}
    return message


def _compile(source: str):
    """As transformers compiles a chat template: a sandbox, trim_blocks and lstrip_blocks, loop controls, tojson,
    raise_exception and strftime_now."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        from jinja2.exceptions import TemplateError

        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return env.from_string(source)


class _LRU:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.d: OrderedDict[Any, list[int]] = OrderedDict()

    def get(self, key: Any) -> list[int] | None:
        v = self.d.get(key)
        if v is not None:
            self.d.move_to_end(key)
        return v

    def put(self, key: Any, ids: list[int]) -> None:
        self.d[key] = ids
        self.d.move_to_end(key)
        while len(self.d) > self.max_entries:
            self.d.popitem(last=False)


class PromptBlocks:
    """`of(body, chat)` -> the request's TokenBlocks, or None (use the character estimate). Never tokenizes a new
    prefix on the caller's path: see the module's docstring."""

    def __init__(self, block_size: Callable[[], int | None], local: LocalTokenizer | None = None,
                 fetch: Callable[[str | None, dict], Any] | None = None, observe: Callable[[str, float], None] | None = None,
                 max_entries: int = 4096, max_fetches: int = 4, max_queued: int = MAX_QUEUED) -> None:
        """block_size: the replicas' KV block size (None while unknown). fetch(model, body) -> awaitable token ids of
        one /tokenize body (a replica's), or None. observe(source, seconds): tokenizer latency (called from the
        background thread for source local)."""
        self.block_size = block_size
        self.local = local
        self.fetch = fetch
        self.observe = observe or (lambda source, s: None)
        self.cache = _LRU(max_entries)
        self.max_fetches = max_fetches
        self.fetching: dict[Any, asyncio.Task] = {}
        self.max_queued = max_queued
        self.queued: set[Any] = set()  # local tokenizations submitted, not yet picked up (the request path's only)
        self.done: deque = deque()  # (key, ids or None) from the background thread: appended there, drained here
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.sources: Counter = Counter()
        self.misses = 0
        self.hits = 0

    def of(self, body: dict, chat: bool) -> TokenBlocks | None:
        if self.done:
            self._pick_up()
        bs = self.block_size()
        if bs is None:
            return None
        try:
            ids = self._ids(body, chat)
        except Exception as e:  # noqa: BLE001 - a prompt the tokenizer cannot take keeps the estimate
            log.debug("tokenizing failed: %r", e)
            return None
        if not ids or len(ids) < bs:
            return None
        return token_prefix_blocks(ids, bs, MAX_TOKEN_BLOCKS)

    def _ids(self, body: dict, chat: bool) -> list[int] | None:
        model = body.get("model") if isinstance(body.get("model"), str) else None
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return None
            if self.local is not None:
                kwargs = body.get("chat_template_kwargs") if isinstance(body.get("chat_template_kwargs"), dict) else {}
                text = self.local.render_chat(messages, bool(body.get("add_generation_prompt", True)), **kwargs)
                return self._text_ids(text, bool(body.get("add_special_tokens", False)), model)
            if len(messages) < 2:
                return None
            key = ("chat", model, json.dumps(messages[:-1], sort_keys=True, default=str))
            ids = self.cache.get(key)
            if ids is None:
                self.sources["estimate"] += 1
                self._miss(key, model, {"messages": messages[:-1], "add_generation_prompt": False})
            else:
                self.sources["cached"] += 1
            return ids
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            self.sources["ids"] += 1
            return prompt  # token ids: exact
        if not isinstance(prompt, str):
            return None
        return self._text_ids(prompt, bool(body.get("add_special_tokens", True)), model)

    def _text_ids(self, text: str, special: bool, model: str | None) -> list[int] | None:
        """The token ids of the longest cached prefix of `text`; the longest prefix, when not cached, is tokenized
        (local) or asked of a replica in the background."""
        if len(text) <= MIN_PREFIX_CHARS:
            cuts = [len(text)]
        else:
            cuts = [c for c in (cut_before_space(text, n) for n in prefix_cuts(len(text))) if c > 0]
        if not cuts:
            return None
        for i, c in enumerate(cuts):
            key = ("text", model, special, text[:c])
            ids = self.cache.get(key)
            if ids is not None:
                self.hits += 1
                self.sources["cached" if i == 0 else "prefix"] += 1
                if i > 0:  # a longer prefix is new: learn it for the next request that shares it
                    self._learn(cuts[0], text, special, model)
                return ids
        self.misses += 1
        if self.local is not None:  # the shortest prefix now (cheap), the longest in the background
            head = cuts[-1]
            ids = self._trim(self.local.completion_ids(text[:head], special), head == len(text))
            self.cache.put(("text", model, special, text[:head]), ids)
            self.sources["head"] += 1
            if len(cuts) > 1:
                self._learn(cuts[0], text, special, model)
            return ids
        self.sources["estimate"] += 1
        self._learn(cuts[0], text, special, model)
        if len(cuts) > 1:
            self._learn(cuts[1], text, special, model)
        return None

    def _trim(self, ids: list[int], whole: bool) -> list[int]:
        return ids if whole else ids[:-1]

    def _learn(self, cut: int, text: str, special: bool, model: str | None) -> None:
        key = ("text", model, special, text[:cut])
        if self.local is not None:
            self._submit(key, text[:cut], special, whole=cut == len(text))
            return
        self._miss(key, model, {"prompt": text[:cut], "add_special_tokens": special}, whole=cut == len(text))

    # ---- the local tokenizer, on a background thread
    def _submit(self, key: Any, text: str, special: bool, whole: bool) -> None:
        if key in self.queued or len(self.queued) >= self.max_queued:
            return  # already on its way, or too many waiting: a later request asks again
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
            pool = self._pool
        self.queued.add(key)
        try:
            pool.submit(self._tokenize_local, key, text, special, whole)
        except RuntimeError:  # shut down
            self.queued.discard(key)

    def _tokenize_local(self, key: Any, text: str, special: bool, whole: bool) -> None:
        ids = None
        try:
            t0 = time.perf_counter()
            ids = self._trim(self.local.completion_ids_nogil(text, special), whole)  # type: ignore[union-attr]
            self.observe("local", time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - the estimate stays; asked again by a later request
            log.debug("tokenizing failed: %r", e)
        self.done.append((key, ids))

    def _pick_up(self) -> None:
        """Results of the background thread into the cache (the cache is touched by the request path only)."""
        done = self.done
        while done:
            key, ids = done.popleft()
            self.queued.discard(key)
            if ids:
                self.cache.put(key, ids)

    def drain(self, timeout_s: float = 10.0) -> None:
        """Wait until every queued tokenization has finished and is in the cache (tests and benches)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._pick_up()
            if not self.queued or time.monotonic() > deadline:
                return
            time.sleep(0.001)

    # ---- a replica's /tokenize, as an asyncio task
    def _miss(self, key: Any, model: str | None, body: dict, whole: bool = False) -> None:
        """Ask a replica in the background, at most max_fetches at once (others wait for a later request)."""
        if self.fetch is None or key in self.fetching or len(self.fetching) >= self.max_fetches:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self.fetching[key] = loop.create_task(self._fetch(key, model, body, whole))

    async def _fetch(self, key: Any, model: str | None, body: dict, whole: bool) -> None:
        t0 = time.perf_counter()
        try:
            ids = await self.fetch(model, body)  # type: ignore[misc]
            if ids:
                self.observe("replica", time.perf_counter() - t0)
                # a chat prefix rendered without the generation prompt ends a message: its tokens are the full one's
                self.cache.put(key, ids if whole or key[0] == "chat" else ids[:-1])
        except Exception as e:  # noqa: BLE001 - the estimate stays; asked again by a later request
            log.debug("/tokenize failed: %r", e)
        finally:
            self.fetching.pop(key, None)

    async def close(self) -> None:
        for t in list(self.fetching.values()):
            t.cancel()
        await asyncio.gather(*self.fetching.values(), return_exceptions=True)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
