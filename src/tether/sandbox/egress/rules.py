"""Which hosts a sandboxed command may reach through the egress proxy: rule entries and their verdicts.

Pure functions, standard library only. An entry is `host`, `*.example.com` (any name below it, not
the name itself), `*` (any name), an address (`10.0.0.5`, `[fd00::1]`) or a network (`10.0.0.0/8`),
each optionally with `:port` (`[v6]:port` for IPv6). Names match case-insensitively, without a
trailing dot.

A request is judged twice: by its name before resolution (`judge_name`: deny entries first, then
allow entries), then each resolved address (`judge_address`): a deny entry naming the address
refuses it, and an address that is not public (loopback, RFC 1918, CGNAT, ULA, link-local,
multicast, reserved, ...) is refused unless the allow list names it by address or network, or names
the host explicitly (an exact name: not a wildcard). Every verdict names its rule.

A rule set may lie `within` another (the device's own, when its server narrows it): a connection then
passes both, at each step, so no entry of the outer set opens what the inner one does not (an exact
name the server lists does not open a private address for a name the device allows only by wildcard).
`meet` is the entry-wise intersection of two allow lists, for showing what both allow.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Literal

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")


@dataclass(frozen=True, slots=True)
class Entry:
    """One parsed allow/deny entry. Exactly one of `name`, `suffix`, `network` is set, or none for `*`."""

    text: str
    name: str | None = None  # an exact host name
    suffix: str | None = None  # `*.example.com` -> ".example.com"
    network: IPNetwork | None = None  # an address is a /32 or /128 network
    port: int | None = None

    def port_matches(self, port: int) -> bool:
        return self.port is None or self.port == port

    def matches_name(self, host: str, port: int) -> bool:
        """Whether the entry covers the name (or address literal) `host` the command asked for."""
        if not self.port_matches(port):
            return False
        if self.network is not None:
            address = parse_address(host)
            return address is not None and address.version == self.network.version and address in self.network
        if self.name is not None:
            return host == self.name
        if self.suffix is not None:
            return host.endswith(self.suffix)
        return True  # `*`

    def matches_address(self, address: IPAddress, port: int) -> bool:
        return (self.network is not None and self.port_matches(port) and address.version == self.network.version
                and address in self.network)


def normalize_host(host: str) -> str:
    """A name as rules compare it: lower case, no trailing dot, IPv6 brackets removed."""
    host = host.strip().lower().rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host


def parse_address(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def valid_host(host: str) -> bool:
    """Whether `host` (normalized) is an address or a host name the proxy may resolve: ASCII labels only."""
    if parse_address(host) is not None:
        return True
    return 0 < len(host) <= 253 and all(_LABEL.fullmatch(label) for label in host.split("."))


def _split_port(text: str) -> tuple[str, int | None]:
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise ValueError(f"{text!r}: an IPv6 address in brackets lacks its ']'")
        rest = text[close + 1:]
        if rest and not rest.startswith(":"):
            raise ValueError(f"{text!r}: expected ':port' after ']'")
        return text[1:close], _port(text, rest[1:]) if rest else None
    if text.count(":") == 1:
        host, port = text.split(":")
        return host, _port(text, port)
    return text, None  # a bare IPv6 address or network, or no port


def _port(text: str, port: str) -> int:
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r}: {port!r} is not a port (1-65535)")
    return int(port)


def parse_entry(text: str) -> Entry:
    """An entry from its text; ValueError saying what is wrong with it."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{text!r} is not a host entry (host, *.domain, address or network, optional :port)")
    raw = text.strip()
    host, port = _split_port(raw)
    host = normalize_host(host)
    if host == "*":
        return Entry(raw, port=port)
    if "/" in host:
        try:
            return Entry(raw, network=ipaddress.ip_network(host, strict=False), port=port)
        except ValueError:
            raise ValueError(f"{raw!r}: {host!r} is not a network (10.0.0.0/8, fd00::/8)") from None
    address = parse_address(host)
    if address is not None:
        return Entry(raw, network=ipaddress.ip_network(address), port=port)
    wildcard = host.startswith("*.")
    name = host[2:] if wildcard else host
    if not name or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        raise ValueError(f"{raw!r} is not a host name, *.domain, address or network (with an optional :port)")
    return Entry(raw, suffix="." + name, port=port) if wildcard else Entry(raw, name=name, port=port)


def check_entries(entries: list[str]) -> list[str]:
    """The entries unchanged if each parses (for a policy validator), else ValueError naming the bad one."""
    for entry in entries:
        parse_entry(entry)
    return entries


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a connection may go out; `rule` names the setting that decided (`network.allow: x`)."""

    allowed: bool
    rule: str
    reason: str
    ask: bool = False  # refused only because the host is unlisted, and the policy asks a person then


@dataclass(frozen=True, slots=True)
class EgressRules:
    """The parsed `network` setting of a policy that lists hosts: the proxy's whole rule set."""

    allow: tuple[Entry, ...] = ()
    deny: tuple[Entry, ...] = ()
    ask: Literal["off", "on-miss"] = "off"
    within: EgressRules | None = None  # rules a connection must pass too (the device's own)

    @classmethod
    def build(cls, *, allow: list[str] = (), deny: list[str] = (),  # type: ignore[assignment]
              ask: Literal["off", "on-miss"] = "off", within: EgressRules | None = None) -> EgressRules:
        return cls(tuple(parse_entry(e) for e in allow), tuple(parse_entry(e) for e in deny), ask, within)

    def with_allowed(self, host: str, port: int) -> EgressRules:
        """These rules plus an exact entry for `host:port` (a person's "always" answer); the inner rules
        get it too where they ask a person themselves (`ask: on-miss`), else they still decide."""
        text = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        within = self.within
        if within is not None and within.ask == "on-miss":
            within = within.with_allowed(host, port)
        return EgressRules((*self.allow, parse_entry(text)), self.deny, self.ask, within)

    def judge_name(self, host: str, port: int) -> Verdict:
        """The verdict on a requested `host:port` before resolution (the address is judged after)."""
        verdict = self._judge_name(normalize_host(host), port)
        if verdict.allowed and self.within is not None:
            return _inner(self.within.judge_name(host, port)) or verdict
        return verdict

    def judge_address(self, host: str, address: IPAddress, port: int) -> Verdict:
        """The verdict on connecting to `address`, which `host` resolved to (or is)."""
        verdict = self._judge_address(normalize_host(host), address, port)
        if verdict.allowed and self.within is not None:
            return _inner(self.within.judge_address(host, address, port)) or verdict
        return verdict

    def _judge_name(self, host: str, port: int) -> Verdict:
        for entry in self.deny:
            if entry.matches_name(host, port):
                return Verdict(False, f"network.deny: {entry.text}", f"{host}:{port} is denied by the policy")
        for entry in self.allow:
            if entry.matches_name(host, port):
                return Verdict(True, f"network.allow: {entry.text}", f"{host}:{port} is allowed")
        return Verdict(False, "network.not-allowed", f"{host}:{port} is not in the policy's network allow list",
                       ask=self.ask == "on-miss")

    def _judge_address(self, host: str, address: IPAddress, port: int) -> Verdict:
        for entry in self.deny:
            if entry.matches_address(address, port):
                return Verdict(False, f"network.deny: {entry.text}", f"{address} is denied by the policy")
        if is_public(address):
            return Verdict(True, "network.public-address", f"{address} is a public address")
        for entry in self.allow:
            if entry.matches_address(address, port):
                return Verdict(True, f"network.allow: {entry.text}", f"{address} is listed")
            if entry.name is not None and entry.name == host and entry.port_matches(port):
                return Verdict(True, f"network.allow: {entry.text}", f"{host} is listed by name")
        return Verdict(False, "network.special-address",
                       f"{host} resolves to {address}, a {kind(address)} address, which only an allow entry naming "
                       "that address, its network or this exact host name opens")


def _inner(verdict: Verdict) -> Verdict | None:
    """The inner rules' refusal, worded as the device's own (None when they allow)."""
    if verdict.allowed:
        return None
    return Verdict(False, verdict.rule, f"{verdict.reason} (the device's own network policy)", verdict.ask)


def entry_text(host: str, port: int | None) -> str:
    """An entry's text from a host part (name, `*.domain`, `*`, address or network) and a port."""
    if port is None:
        return host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _host_text(entry: Entry) -> str:
    if entry.name is not None:
        return entry.name
    if entry.suffix is not None:
        return "*" + entry.suffix
    if entry.network is not None:
        full = entry.network.prefixlen == entry.network.max_prefixlen
        return str(entry.network.network_address) if full else str(entry.network)
    return "*"


def _meet_hosts(a: Entry, b: Entry) -> str | None:
    if a.name is None and a.suffix is None and a.network is None:
        return _host_text(b)
    if b.name is None and b.suffix is None and b.network is None:
        return _host_text(a)
    if a.network is not None or b.network is not None:
        if a.network is None or b.network is None or a.network.version != b.network.version:
            return None  # a name matches only names, a network only address literals
        if a.network.subnet_of(b.network):  # type: ignore[arg-type]
            return _host_text(a)
        return _host_text(b) if b.network.subnet_of(a.network) else None  # type: ignore[arg-type]
    if a.name is not None and b.name is not None:
        return a.name if a.name == b.name else None
    if a.name is not None:
        return a.name if a.name.endswith(b.suffix or "") else None
    if b.name is not None:
        return b.name if b.name.endswith(a.suffix or "") else None
    assert a.suffix is not None and b.suffix is not None
    longer, shorter = (a, b) if len(a.suffix) >= len(b.suffix) else (b, a)
    return _host_text(longer) if (longer.suffix or "").endswith(shorter.suffix or "") else None


def meet(first: list[str], second: list[str]) -> list[str]:
    """The entries naming what an entry of each list names (entry-wise intersection, in `first`'s order).

    Port: an entry without one takes the other's; two different ports meet nowhere. Names: `*` meets
    anything as that; `a.example.com` meets `*.example.com` as the name; two wildcards as the narrower.
    A network meets an address or network inside it as that; a name never meets an address (names are
    matched as written, before resolution).
    """
    out: list[str] = []
    for a in map(parse_entry, first):
        for b in map(parse_entry, second):
            if a.port is not None and b.port is not None and a.port != b.port:
                continue
            host = _meet_hosts(a, b)
            if host is None:
                continue
            text = entry_text(host, a.port if a.port is not None else b.port)
            if text not in out:
                out.append(text)
    return [t for t in out if not any(u != t and _covers(parse_entry(u), parse_entry(t)) for u in out)]


def _covers(wide: Entry, narrow: Entry) -> bool:
    """Whether `wide` names everything `narrow` does (and so `narrow` adds nothing beside it)."""
    if wide.port is not None and wide.port != narrow.port:
        return False
    host = _meet_hosts(wide, narrow)
    return host is not None and host == _host_text(narrow)


_CGNAT = ipaddress.ip_network("100.64.0.0/10")


def is_public(address: IPAddress) -> bool:
    """Whether the address is an ordinary public unicast one (not loopback, private, link-local...)."""
    if isinstance(address, ipaddress.IPv6Address):
        mapped = address.ipv4_mapped or address.sixtofour
        if mapped is not None:
            return is_public(mapped)
    if address.is_multicast or address.is_unspecified or address.is_reserved:
        return False
    if isinstance(address, ipaddress.IPv4Address) and address in _CGNAT:
        return False
    return address.is_global


def kind(address: IPAddress) -> str:
    """A word for why an address is special, for refusals."""
    checks = (("loopback", address.is_loopback), ("link-local", address.is_link_local),
              ("multicast", address.is_multicast), ("unspecified", address.is_unspecified),
              ("carrier-grade NAT", isinstance(address, ipaddress.IPv4Address) and address in _CGNAT),
              ("private", address.is_private))
    return next((name for name, hit in checks if hit), "reserved")
