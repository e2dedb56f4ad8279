"""Where each request begins and ends in a client's byte stream, on a connection that aiohttp's server side
serves (router.http.listener.GuardedHandler): what its guards need and aiohttp's public interface does not tell.

Heads end at their blank line; a body is Content-Length bytes or a chunked body (chunks, then trailers). The guards
ask whether the connection is between requests (every head answered, none begun), whether a head is under way and
whether it began that way (`measured`: a head pipelined behind an unanswered request meets aiohttp's own limits).
A stream this reader cannot follow (Upgrade, CONNECT, a Content-Length that is not a number, a chunk line or a
pipelined head beyond any limit) is `lost`: the guards stop there, and aiohttp's parser, which refuses what is
malformed and closes, decides alone.
"""

from __future__ import annotations

HEAD, BODY, CHUNK_LINE, CHUNK_DATA, TRAILER, LOST = range(6)
MAX_LINE = 8192  # a chunk-size or trailer line
MAX_UNMEASURED_HEAD = 1 << 21  # a pipelined head (aiohttp's own limits: 128 headers of max_field_size each)


def _values(low: bytes, name: bytes) -> bytes:
    """The value of the (lowercased) head's field `name` (with its CRLF and colon); several fields joined by commas."""
    values, at = [], low.find(name)
    while at >= 0:
        start = at + len(name)
        end = low.find(b"\r\n", start)
        values.append(low[start:end if end >= 0 else len(low)].strip())
        at = low.find(name, start)
    return b",".join(values)


class RequestFraming:
    """Counts request heads (`heads`) and, told by the handler, answers (`answered`)."""

    __slots__ = ("heads", "answered", "first_line", "measured", "_state", "_head", "_left", "_chunk_line")

    def __init__(self) -> None:
        self.heads = 0
        self.answered = 0
        self.first_line = b""  # the connection's first request line
        self.measured = True  # the head under way (or next) began with every earlier request answered
        self._state = HEAD
        self._head = bytearray()  # the head under way, as received so far
        self._left = 0  # body bytes, or chunk bytes and their CRLF, still to come
        self._chunk_line = bytearray()

    @property
    def lost(self) -> bool:
        return self._state == LOST

    @property
    def head_bytes(self) -> int:
        """Bytes of the head under way (0 between requests or in a body)."""
        return len(self._head) if self._state == HEAD else 0

    @property
    def between(self) -> bool:
        """Every head answered, no byte of another received."""
        return self._state == HEAD and not self._head and self.heads == self.answered

    @property
    def unanswered(self) -> bool:
        return self.heads > self.answered

    def head_end(self, data: bytes) -> int:
        """Where the head under way would end in `data` (its offset past the blank line), or -1."""
        window = bytes(self._head[-3:]) + data
        end = window.find(b"\r\n\r\n")
        return -1 if end < 0 else end + 4 - min(3, len(self._head))

    def feed(self, data: bytes) -> None:
        i, n = 0, len(data)
        while i < n:
            state = self._state
            if state == HEAD:
                if self._head:
                    end = self.head_end(data[i:])
                    if end >= 0:
                        end += i
                else:  # a head begins (the common case: a read that holds the whole request)
                    if data.startswith(b"\r\n", i):  # empty lines before a request line are skipped (as aiohttp)
                        i += 2
                        continue
                    self.measured = self.heads == self.answered
                    end = data.find(b"\r\n\r\n", i)
                    if end >= 0:
                        end += 4
                if end < 0:
                    self._head += data[i:]
                    if len(self._head) > MAX_UNMEASURED_HEAD:
                        self._lose()
                    return
                if self._head:
                    self._head += data[i:end]
                    head, self._head = bytes(self._head), bytearray()
                else:
                    head = data[i:end]
                i = end
                self._after_head(head)
            elif state == BODY or state == CHUNK_DATA:
                take = min(self._left, n - i)
                self._left -= take
                i += take
                if not self._left:
                    self._state = HEAD if state == BODY else CHUNK_LINE
            elif state == CHUNK_LINE or state == TRAILER:
                end = data.find(b"\n", i)
                self._chunk_line += data[i:n if end < 0 else end + 1]
                if len(self._chunk_line) > MAX_LINE:
                    self._lose()
                    return
                if end < 0:
                    return
                i = end + 1
                line, self._chunk_line = bytes(self._chunk_line).rstrip(b"\r\n"), bytearray()
                if state == TRAILER:
                    if not line:
                        self._state = HEAD
                    continue
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    self._lose()
                    return
                if size:
                    self._state, self._left = CHUNK_DATA, size + 2
                else:
                    self._state = TRAILER
            else:
                return

    def _after_head(self, head: bytes) -> None:
        self.heads += 1
        if self.heads == 1:
            self.first_line = head[:head.find(b"\r\n")]
        low = head.lower()  # fields found by bytes.find: a loop over the lines cost 3 % of a proxied request
        if b"\r\ntransfer-encoding:" in low or b"\r\nupgrade:" in low or low.startswith(b"connect "):
            self._unusual(low)
            return
        at = low.find(b"\r\ncontent-length:")
        if at >= 0:
            value = low[at + 17:low.find(b"\r\n", at + 17)].strip()
            if not value.isdigit():  # aiohttp refuses it and closes (as it does two lengths)
                self._lose()
            elif value != b"0":
                self._state, self._left = BODY, int(value)

    def _unusual(self, low: bytes) -> None:
        """A head with Transfer-Encoding, Upgrade or CONNECT."""
        if b"\r\nupgrade:" in low or low.startswith(b"connect "):
            self._lose()
        elif _values(low, b"\r\ntransfer-encoding:").rsplit(b",", 1)[-1].strip() == b"chunked":
            self._state = CHUNK_LINE
        elif b"\r\ncontent-length:" in low:
            self._lose()  # aiohttp refuses a Transfer-Encoding without chunked last alongside a length

    def _lose(self) -> None:
        self._state = LOST
        self._head = bytearray()
