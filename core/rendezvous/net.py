"""Addresses and ports, one implementation for every backend and the CLI.

``parse_endpoint`` is the only parser of ``HOST[:PORT]`` (``[v6]:PORT`` too); callers
turn its ``ValueError`` into their own one-line message. ``free_port`` picks a port for a
round's workers (``MASTER_PORT``), ``route_address`` the address other nodes reach us at.
"""

from __future__ import annotations

import socket

from elastic.core.tcpstore.dial import lookup_name


def parse_endpoint(endpoint: str, default_port: int | None) -> tuple[str, int | None]:
    """``host``, ``host:port`` or ``[v6]:port`` -> (host, port); port 0..65535.

    A bare IPv6 address without brackets is a host with no port. Raises ``ValueError``
    with a message naming what is wrong and what would be right.
    """
    text = endpoint.strip()
    host, port_text = text, ""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else rest
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    if not host:
        raise ValueError(f"{endpoint!r} has no host; expected HOST[:PORT]")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(
            f"{endpoint!r}: {port_text!r} is not a port; expected HOST[:PORT] with PORT in 0..65535"
        )
    return host, int(port_text)


def join_host_port(host: str, port: int) -> str:
    """The inverse of ``parse_endpoint``: ``host:port``, or ``[v6]:port``."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def resolve(host: str, port: int) -> list[tuple[int, str]]:
    """(family, address) pairs for ``host``, IPv4 first (what other nodes most likely
    use). Raises ``OSError`` (``socket.gaierror``) when the name does not resolve."""
    infos = socket.getaddrinfo(lookup_name(host), port, type=socket.SOCK_STREAM)
    seen: list[tuple[int, str]] = []
    for family, _, _, _, addr in sorted(infos, key=lambda i: i[0] != socket.AF_INET):
        pair = (family, str(addr[0]))
        if pair not in seen:
            seen.append(pair)
    return seen


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host``: what the other nodes reach."""
    try:
        candidates = resolve(host, port)
    except OSError:
        candidates = []
    for family, addr in candidates:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            try:
                sock.connect((addr, port))  # UDP: picks a route, sends nothing
                return str(sock.getsockname()[0])
            except OSError:
                continue
    return socket.gethostbyname(socket.gethostname())


def free_port(addr: str = "") -> int:
    """A port nothing listens on right now on ``addr`` ("" = every interface, as rank 0's
    worker store will listen; an address that is not ours falls back to that)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((addr, 0))
        except OSError:
            sock.bind(("", 0))
        return int(sock.getsockname()[1])


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` (an IP address, v4 or v6, a v4-mapped one too) is a loopback one."""
    import ipaddress  # here: every agent imports this module, a store host alone asks this

    try:
        ip = ipaddress.ip_address(addr.split("%")[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback
