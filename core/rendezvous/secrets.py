"""The job's secrets, as an agent reads them: the job token and the etcd password.

The job token: ``--rdzv-conf token_file=PATH``, else ``ELASTIC_RDZV_TOKEN_FILE=PATH``,
else ``ELASTIC_RDZV_TOKEN``. The etcd password: ``--rdzv-conf password_file=PATH`` (or
``password``, which ``ps`` shows to every user of the machine), else
``ELASTIC_RDZV_PASSWORD_FILE=PATH``, else ``ELASTIC_RDZV_PASSWORD``. A file holding a
secret must be private to its owner, as ssh requires of a private key: one that group or
others may read or write is refused, with one line naming it and the fix. A token shorter
than ``MIN_TOKEN_LEN`` bytes is warned about (once per process): it can be guessed. None
of the variables reaches the workers (``core/workers/process.py``).
"""

from __future__ import annotations

import logging
import os
import stat

from elastic.core.interfaces.rendezvous import (
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    RendezvousConfigError,
    RendezvousParameters,
)

log = logging.getLogger(__name__)

MIN_TOKEN_LEN = 16  # bytes; `openssl rand -hex 32` gives 64
_warned_short: set[str] = set()


def read_secret_file(path: str, given: str, what: str) -> bytes:
    """The secret in ``path`` (stripped), named ``given`` in errors; refused when group
    or others have any permission on the file."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            secret = f.read().strip()
    except OSError as exc:
        raise RendezvousConfigError(f"{given}: {exc.strerror or exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise RendezvousConfigError(
            f"{given}: permissions {stat.S_IMODE(mode):04o} are too open for a file holding "
            f"the {what}: only its owner may read it (chmod 600 {path})"
        )
    if not secret:
        raise RendezvousConfigError(f"{given}: the file is empty (expected the {what})")
    return secret


def _one_way(file_env: str, inline_env: str, what: str) -> tuple[str, str]:
    path = os.environ.get(file_env, "").strip()
    inline = os.environ.get(inline_env, "").strip()
    if path and inline:
        raise RendezvousConfigError(
            f"{file_env} and {inline_env} are both set: give the {what} one way"
        )
    return path, inline


def read_token(path: str | None) -> bytes | None:
    """The job token (see the module); None for none."""
    if path:
        token = read_secret_file(path, f"--rdzv-conf token_file={path}", "job token")
        given = f"--rdzv-conf token_file={path}"
    else:
        file_env, inline = _one_way(TOKEN_FILE_ENV, TOKEN_ENV, "job token")
        if file_env:
            given = f"{TOKEN_FILE_ENV}={file_env}"
            token = read_secret_file(file_env, given, "job token")
        elif inline:
            given, token = TOKEN_ENV, inline.encode()
        else:
            return None
    if len(token) < MIN_TOKEN_LEN and given not in _warned_short:
        _warned_short.add(given)
        log.warning(
            "the job token from %s is %d bytes: a short token can be guessed; use at least "
            "%d random bytes (openssl rand -hex 32)",
            given,
            len(token),
            MIN_TOKEN_LEN,
        )
    return token


def read_password(params: RendezvousParameters) -> str | None:
    """The etcd password (see the module); None for none."""
    inline, path = params.get("password"), params.get("password_file")
    if inline and path:
        raise RendezvousConfigError(
            "--rdzv-conf password and password_file are both given: give the etcd password one way"
        )
    if inline:
        return inline
    if path:
        return _text(read_secret_file(path, f"--rdzv-conf password_file={path}", "etcd password"))
    file_env, env = _one_way(PASSWORD_FILE_ENV, PASSWORD_ENV, "etcd password")
    if file_env:
        given = f"{PASSWORD_FILE_ENV}={file_env}"
        return _text(read_secret_file(file_env, given, "etcd password"))
    return env or None


def _text(secret: bytes) -> str:
    try:
        return secret.decode()
    except UnicodeDecodeError:
        raise RendezvousConfigError("the etcd password file does not hold UTF-8 text") from None
