"""Storage URLs with their credentials taken out, for messages, logs and /server_info.

Every form the parsers accept is covered, including forms that only some accept:

    redis://user:SECRET@host:port/db      userinfo (also a password holding "/", "?", "#":
    redis-cluster://:SE/C?R#ET@h:p,h:p    the cluster parser splits at the last "@")
    redis://host:port/db?password=SECRET  query parameters (every value is hidden)
    redis://host:port/db#SECRET           a fragment

A `file://` URL has no credentials and is left alone (an "@" there is part of a path).
"""

from __future__ import annotations

from typing import overload

HIDDEN = "***"


@overload
def redact(url: str) -> str: ...


@overload
def redact(url: None) -> None: ...


def redact(url: str | None) -> str | None:
    """`url` with every span that a parser could read as a credential replaced by ***:
    userinfo, query values, the fragment. What stays (scheme, hosts, ports, database,
    query names) says where a message is about. Where two parsers split a URL
    differently, what either could read as a secret is hidden."""
    if url is None or not isinstance(url, str) or url.startswith("file://"):
        return url
    scheme, sep, rest = url.partition("://")
    if not sep:  # not a URL: nothing to keep safely
        return HIDDEN if any(c in url for c in "@?#") else url
    hidden = [False] * len(rest)
    _hide(hidden, 0, rest.rfind("@"))  # the cluster parser: userinfo ends at the last "@"
    if scheme != "redis-cluster":  # urllib's split, as redis-py reads redis:// URLs
        netloc = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
        _hide(hidden, 0, rest.rfind("@", 0, netloc))
        fragment = rest.find("#")
        if fragment >= 0:
            _hide(hidden, fragment + 1, len(rest))
        query = rest.find("?", netloc)
        if query >= 0 and (fragment < 0 or query < fragment):
            end = fragment if fragment >= 0 else len(rest)
            at = query + 1
            for item in rest[query + 1:end].split("&"):
                name, eq, _ = item.partition("=")
                _hide(hidden, at + (len(name) + 1 if eq else 0), at + len(item))
                at += len(item) + 1
    out, run = [], False
    for c, h in zip(rest, hidden, strict=True):
        if h and not run:
            out.append(HIDDEN)
        elif not h:
            out.append(c)
        run = h
    return f"{scheme}://{''.join(out)}"


def _hide(hidden: list[bool], start: int, stop: int) -> None:
    for i in range(start, stop):
        hidden[i] = True
