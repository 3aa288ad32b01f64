"""Where a delivery may go: http(s) URLs whose every address is public, unless allowed.

An endpoint's URL is checked when it is added and again before each send, on the addresses
the name resolves to at that moment; the send then connects to the address that was checked
(not to the name again), so a name that resolves to a public address for the check and to a
private one for the connection (DNS rebinding) reaches nothing inside. Loopback, private,
link-local (cloud metadata: 169.254.169.254), shared (100.64/10), multicast, reserved and
unspecified addresses are refused, and so are IPv4 addresses wrapped in IPv6 and every block
of IANA's special-purpose address registries (:data:`SPECIAL_PURPOSE`: Python's ``is_global``
lets some through, e.g. ``192.0.0.8``, ``fec0::1``, ``3fff::1``);
``BACKFILL_WEBHOOKS_ALLOW_PRIVATE`` allows them (a deployment that posts inside its own
network).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from backfill.errors import InvalidInput

MAX_URL_CHARS = 2048

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Sequence[str]]
"""Host and port -> the addresses to try, in order."""


SPECIAL_PURPOSE: tuple[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str], ...] = tuple(
    (ipaddress.ip_network(block), name)
    for block, name in (
        # IANA IPv4 Special-Purpose Address Registry
        ("0.0.0.0/8", "this network"),
        ("10.0.0.0/8", "private use"),
        ("100.64.0.0/10", "shared address space"),
        ("127.0.0.0/8", "loopback"),
        ("169.254.0.0/16", "link local"),
        ("172.16.0.0/12", "private use"),
        ("192.0.0.0/24", "IETF protocol assignments"),
        ("192.0.2.0/24", "documentation (TEST-NET-1)"),
        ("192.31.196.0/24", "AS112-v4"),
        ("192.52.193.0/24", "AMT"),
        ("192.88.99.0/24", "deprecated 6to4 relay anycast"),
        ("192.168.0.0/16", "private use"),
        ("192.175.48.0/24", "direct delegation AS112 service"),
        ("198.18.0.0/15", "benchmarking"),
        ("198.51.100.0/24", "documentation (TEST-NET-2)"),
        ("203.0.113.0/24", "documentation (TEST-NET-3)"),
        ("224.0.0.0/4", "multicast"),
        ("240.0.0.0/4", "reserved"),
        # IANA IPv6 Special-Purpose Address Registry
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("::ffff:0:0/96", "IPv4-mapped"),
        ("64:ff9b::/96", "IPv4-IPv6 translation (NAT64 reaches IPv4 inside)"),
        ("64:ff9b:1::/48", "local-use IPv4-IPv6 translation"),
        ("100::/64", "discard-only"),
        ("2001::/23", "IETF protocol assignments"),
        ("2001:db8::/32", "documentation"),
        ("2002::/16", "6to4"),
        ("3fff::/20", "documentation"),
        ("5f00::/16", "segment routing (SRv6) SIDs"),
        ("fc00::/7", "unique local"),
        ("fe80::/10", "link-local unicast"),
        ("fec0::/10", "deprecated site-local"),
        ("ff00::/8", "multicast"),
    )
)
"""Blocks of IANA's special-purpose registries a delivery never goes to (unless private
targets are allowed), whatever the registries say of their global reach: none is a tenant's
webhook receiver."""


class TargetRefused(InvalidInput):
    """A webhook URL that may not be delivered to; the message says why."""


@dataclass(frozen=True, slots=True)
class Target:
    """A checked URL: its parts, and the address a send connects to."""

    url: str
    scheme: str
    host: str
    port: int
    path: str
    address: str

    @property
    def connect_url(self) -> str:
        """The URL with the checked address in place of the name."""
        literal = f"[{self.address}]" if ":" in self.address else self.address
        return f"{self.scheme}://{literal}:{self.port}{self.path}"

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        name = f"[{self.host}]" if ":" in self.host else self.host
        return name if self.port == default else f"{name}:{self.port}"


def parse_url(url: str) -> SplitResult:
    """The URL's parts, or ``TargetRefused`` for one Backfill will not post to at all."""
    if len(url) > MAX_URL_CHARS:
        raise TargetRefused(f"the URL is longer than {MAX_URL_CHARS} characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise TargetRefused(f"not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise TargetRefused(f"the URL must be http:// or https://, not {parts.scheme or 'none'}")
    if not parts.hostname:
        raise TargetRefused("the URL has no host")
    if parts.username is not None or parts.password is not None:
        raise TargetRefused("the URL may not carry a user name or password")
    if port == 0:
        raise TargetRefused("the URL's port must be 1-65535")
    return parts


def address_refusal(address: str, *, allow_private: bool) -> str | None:
    """Why a delivery may not connect to ``address``, or None when it may."""
    try:
        ip: IPAddress = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return f"{address!r} is not an IP address"
    if allow_private:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and (
        ip.ipv4_mapped is not None or ip.sixtofour is not None or ip.teredo is not None
    ):
        return f"{ip} wraps an IPv4 address"
    if ip.is_loopback:
        return f"{ip} is a loopback address"
    if ip.is_link_local:
        return f"{ip} is a link-local address (cloud metadata lives there)"
    if ip.is_private:
        return f"{ip} is a private address"
    for block, name in SPECIAL_PURPOSE:
        if ip.version == block.version and ip in block:
            return f"{ip} is in {block}, a special-purpose block ({name})"
    if ip.is_multicast or ip.is_unspecified or ip.is_reserved or not ip.is_global:
        return f"{ip} is not a public unicast address"
    return None


def system_resolver(host: str, port: int) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError) as exc:
        raise TargetRefused(f"{host} does not resolve: {exc}") from None
    seen: list[str] = []
    for info in infos:
        address = str(info[4][0])
        if address not in seen:
            seen.append(address)
    return seen


def check_target(url: str, *, allow_private: bool, resolve: Resolver = system_resolver) -> Target:
    """The URL checked on the addresses its host has now; ``TargetRefused`` if any of them
    is refused (the address a send would pick must not depend on the resolver's order)."""
    parts = parse_url(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    addresses = list(resolve(host, port))
    if not addresses:
        raise TargetRefused(f"{host} resolves to no address")
    for address in addresses:
        reason = address_refusal(address, allow_private=allow_private)
        if reason is not None:
            named = "" if host == address else f"{host} resolves to "
            raise TargetRefused(f"webhook target refused: {named}{reason}")
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    return Target(url, parts.scheme, host, port, path, addresses[0])
