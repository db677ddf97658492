"""etcd v2 client creation and transient-error retry, shared by the ``etcd`` and ``etcd-v2``
rendezvous backends.

python-etcd's own reconnect logic (``allow_reconnect``) contacts the cluster while the
client is constructed, logs tracebacks at ERROR level and gives up after one pass over the
member list. We instead keep one plain client per configured endpoint, retry transient
failures (a member restarting, a leader election, a dropped connection) with backoff while
rotating over the members, and turn whatever is left into one-line rendezvous errors.
A call marked ``hedge`` (idempotent: a read, a plain write) is also sent to the other
members when unanswered after ``hedge_after`` (core's ``rendezvous.hedging``): a member
that hangs (its link cut) or holds a write for a leader that died costs no more.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any

from elastic.core.interfaces.rendezvous import (
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousParameters,
)
from elastic.core.plugin.extras import needs_extra
from elastic.core.rendezvous import hedging
from elastic.core.rendezvous.secrets import read_password

with needs_extra("the etcd and etcd-v2 rendezvous backends"):
    import etcd
    import urllib3

DEFAULT_PORT = 2379

# python-etcd logs every failed request (with a traceback for unexpected ones) before
# raising; we report failures ourselves, once and in one line, so keep it quiet.
logging.getLogger("etcd.client").setLevel(logging.CRITICAL)

# Errors that describe the data, not the connection: callers handle them.
LOGICAL_ERRORS: tuple[type[BaseException], ...] = (
    etcd.EtcdKeyError,  # not found, already exists, not a file/dir
    etcd.EtcdValueError,  # compare failed, dir not empty, bad value
    etcd.EtcdEventIndexCleared,
    etcd.EtcdWatchTimedOut,
)


# What python-etcd lets escape on an answer of an unexpected shape (an error body that is
# not UTF-8, a tampered reply): retried like a failed request, never a crash of the caller.
MALFORMED: tuple[type[BaseException], ...] = (
    ValueError,
    TypeError,
    KeyError,
    AttributeError,
    RecursionError,
)


class EtcdAuthError(RendezvousConnectionError):
    """etcd refused our credentials or our TLS setup; retrying cannot help."""


class _Unanswered(Exception):
    """A member failed a hedged call in a way another member may not (``error``)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def parse_endpoints(endpoint: str, default_port: int = DEFAULT_PORT) -> list[tuple[str, int]]:
    """``"h1:2379,h2,[::1]:2380"`` -> ``[("h1", 2379), ("h2", 2379), ("::1", 2380)]``."""
    members: list[tuple[str, int]] = []
    for raw in endpoint.split(","):
        item = raw.strip()
        for scheme in ("http://", "https://"):
            if item.startswith(scheme):
                item = item[len(scheme) :]
        item = item.rstrip("/")
        if not item:
            continue
        host, port = item, default_port
        if item.startswith("["):  # [v6]:port
            close = item.find("]")
            host = item[1:close]
            rest = item[close + 1 :]
            if rest.startswith(":"):
                port = _port(rest[1:], endpoint)
        elif item.count(":") == 1:
            host, port_s = item.split(":")
            port = _port(port_s, endpoint)
        members.append((host or "127.0.0.1", port))
    if not members:
        raise RendezvousConfigError(f"--rdzv-endpoint {endpoint!r} names no etcd member")
    return members


def _port(text: str, endpoint: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise RendezvousConfigError(f"--rdzv-endpoint {endpoint!r}: bad port {text!r}") from None
    if not 0 < port < 65536:
        raise RendezvousConfigError(f"--rdzv-endpoint {endpoint!r}: bad port {port}")
    return port


@dataclass
class ClientConfig:
    endpoint: str
    protocol: str = "http"
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    username: str | None = None
    password: str | None = None
    read_timeout: float = 10.0  # one HTTP request (watches pass their own)
    retry_timeout: float = 30.0  # how long transient failures are retried
    hedge_after: float | None = None  # a ``hedge`` call also asks the others after this

    def __post_init__(self) -> None:
        self.protocol = (self.protocol or "http").strip().lower()
        if self.protocol not in ("http", "https"):
            raise RendezvousConfigError(
                f"--rdzv-conf protocol={self.protocol!r}: must be http or https"
            )
        if self.read_timeout <= 0 or self.retry_timeout <= 0:
            raise RendezvousConfigError("etcd read_timeout and retry_timeout must be positive")


def _is_tls_failure(exc: BaseException) -> bool:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, ssl.SSLError | urllib3.exceptions.SSLError):
            return True
        cur = getattr(cur, "cause", None) or cur.__cause__ or cur.__context__
    return "CERTIFICATE_VERIFY_FAILED" in str(exc) or "SSL" in str(exc)


