"""Personal data in documents: e-mail addresses and public IP addresses are replaced by fixed
placeholders (a documentation address each, so a placeholder is never counted itself), and each
replacement is counted ("pii.email", "pii.ip").

An IP address is replaced only when it is public (`ipaddress`'s `is_global`; IPv6 also only in
global unicast, 2000::/3): private, loopback, link-local, multicast, reserved, unspecified and
documentation addresses stay, and so do version-like strings: a dotted run of more than four
numbers ("1.2.3.4.5"), one glued to a letter ("v2.10.3.1", "build2.1.1.1"), followed by a
"-revision" ("1.7.4.1-3"), with a leading zero ("1.02.3.4"), or up to two words after a version
word (version(s), ver, release, rev(ision), build, git, standards: "Git 1.7.10.5", "version
to 4.6.1.0"). A bare four-part version number that is a valid public address ("Firefox
2.10.3.1") cannot be told from an address and is replaced.

An e-mail address is a practical pattern, not RFC 5322: a local part of letters, digits and
``_%+-`` in dot-separated runs, "@", a domain of dot-separated labels ending in a top-level
domain of letters. "foo@bar" (no dot), "@handle" and non-ASCII addresses are left alone, as are
addresses at the reserved example domains (RFC 2606: example.com/.net/.org, .example, .test,
.invalid, .localhost).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from common.configure import UserError

MODES = ("auto", "on", "off")
EMAIL = "pii.email"
IP = "pii.ip"

_EMAIL = re.compile(
    r"(?<![A-Za-z0-9_%+-])[A-Za-z0-9_%+-]+(?:\.[A-Za-z0-9_%+-]+)*"
    r"@((?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,63})(?![A-Za-z0-9-])"
)
_EXAMPLE_DOMAINS = ("example.com", "example.net", "example.org")
_EXAMPLE_SUBDOMAINS = tuple("." + domain for domain in _EXAMPLE_DOMAINS)
_EXAMPLE_TLDS = ("example", "test", "invalid", "localhost")
# Four dot-separated numbers not glued to a word character, to a further ".number" or "-rev".
_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![.-]?\w)")
# A version word up to two words before a dotted number makes it a version ("Git 1.7.10.5",
# "Standards-Version to 4.6.1.0", "versions 1.7.3.3"), checked only for public addresses.
_VERSION_BEFORE = re.compile(
    r"(?i)\b(?:versions?|vers?|releases?|rev|revision|build|git|standards)\b\W*(?:\w+\W+){0,2}$"
)
_DIGIT_DOT = re.compile(r"\d\.\d")
# Global unicast IPv6 (2000::/3): a first group of four hex digits starting 2 or 3.
_IPV6 = re.compile(r"(?<![\w:.])[23][0-9A-Fa-f]{3}(?::[0-9A-Fa-f]{0,4}){2,7}(?![\w:]|\.\w)")
_GLOBAL_UNICAST = ipaddress.IPv6Network("2000::/3")


@dataclass
class PiiConfig:
    # Replace personal data (e-mail and public IP addresses) in documents: auto (on for every
    # source format but gettext catalogs, whose strings hold none worth removing), on or off.
    mode: str = "auto"
    # Replace e-mail addresses (counted as pii.email).
    email: bool = True
    # Replace public IPv4 and IPv6 addresses (counted as pii.ip); private, loopback and
    # documentation addresses and version-like numbers stay.
    ip: bool = True
    # What an e-mail address becomes (at a reserved example domain, so it is never counted).
    email_placeholder: str = "email@example.com"
    # What a public IPv4 address becomes (RFC 5737's documentation range, not public).
    ip_placeholder: str = "192.0.2.1"
    # What a public IPv6 address becomes (RFC 3849's documentation prefix, not public).
    ipv6_placeholder: str = "2001:db8::1"

    def check(self, where: str) -> None:
        if self.mode not in MODES:
            raise UserError(f"{where}.mode: must be one of {', '.join(MODES)}, got {self.mode!r}")


def pii_enabled(cfg: PiiConfig, source_format: str) -> bool:
    """Whether PII is replaced in a source of this format: `auto` is on but for "gettext"."""
    if cfg.mode == "auto":
        return source_format != "gettext"
    return cfg.mode == "on"


def _is_example(domain: str) -> bool:
    domain = domain.lower()
    return (
        domain in _EXAMPLE_DOMAINS
        or domain.endswith(_EXAMPLE_SUBDOMAINS)
        or domain.rsplit(".", 1)[-1] in _EXAMPLE_TLDS
    )


def _public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    # is_global alone lets multicast through (it is not "private"), on Python 3.11 at least.
    return address.is_global and not (address.is_multicast or address.is_reserved)


def _public_v4(text: str) -> bool:
    try:
        address = ipaddress.IPv4Address(text)
    except ValueError:  # an octet over 255, or a leading zero
        return False
    return _public(address)


def _public_v6(text: str) -> bool:
    try:
        address = ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return address in _GLOBAL_UNICAST and _public(address)


def replace_pii(text: str, cfg: PiiConfig) -> tuple[str, dict[str, int]]:
    """`text` with its e-mail and public IP addresses replaced (the same object when there is
    none), and the counts by kind, nonzero ones only. `cfg.mode` is the caller's business
    (`pii_enabled`)."""
    counts: dict[str, int] = {}
    if cfg.email and "@" in text:
        n = 0

        def email(match: re.Match) -> str:
            nonlocal n
            if _is_example(match.group(1)):
                return match.group(0)
            n += 1
            return cfg.email_placeholder

        replaced = _EMAIL.sub(email, text)
        if n:
            text, counts[EMAIL] = replaced, n
    if cfg.ip:
        n = 0

        def ip(match: re.Match) -> str:
            nonlocal n
            found = match.group(0)
            if "." in found:
                before = text[max(0, match.start() - 40) : match.start()]
                if not _public_v4(found) or _VERSION_BEFORE.search(before):
                    return found
            elif not _public_v6(found):
                return found
            n += 1
            return cfg.ip_placeholder if "." in found else cfg.ipv6_placeholder

        if _DIGIT_DOT.search(text):
            replaced = _IPV4.sub(ip, text)
            if n:
                text = replaced
        if "::" in text or text.count(":") >= 7:
            found_v4 = n
            replaced = _IPV6.sub(ip, text)
            if n > found_v4:
                text = replaced
        if n:
            counts[IP] = n
    return text, counts
