"""Values from replicas, clients and shared state, made fit for one log line.

A model name, a header value, an error text from a replica or a record read from Redis is written by someone
else: printed raw, a newline in it forges a second log line and an escape sequence rewrites the operator's
terminal. `safe` escapes what is not printable as `repr` would (backslash first, so an escape is never
ambiguous) and cuts the value to a bounded length, saying how much was left out.
"""

from __future__ import annotations

MAX_CHARS = 200  # of the value as logged: enough to recognise a name or an error, never a screenful

_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(c: str) -> str:
    e = _ESCAPES.get(c)
    if e is not None:
        return e
    if c.isprintable():
        return c
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def safe(value: object, limit: int = MAX_CHARS) -> str:
    """`value` (str() of it) as one log line can show it: no raw control, separator or format character (CR, LF,
    ESC, NUL, U+2028, bidi overrides...), at most about `limit` characters plus a note of how many were cut."""
    s = value if isinstance(value, str) else str(value)
    if len(s) <= limit and s.isprintable() and "\\" not in s:
        return s  # the common case: nothing to do
    out: list[str] = []
    size = 0
    for i, c in enumerate(s):
        e = _escape(c)
        if size + len(e) > limit:
            return "".join(out) + f"...({len(s) - i} more chars)"
        out.append(e)
        size += len(e)
    return "".join(out)


def safe_exc(exc: BaseException, limit: int = MAX_CHARS) -> str:
    """An exception as `Type: message` (its type alone when the message is empty), through `safe`."""
    text = str(exc)
    return safe(f"{type(exc).__name__}: {text}" if text else type(exc).__name__, limit)