def _one_line(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    text = str(cause) if cause is not None else str(exc)
    return " ".join(text.split())[:300]


class EtcdClient:
    """Thread-safe wrapper: one python-etcd client per member, retried calls."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.members = parse_endpoints(config.endpoint)
        self._clients = [self._make(host, port) for host, port in self.members]
        self._current = 0
        self._lock = threading.Lock()
        self._hedges = hedging.Budget()

    def _make(self, host: str, port: int) -> etcd.Client:
        cfg = self.config
        cert: str | tuple[str, str] | None = cfg.cert
        if cfg.cert and cfg.key:
            cert = (cfg.cert, cfg.key)
        client = etcd.Client(
            host=host,
            port=port,
            protocol=cfg.protocol,
            read_timeout=cfg.read_timeout,
            cert=cert,
            ca_cert=cfg.ca_cert,
            username=cfg.username,
            password=cfg.password,
            allow_reconnect=False,  # we rotate over members ourselves
        )
        # Same pool settings as python-etcd, but without urllib3's own silent retries:
        # our loop retries with backoff and can move to another member.
        kw: dict[str, Any] = {"maxsize": 64, "timeout": cfg.read_timeout, "retries": False}
        if isinstance(cert, tuple):
            kw["cert_file"], kw["key_file"] = cert
        elif cert:
            kw["cert_file"] = cert
        if cfg.ca_cert:
            kw["ca_certs"] = cfg.ca_cert
            kw["cert_reqs"] = ssl.CERT_REQUIRED
        client.http = urllib3.PoolManager(num_pools=10, **kw)
        return client

    def close(self) -> None:
        """Close the pooled connections that are idle (one in use closes when its call
        ends); a later call opens new ones."""
        for client in self._clients:
            client.http.clear()

    def url(self) -> str:
        return ",".join(f"{self.config.protocol}://{h}:{p}" for h, p in self.members)

    def _client(self) -> tuple[int, etcd.Client]:
        with self._lock:
            return self._current, self._clients[self._current]

    def _rotate(self, failed: int) -> None:
        with self._lock:
            if self._current == failed:
                self._current = (failed + 1) % len(self._clients)

    def call(
        self,
        op: str,
        *args: Any,
        retry_for: float | None = None,
        hedge: bool = False,
        **kwargs: Any,
    ) -> Any:
        """``client.<op>(*args, **kwargs)``, retrying transient failures; ``hedge``: the
        call is idempotent and may go to several members at once (``hedge_after``).

        Raises the python-etcd error for logical outcomes (key not found, compare failed),
        ``EtcdAuthError`` for credential/TLS problems and ``RendezvousConnectionError``
        once transient failures persisted for ``retry_for`` (default: retry_timeout).
        """
        limit = self.config.retry_timeout if retry_for is None else retry_for
        deadline = time.monotonic() + limit
        delay = 0.05
        while True:
            index, client = self._client()
            try:
                if hedge and self.config.hedge_after is not None and len(self._clients) > 1:
                    return self._hedged(index, op, args, kwargs)
                return getattr(client, op)(*args, **kwargs)
            except LOGICAL_ERRORS:
                raise
            except etcd.EtcdInsufficientPermissions as exc:
                user = self.config.username or "(none)"
                raise EtcdAuthError(
                    f"etcd at {self.url()} refused the request for user {user}: "
                    f"{_one_line(exc)} (check --rdzv-conf username/password)"
                ) from None
            except (etcd.EtcdException, urllib3.exceptions.HTTPError, OSError, *MALFORMED) as exc:
                if _is_tls_failure(exc):
                    raise EtcdAuthError(
                        f"TLS connection to etcd at {self.url()} failed: {_one_line(exc)} "
                        "(check the CA/cert/key files in --rdzv-conf)"
                    ) from None
                self._rotate(index)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RendezvousConnectionError(
                        f"cannot reach etcd at {self.url()} (retried for {limit:.0f}s): "
                        f"{_one_line(exc)}"
                    ) from None
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, 1.0)

    def _hedged(self, first: int, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``op`` on the members from ``first`` on (``hedging.first_answer``); when every
        one failed, the last one's error, for ``call`` to handle."""

        def ask(index: int) -> Any:
            try:
                return getattr(self._clients[index], op)(*args, **kwargs)
            except (*LOGICAL_ERRORS, etcd.EtcdInsufficientPermissions):
                raise
            except (etcd.EtcdException, urllib3.exceptions.HTTPError, OSError, *MALFORMED) as exc:
                raise _Unanswered(exc) from exc

        order = [(first + k) % len(self._clients) for k in range(len(self._clients))]
        assert self.config.hedge_after is not None
        try:
            index, answer = hedging.first_answer(
                order, ask, self.config.hedge_after, self._hedges, _Unanswered,
                self.config.read_timeout,
            )  # fmt: skip
        except hedging.AllFailed as failed:
            last = failed.failures[-1][1]
            assert isinstance(last, _Unanswered)
            raise last.error from None
        with self._lock:
            self._current = index  # it answers: ask it first from now on
        return answer

    def watch(
        self, key: str, index: int | None, timeout: float, recursive: bool = False
    ) -> etcd.EtcdResult | None:
        """Wait up to ``timeout`` for a change at ``key`` from ``index`` on; None if none.

        Connection trouble also returns None (after a short pause) so the caller re-reads
        its state through ``call``, which applies the retry deadline.
        """
        if timeout <= 0:
            return None
        _, client = self._client()
        try:
            return client.watch(key, index=index, timeout=timeout, recursive=recursive)
        except (etcd.EtcdWatchTimedOut, etcd.EtcdEventIndexCleared, etcd.EtcdKeyNotFound):
            return None
        except (etcd.EtcdException, urllib3.exceptions.HTTPError, OSError, *MALFORMED):
            time.sleep(min(0.2, timeout))
            return None


def check_reachable(client: EtcdClient) -> None:
    """Fail fast, in one line, when etcd cannot be reached or refuses us."""
    try:
        client.call("read", "/", retry_for=min(client.config.retry_timeout, 10.0))
    except etcd.EtcdKeyError:
        pass


def client_from_params(
    params: RendezvousParameters,
    *,
    ca_key: str,
    cert_key: str,
    key_key: str,
    max_attempt: float | None = None,
    hedge_after: float | None = None,
) -> EtcdClient:
    """Build the client from ``--rdzv-endpoint``/``--rdzv-conf`` (TLS key names differ
    between the two backends, after torchrun). ``max_attempt`` caps ``read_timeout``
    (one request on one member); ``hedge_after``: ``ClientConfig``'s."""
    read_timeout = params.get_as_float("read_timeout", 10.0) or 10.0
    config = ClientConfig(
        endpoint=params.endpoint or f"127.0.0.1:{DEFAULT_PORT}",
        protocol=params.get("protocol", "http") or "http",
        ca_cert=params.get(ca_key),
        cert=params.get(cert_key),
        key=params.get(key_key),
        username=params.get("username"),
        password=read_password(params),  # or password_file, or the environment
        read_timeout=min(read_timeout, max_attempt or read_timeout),
        retry_timeout=params.get_as_float("retry_timeout", 30.0) or 30.0,
        hedge_after=hedge_after,
    )
    return EtcdClient(config)


# --rdzv-conf keys both backends accept for the connection itself.
CONNECTION_KEYS = (
    "protocol",
    "username",
    "password",
    "password_file",
    "read_timeout",
    "retry_timeout",
)
