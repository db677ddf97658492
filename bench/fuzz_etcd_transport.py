"""The transport the etcd targets of ``fuzz_targets.py`` put under the real clients:
``Pool`` stands in for urllib3's connection pool and answers every request with the
fuzzed bytes, so python-etcd, our v2 and v3 clients and both stores parse them;
``answer_every_op`` runs one input through a store's operations."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any


class Body(io.BytesIO):
    """A reply body that ends as a socket's does: closed once read to its end (a BytesIO
    stays open, and urllib3's stream would wait on it for ever)."""

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        if not data:
            self.close()
        return data

    def read1(self, size: int | None = -1) -> bytes:
        return self.read(size)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


class Pool:
    """Stands in for urllib3's pool: every request is answered with the fuzzed bytes, so
    the real client and store parse them."""

    def __init__(self) -> None:
        self.body, self.status = b"", 200

    def _response(self, preload: bool) -> Any:
        import urllib3

        return urllib3.HTTPResponse(
            body=Body(self.body),
            status=self.status,
            headers={"X-Etcd-Index": "1", "Content-Type": "application/json"},
            preload_content=preload,
        )

    def request(self, *args: Any, preload_content: bool = True, **kw: Any) -> Any:
        return self._response(preload_content)

    def request_encode_body(self, *args: Any, preload_content: bool = True, **kw: Any) -> Any:
        return self._response(preload_content)

    urlopen = request

    def clear(self) -> None:
        pass


STATUSES = (200, 200, 200, 201, 400, 401, 403, 404, 412, 500, 503)


def reads_and_writes(store: Any) -> tuple[Callable[[], object], ...]:
    """The ops every etcd store parses a reply of: a multi-get, both compare-and-sets, adds."""
    return (
        lambda: store.multi_get(["a", "b"]),
        lambda: store.compare_set("a", b"x", b"y"),
        lambda: store.compare_set("a", b"", b"y"),
        lambda: store.add("c", 1),
        lambda: store.add("c", 0),
    )


def answer_every_op(
    pool: Pool,
    data: bytes,
    ops: tuple[Callable[[], object], ...],
    slow: tuple[Callable[[], object], ...],
    refusals: tuple[type[Exception], ...],
) -> None:
    """One input against a store whose transport is ``pool``: the first byte picks the
    reply's status, the rest is the body every op parses; the first byte's top bit adds the
    ``slow`` ops (waits and watches, which pause when they fail: half the inputs).
    ``refusals`` are the errors that are the ops' logical outcomes."""
    if not data:
        return
    pool.status, pool.body = STATUSES[data[0] % len(STATUSES)], data[1:]
    for op in ops + (slow if data[0] & 0x80 else ()):
        try:
            op()
        except refusals:
            pass
