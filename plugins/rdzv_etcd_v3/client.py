"""etcd's v3 API through its JSON gateway (``/v3/...``), over urllib3: no gRPC, no v2 API.

One connection pool serves every member of the cluster. ``call`` posts one request and
retries transient failures (refused or dropped connections, a leader election, a member
going away) with backoff, moving to the next member after each failure, until the retry
budget is spent; then it raises ``RendezvousConnectionError`` naming the endpoints
(``RendezvousStoreGoneError`` when every member refused the connection: nothing listens).

A write that is not idempotent (``idempotent=False``) is not retried once it may have
reached the server: a dropped response leaves its outcome unknown, so ``call`` raises
``OutcomeUnknown`` and the caller finds out what happened (see ``EtcdV3Store.add``).

Hedging (``V3Config.hedge_after``; the rule is core's ``rendezvous.hedging``): an
idempotent request unanswered after that long is also sent to every other member, and
the first answer wins.

Authentication: with a username, ``call`` fetches a token from ``/v3/auth/authenticate``
and sends it in the ``Authorization`` header; a token the server no longer knows (expired,
or minted by a member that restarted) is replaced once and the request retried.

Owns the requests, retries, member rotation, authentication and watches. May import
``replies`` (the replies' shape) and core's ``interfaces``, ``plugin`` and
``rendezvous.hedging``.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from elastic.core.interfaces.rendezvous import (
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousStoreGoneError,
)
from elastic.core.plugin.extras import needs_extra
from elastic.core.rendezvous import hedging
from elastic.plugins.rdzv_etcd_v3.replies import b64, reading_reply, reply_dict

with needs_extra("the etcd-v3 rendezvous backend"):
    import urllib3

log = logging.getLogger(__name__)

DEFAULT_PORT = 2379
# A dead host (no RST) should not hold up moving on to the next member for a full read.
CONNECT_TIMEOUT = 3.0
# gRPC status codes the gateway puts in its error bodies.
UNAUTHENTICATED, PERMISSION_DENIED, NOT_FOUND, FAILED_PRECONDITION = 16, 7, 5, 9
# HTTP statuses the gateway maps transient gRPC codes to (Canceled, ResourceExhausted,
# Unknown/Internal, Unavailable, DeadlineExceeded); 502 comes from proxies in between.
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class EtcdV3AuthError(RendezvousConnectionError):
    """etcd refused our credentials, our permissions or our TLS setup: retrying cannot help."""


class LeaseNotFoundError(RendezvousError):
    """A put named a lease the server no longer has (it expired or was revoked)."""


class OutcomeUnknown(Exception):
    """A non-idempotent request may or may not have been applied (its response was lost)."""


class _Transient(Exception):
    def __init__(self, reason: str, kind: str = "other", sent: bool = True) -> None:
        super().__init__(reason)
        # "refused": the member's host answered that nothing listens; "tls-dropped": the
        # member closed the TLS handshake without a word (a crash, or no client cert).
        self.kind = kind
        self.sent = sent  # the request may have reached the server


class _TokenRejected(Exception):
    pass


def parse_endpoints(endpoint: str, default_port: int = DEFAULT_PORT) -> list[tuple[str, int]]:
    """``"h1:2379,https://h2,[::1]:2380"`` -> ``[("h1", 2379), ("h2", 2379), ("::1", 2380)]``
    (the v2 backends' syntax; the scheme comes from ``--rdzv-conf protocol``)."""
    members: list[tuple[str, int]] = []
    for raw in endpoint.split(","):
        item = raw.strip().removeprefix("http://").removeprefix("https://").rstrip("/")
        if not item:
            continue
        host, port_text = item, ""
        if item.startswith("["):
            host, _, rest = item[1:].partition("]")
            port_text = rest.removeprefix(":")
        elif item.count(":") == 1:
            host, _, port_text = item.partition(":")
        if port_text and not (port_text.isdigit() and 0 < int(port_text) < 65536):
            raise RendezvousConfigError(f"--rdzv-endpoint {endpoint!r}: bad port {port_text!r}")
        members.append((host or "127.0.0.1", int(port_text) if port_text else default_port))
    if not members:
        raise RendezvousConfigError(f"--rdzv-endpoint {endpoint!r} names no etcd member")
    return members


@dataclass
class V3Config:
    endpoint: str
    protocol: str = "http"
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    username: str | None = None
    password: str | None = None
    read_timeout: float = 10.0  # one request; a watch is cut into requests this long
    retry_timeout: float = 30.0  # how long transient failures are retried
    hedge_after: float | None = None  # also ask the other members after this long (module)

    def __post_init__(self) -> None:
        self.protocol = (self.protocol or "http").strip().lower()
        if self.protocol not in ("http", "https"):
            raise RendezvousConfigError(
                f"--rdzv-conf protocol={self.protocol!r}: must be http or https"
            )
        if self.read_timeout <= 0 or self.retry_timeout <= 0:
            raise RendezvousConfigError("etcd read_timeout and retry_timeout must be positive")
        if self.hedge_after is not None and self.hedge_after <= 0:
            raise RendezvousConfigError("etcd hedge_after must be positive")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        reason = getattr(cur, "reason", None)  # urllib3's wrappers; ssl's is a string
        cur = (
            cur.__cause__ or cur.__context__ or (reason if isinstance(reason, Exception) else None)
        )


class EtcdV3Client:
    """Thread-safe; ``where`` (``h1:p1,h2:p2``) and ``url`` name the cluster in messages."""

    def __init__(self, config: V3Config) -> None:
        self.config = config
        self.members = parse_endpoints(config.endpoint)
        self.where = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.members)
        self.url = ",".join(f"{config.protocol}://{m}" for m in self.where.split(","))
        tls: dict[str, Any] = {}
        if config.protocol == "https":
            tls = {"cert_reqs": ssl.CERT_REQUIRED, "ca_certs": config.ca_cert}
            tls.update(cert_file=config.cert, key_file=config.key)
        # retries=False: our loop retries, with backoff, and can move to another member.
        # block=False: a long watch holding a connection never stalls other requests.
        self._pool = urllib3.PoolManager(num_pools=8, maxsize=16, retries=False, **tls)
        self._lock = threading.Lock()
        self._current = 0
        self._token: str | None = None
        self._hedges = hedging.Budget()

    def _member(self) -> tuple[int, str]:
        with self._lock:
            index = self._current
        return index, self._base(index)

    def _base(self, index: int) -> str:
        host, port = self.members[index]
        host = f"[{host}]" if ":" in host else host
        return f"{self.config.protocol}://{host}:{port}"

    def _rotate(self, failed: int) -> None:
        with self._lock:
            if self._current == failed:
                self._current = (failed + 1) % len(self.members)

    def _answer(
        self, path: str, body: dict[str, Any], token: str | None, timeout: float, hedge: bool
    ) -> Any:
        """One attempt: the current member's answer or, with ``hedge``, the first of the
        members' (``hedging.first_answer``). Raises ``hedging.AllFailed`` when every
        member asked failed transiently."""
        first, base = self._member()
        if not hedge or len(self.members) == 1:
            try:
                return self._post(base, path, body, token, timeout)
            except _Transient as exc:
                raise hedging.AllFailed([(first, exc)]) from None
        assert self.config.hedge_after is not None
        index, answer = hedging.first_answer(
            [(first + k) % len(self.members) for k in range(len(self.members))],
            lambda i: self._post(self._base(i), path, body, token, timeout),
            self.config.hedge_after,
            self._hedges,
            _Transient,
            timeout,
        )
        with self._lock:
            self._current = index  # it answers: ask it first from now on
        return answer

    def _timeout(self, read: float) -> urllib3.Timeout:
        return urllib3.Timeout(connect=min(CONNECT_TIMEOUT, read), read=read)

    def _post(
        self, base: str, path: str, body: dict[str, Any], token: str | None, timeout: float
    ) -> Any:
        """One POST; returns the decoded JSON or raises a classified error."""
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = token
        try:
            resp = self._pool.request(
                "POST", f"{base}/v3/{path}", body=json.dumps(body).encode(), headers=headers,
                timeout=self._timeout(timeout),
            )  # fmt: skip
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise self._classify(exc) from None
        try:
            data = json.loads(resp.data or b"{}")
        except (ValueError, RecursionError):
            data = None
        if not isinstance(data, dict):  # not etcd's JSON (a proxy's page, a tampered reply)
            data = {"error": resp.data[:200].decode(errors="replace")}
        if resp.status == 200:
            return data
        self._raise_for(resp.status, data, path)

    def _classify(self, exc: BaseException) -> Exception:
        chain = list(_chain(exc))
        tls = any(isinstance(e, ssl.SSLError | urllib3.exceptions.SSLError) for e in chain)
        dropped = any(isinstance(e, ssl.SSLEOFError | ConnectionError) for e in chain)
        if tls and not dropped:  # a certificate refused, a file missing: retrying won't help
            return EtcdV3AuthError(
                f"TLS connection to etcd at {self.url} failed: {_one_line(exc)} "
                "(check the CA/cert/key files in --rdzv-conf)"
            )
        kind = "tls-dropped" if tls else "other"
        if any(isinstance(e, ConnectionRefusedError) for e in chain):
            kind = "refused"
        sent = not isinstance(exc, urllib3.exceptions.ConnectTimeoutError)
        return _Transient(_one_line(exc), kind=kind, sent=sent)

    def _raise_for(self, status: int, data: dict[str, Any], path: str) -> None:
        message = " ".join(str(data.get("error") or data.get("message") or "").split())
        code = data.get("code")
        if code == UNAUTHENTICATED or "auth store is old" in message:
            raise _TokenRejected(message)
        if status in TRANSIENT_STATUS or (code == FAILED_PRECONDITION and "leader" in message):
            raise _Transient(f"{message} (HTTP {status})")
        if code == PERMISSION_DENIED or "user name is empty" in message:
            user = self.config.username or "(none)"
            raise EtcdV3AuthError(
                f"etcd at {self.url} refused {path} for user {user}: {message} "
                "(check --rdzv-conf username/password and the user's role)"
            )
        if "CommonName" in message:  # etcd >= 3.4 with client-cert-auth and v3 auth on
            raise EtcdV3AuthError(
                f"etcd at {self.url} refused our client certificate: {message} (its JSON "
                "gateway takes, with auth on, only certificates without a CommonName)"
            )
        if "authentication failed" in message:
            raise EtcdV3AuthError(
                f"etcd at {self.url} refused user {self.config.username!r}: {message}"
            )
        if code == NOT_FOUND and "lease" in message:
            raise LeaseNotFoundError(message)
        raise RendezvousError(f"etcd at {self.url} rejected {path}: {message} (HTTP {status})")

    def _authenticate(self, stale: str | None) -> str | None:
        """The current token, fetching a new one if there is none or it is ``stale``."""
        if not self.config.username:
            return None
        with self._lock:
            if self._token is not None and self._token != stale:
                return self._token
        body = {"name": self.config.username, "password": self.config.password or ""}
        reply = self.call("auth/authenticate", body, auth=False)
        with reading_reply(self.url, "auth/authenticate"):
            token = str(reply["token"])
        with self._lock:
            self._token = token
        return token

    def call(
        self,
        path: str,
        body: dict[str, Any],
        *,
        idempotent: bool = True,
        retry_for: float | None = None,
        timeout: float | None = None,
        auth: bool = True,
    ) -> Any:
        """POST ``body`` to ``/v3/<path>`` on some member; the decoded JSON reply.
        ``timeout`` bounds each attempt (default ``read_timeout``), ``retry_for`` all."""
        attempt = self.config.read_timeout if timeout is None else timeout
        limit = self.config.retry_timeout if retry_for is None else retry_for
        deadline = time.monotonic() + limit
        delay, tried = 0.05, 0
        streaks: dict[int, tuple[str, int]] = {}  # member -> its last failure kind, in a row
        token = self._authenticate(None) if auth else None
        reauthenticated = False
        hedge = idempotent and self.config.hedge_after is not None
        while True:
            try:
                return self._answer(path, body, token, attempt, hedge)
            except _TokenRejected as exc:
                if not auth or not self.config.username or reauthenticated:
                    raise EtcdV3AuthError(
                        f"etcd at {self.url} requires authentication: {exc} "
                        "(set --rdzv-conf username and password)"
                    ) from None
                token, reauthenticated = self._authenticate(token), True
                continue
            except hedging.AllFailed as failed:
                for index, exc in failed.failures:
                    assert isinstance(exc, _Transient)
                    self._rotate(index)
                    kind, times = streaks.get(index, (exc.kind, 0))
                    streaks[index] = (exc.kind, times + 1 if kind == exc.kind else 1)
                    tried += 1
                if self._every_member(streaks, "tls-dropped", 2):
                    raise EtcdV3AuthError(
                        f"etcd at {self.url} closed every TLS handshake: does it require a "
                        "client certificate? (--rdzv-conf ssl_cert/ssl_cert_key)"
                    ) from None
                exc = failed.failures[-1][1]
                if exc.sent and not idempotent:
                    raise OutcomeUnknown(str(exc)) from None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    gone = self._every_member(streaks, "refused", 1)
                    error = RendezvousStoreGoneError if gone else RendezvousConnectionError
                    raise error(
                        f"cannot reach etcd at {self.url} (retried for {limit:g}s): {exc}"
                    ) from None
                # Another member may answer at once; back off only after trying them all.
                if tried >= len(self.members):
                    tried -= len(self.members)
                    time.sleep(min(delay, remaining))
                    delay = min(delay * 2, 1.0)

    def _every_member(self, streaks: dict[int, tuple[str, int]], kind: str, times: int) -> bool:
        """Every member's last ``times`` failures were of ``kind`` (a crash mid-handshake
        is one failure on one member, a refusal of our setup is the same everywhere)."""
        last = [streaks.get(i, ("", 0)) for i in range(len(self.members))]
        return all(k == kind and n >= times for k, n in last)

    def watch(
        self, key: bytes, range_end: bytes, start_revision: int, timeout: float
    ) -> Iterator[dict[str, Any]]:
        """Events on ``[key, range_end)`` from ``start_revision`` on, for up to ``timeout``
        seconds (one bounded request). Ends early, without raising, when the watch is
        cancelled (compaction, a rejected token) or the member fails: the caller re-reads
        its state through ``call``, which applies the retry budget."""
        deadline = time.monotonic() + timeout
        index, base = self._member()
        token = self._authenticate(None)
        create = {"key": b64(key), "range_end": b64(range_end), "start_revision": start_revision}
        try:
            resp = self._pool.request(
                "POST", f"{base}/v3/watch", body=json.dumps({"create_request": create}).encode(),
                headers={"Authorization": token} if token else {},
                timeout=self._timeout(timeout), preload_content=False,
            )  # fmt: skip
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            self._watch_failed(index, exc)
            return
        buffer = b""
        try:
            if resp.status != 200:
                raise urllib3.exceptions.HTTPError(f"HTTP {resp.status}")
            for chunk in resp.stream(None):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    result = reply_dict(json.loads(line or b"{}"), "result")
                    if result.get("canceled"):
                        reason = str(result.get("cancel_reason", ""))
                        if "auth token" in reason:
                            self._authenticate(token)
                        return
                    events = result.get("events", [])
                    if isinstance(events, list):
                        yield from (e for e in events if isinstance(e, dict))
                if time.monotonic() >= deadline:
                    return
        except urllib3.exceptions.ReadTimeoutError:
            return  # the slice ended with nothing (more) to report
        except (urllib3.exceptions.HTTPError, OSError, ValueError, RecursionError) as exc:
            self._watch_failed(index, exc)
        finally:
            resp.close()  # never hand a half-read stream back to the pool
            resp.release_conn()

    def _watch_failed(self, index: int, exc: BaseException) -> None:
        log.debug("etcd watch on member %d failed: %s", index, _one_line(exc))
        self._rotate(index)
        time.sleep(0.05)  # whatever failed, do not spin on it

    def close(self) -> None:
        self._pool.clear()
