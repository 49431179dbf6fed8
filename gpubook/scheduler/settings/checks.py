"""The checks settings declare: each says its rule in words (for the reference) and, given a value,
None when it is fine, else what is wrong with it (the reader's error sentence, word for word)."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.serialization import load_ssh_public_key

from gpubook.runtime.names import TEMPLATE_NAME_RULE, USER_NAME_RULE, template_name_problem, user_name_problem
from gpubook.scheduler.settings.declare import Check

NOTICE_KINDS = ("accepted", "rejected", "standby", "running", "warning", "ended", "reminder", "released", "idle",
                "foreign")

positive = Check("greater than 0", lambda v: None if v > 0 else "must be greater than 0")
not_negative = Check("0 or more", lambda v: None if v >= 0 else "must be 0 or more")
port = Check("a port between 1024 and 65535",
             lambda v: None if 1024 <= v <= 65535 else "must be a port between 1024 and 65535")
any_port = Check("a port number", lambda v: None if 1 <= v <= 65535 else "must be a port number")
uid = Check("between 1 and 2147483647 (not root)",
            lambda v: None if 1 <= v < 2**31 else "must be a uid between 1 and 2147483647 (not root)")
at_least_one = Check("at least 1", lambda v: None if v >= 1 else "must be at least 1")
keep_days = Check("0 (keep everything) or at least 30",  # the event log's append-only days (state/schema.py)
                  lambda v: None if v == 0 or v >= 30 else "must be 0 (keep everything) or at least 30 days")
user_name = Check(f"a user name: {USER_NAME_RULE}", user_name_problem)
template_name = Check(f"a template name: {TEMPLATE_NAME_RULE}", template_name_problem)
group_name = Check(f"a group name: {USER_NAME_RULE}", lambda name: None if user_name_problem(name) is None
                   else f"is not a valid group name ({USER_NAME_RULE})")


def one_of(choices: Iterable[str]) -> Check:
    choices = tuple(choices)
    names = [f'"{choice}"' for choice in choices]
    sentence = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    return Check(f"one of {', '.join(names)}", lambda value: None if value in choices else f"must be {sentence}")


def matches(pattern: str, words: str, problem: str) -> Check:
    """A check that the whole value matches `pattern`, `problem` the sentence when not."""
    return Check(words, lambda value: None if re.fullmatch(pattern, value) else problem)


def between(low: float, high: float, problem: str) -> Check:
    return Check(f"between {low:g} and {high:g}", lambda value: None if low <= value <= high else problem)


def _http_url(url: str) -> str | None:
    return None if re.match(r"^https?://[^\s/]+", url) else "must be an http(s):// URL"


def _host_name(name: str) -> str | None:
    return None if re.match(r"^[A-Za-z0-9.-]{1,253}$", name) else "is not a host name"


def _email(address: str) -> str | None:
    return None if re.match(r"^[^@\s]+@[^@\s]+$", address) else "is not an e-mail address"


# A key in an authorized_keys line: its type, then its base64 blob (options may come before: from="…").
_SSH_KEY = re.compile(r"(?:^|\s)((?:ssh|ecdsa|sk)-[A-Za-z0-9@._-]+)[ \t]+([A-Za-z0-9+/]+={0,3})(?=[ \t]|$)")
_SSH_OPTIONS = re.compile(r'(?:[A-Za-z0-9-]+(?:="(?:[^"\\]|\\.)*")?)(?:,[A-Za-z0-9-]+(?:="(?:[^"\\]|\\.)*")?)*')


def _ssh_key(line: str) -> str | None:
    """None for an authorized_keys line whose key cryptography can load (a truncated or mistyped key
    cannot be), with OpenSSH's options before it or not, else the sentence."""
    if "\n" not in line and "\r" not in line:
        for found in _SSH_KEY.finditer(line):
            options = line[:found.start(1)].strip()
            if options and not _SSH_OPTIONS.fullmatch(options):
                continue
            try:
                load_ssh_public_key(f"{found[1]} {found[2]}".encode())
            except (ValueError, UnsupportedAlgorithm):
                continue
            return None
    return "is not an SSH public key line (such as 'ssh-ed25519 AAAA... alice@laptop'; a truncated key is not one)"


def _notice_kind(kind: str) -> str | None:
    return None if kind in NOTICE_KINDS else f"is not a notice ({', '.join(NOTICE_KINDS)})"


def timezone_problem(name: str) -> str | None:
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        return f"unknown time zone {name!r} (use an IANA name such as 'Europe/Paris')"
    return None


def address_problem(value: str) -> str | None:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return "must be an IP address such as 0.0.0.0 (all) or 127.0.0.1"
    return None


def _when_set(check: Check) -> Check:
    return Check(check.words, lambda value: check(value) if value is not None else None)


http_url = Check("an http:// or https:// URL", _http_url)
host_name = Check("a host name (letters, digits, '.' and '-')", _host_name)
email = Check("an e-mail address", _email)
ssh_key = Check("an SSH public key line", _ssh_key)
notice_kind = Check(f"each one of {', '.join(NOTICE_KINDS)}", _notice_kind)
timezone = Check("an IANA time zone name", timezone_problem)
address = Check("an IP address", address_problem)
positive_when_set = _when_set(positive)
user_name_when_set = _when_set(user_name)


def words(value: Any) -> str:
    """A check's rule in words, "" for none."""
    return str(getattr(value, "words", "") or "")
