"""What etcd's JSON gateway sends back, checked: values in base64 (``b64``, ``unb64``) and
replies of the shape the v3 API gives them (``reply_dict``, ``reading_reply``). A reply
of any other shape (tampered, truncated, not etcd) is a ``MalformedReply`` in one line,
never an exception that ends the caller's thread.

May import core's ``interfaces``.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from typing import Any

from elastic.core.interfaces.rendezvous import RendezvousConnectionError


def b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def unb64(text: object) -> bytes:
    """Bytes etcd sent as base64; anything else (a tampered or truncated reply) is refused
    in one line (``MalformedReply``), never a crash."""
    if not text:
        return b""
    try:
        if not isinstance(text, str):
            raise TypeError(f"a {type(text).__name__}")
        return base64.b64decode(text, validate=True)
    except (TypeError, ValueError) as exc:
        raise MalformedReply(f"a value that is not base64 ({exc})") from None


class MalformedReply(RendezvousConnectionError):
    """etcd's answer does not have the shape its API gives it: retried, or said in one
    line, like an answer that never came."""


def reply_dict(reply: object, field: str) -> dict[str, Any]:
    """``reply[field]`` when both are JSON objects; ``{}`` when the field is missing."""
    if not isinstance(reply, dict):
        raise MalformedReply(f"a reply that is not a JSON object: {str(reply)[:60]!r}")
    value = reply.get(field, {})
    if not isinstance(value, dict):
        raise MalformedReply(f"{field!r} is not a JSON object: {str(value)[:60]!r}")
    return value


@contextlib.contextmanager
def reading_reply(where: str, path: str) -> Iterator[None]:
    """Reading etcd's answer to ``path``: one of an unexpected shape is a
    ``MalformedReply`` naming it, never an exception that ends the caller's thread."""
    try:
        yield
    except MalformedReply as exc:
        raise MalformedReply(f"etcd at {where} sent a malformed reply to {path}: {exc}") from None
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError) as exc:
        what = f"{type(exc).__name__}: {exc}"[:120]
        raise MalformedReply(f"etcd at {where} sent a malformed reply to {path} ({what})") from None
