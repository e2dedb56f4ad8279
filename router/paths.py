"""Which client paths reach a replica: the generation endpoints plus an operator-extensible allow-list,
matched on the decoded path. Anything that could name another path after decoding ('.', '..', an encoded
'/', a second round of '%', empty segments) is refused, so `/v1/%2e%2e/reset_prefix_cache` never reaches
vLLM's `/reset_prefix_cache`."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, unquote

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
DEFAULT_PASSTHROUGH_PATHS = ("/v1/models", "/v1/models/*")
PASSTHROUGH_METHODS = frozenset({"GET", "POST"})


@dataclass(frozen=True, slots=True)
class PassthroughConfig:
    """What the passthrough of allow-listed paths reads (router.observe.probes): the settings of the same names
    (RouterSettings.passthrough_config builds it)."""

    passthrough_paths: tuple[str, ...]  # validated: plain absolute paths, '/prefix/*' for a subtree
    max_retries: int  # a failed attempt is tried on another routable replica at most this many times


def normalise_path(raw_path: str) -> str | None:
    """The decoded path, or None when it is not a plain absolute path."""
    if not raw_path.startswith("/") or raw_path == "/":
        return None
    out = []
    for seg in raw_path[1:].split("/"):
        try:
            d = unquote(seg, errors="strict") if "%" in seg else seg
        except UnicodeDecodeError:
            return None
        if d in ("", ".", "..") or "/" in d or "\\" in d or "%" in d or not d.isprintable():
            return None
        out.append(d)
    return "/" + "/".join(out)


def encode_path(path: str) -> str:
    """A normalised path, percent-encoded again for the upstream request line."""
    return quote(path, safe="/:@!$&'()*+,;=-._~")


class PathAllowList:
    """Exact paths and `/prefix/*` entries (one or more further segments)."""

    def __init__(self, entries: list[str] | tuple[str, ...]) -> None:
        self.exact = frozenset(e for e in entries if not e.endswith("/*"))
        self.prefixes = tuple(e[:-1] for e in entries if e.endswith("/*"))  # keeps the trailing '/'

    def allows(self, path: str) -> bool:
        return path in self.exact or any(path.startswith(p) and len(path) > len(p) for p in self.prefixes)
