"""A minimal HTTP/1.1 client for the benchmark's hot path: one POST per connection, the response streamed
as lines (SSE). The load generator must cost far less than the server it measures; a general client (httpx)
spends about a millisecond of CPU per streamed chunk, which on a small machine inflates the TPOT and ITL of
the very server being measured, while plain asyncio streams cost a few microseconds. ``Connection: close``
per request, like vLLM's benchmark client (aiohttp with ``force_close``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

_STREAM_LIMIT = 1 << 24  # longest line accepted: large prompts echoed back, big logprob blocks


class StreamedResponse:
    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: int, headers: dict[str, str]
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.status = status
        self.headers = headers

    async def body_pieces(self) -> AsyncIterator[bytes]:
        r = self.reader
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                size = int((await r.readline()).split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    return
                piece = await r.readexactly(size)
                await r.readexactly(2)  # CRLF after each chunk
                yield piece
        elif "content-length" in self.headers:
            remaining = int(self.headers["content-length"])
            while remaining > 0:
                piece = await r.read(min(remaining, 1 << 16))
                if not piece:
                    raise asyncio.IncompleteReadError(b"", remaining)
                remaining -= len(piece)
                yield piece
        else:
            while piece := await r.read(1 << 16):
                yield piece

    async def lines(self) -> AsyncIterator[bytes]:
        buf = b""
        async for piece in self.body_pieces():
            buf += piece
            if b"\n" not in piece:
                continue
            *complete, buf = buf.split(b"\n")
            for line in complete:
                yield line.rstrip(b"\r")
        if buf:
            yield buf

    async def read(self) -> bytes:
        return b"".join([p async for p in self.body_pieces()])

    def close(self) -> None:
        self.writer.close()


async def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> StreamedResponse:
    u = urlsplit(url)
    if u.scheme not in ("http", "https"):
        raise ValueError(f"unsupported URL scheme in {url!r}")
    tls = u.scheme == "https"
    reader, writer = await asyncio.open_connection(
        u.hostname, u.port or (443 if tls else 80), ssl=True if tls else None, limit=_STREAM_LIMIT
    )
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {u.netloc}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Accept: text/event-stream",
        "Connection: close",
    ]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
    try:
        await writer.drain()
        status_line = await reader.readline()
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
            raise ValueError(f"not an HTTP response: {status_line[:80]!r}")
        resp_headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            resp_headers[key.strip().lower()] = value.strip()
    except BaseException:
        writer.close()
        raise
    return StreamedResponse(reader, writer, int(parts[1]), resp_headers)
