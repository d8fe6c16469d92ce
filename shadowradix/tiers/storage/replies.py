"""What each reply the Redis-protocol backends read must be; anything else is BadReply.

redis-py hands over whatever the server sent, parsed into Python values: a server that
misbehaves (a proxy, a look-alike, a fault) can send an integer where an array belongs,
a short or nested array, a simple string, a RESP3 map, an error inside an array. Each
check below accepts exactly the shape its command answers and raises BadReply for any
other, which the backends count ("bad_reply") and treat as a miss or a failed write:
never an exception in `generate`, never a value passed on unchecked.

    MGET k1..kn    a list of n values, each bytes or None (no such key)
    GETRANGE k     bytes; b"" is no such key
    EXISTS k       the integer 0 or 1
    SET k v        True (redis-py's reading of +OK)
    DEL k..        a non-negative integer
"""

from __future__ import annotations

from typing import Any


class BadReply(Exception):
    """A reply of the wrong shape or type for its command (a counted miss)."""


def _show(reply: Any) -> str:
    text = repr(reply)
    return f"{type(reply).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def values(reply: Any, n: int) -> list[Any]:
    """A list of exactly `n` replies (a pipeline's, or an MGET's)."""
    if type(reply) is not list or len(reply) != n:
        raise BadReply(f"expected a list of {n} replies, got {_show(reply)}")
    return reply


def blob(reply: Any) -> bytes | None:
    """One value of an MGET reply: bytes, or None for no such key."""
    if reply is None or type(reply) is bytes:
        return reply
    raise BadReply(f"expected a stored value (bytes or nil), got {_show(reply)}")


def blobs(reply: Any, n: int) -> list[bytes | None]:
    """An MGET reply of `n` keys; a single bad value refuses the whole reply (the server
    is not answering as Redis does, so nothing in it is trusted)."""
    return [blob(r) for r in values(reply, n)]


def range_blob(reply: Any) -> bytes | None:
    """A GETRANGE reply: the bytes, None where it is empty (no such key)."""
    if type(reply) is not bytes:
        raise BadReply(f"expected a GETRANGE value (bytes), got {_show(reply)}")
    return reply or None


def flag(reply: Any) -> bool:
    """An EXISTS reply of one key."""
    if type(reply) is not int or reply not in (0, 1):
        raise BadReply(f"expected EXISTS of one key to answer 0 or 1, got {_show(reply)}")
    return reply == 1


def stored(reply: Any) -> bool:
    """A SET reply (without NX/XX/GET): True; anything else is not a write we know of."""
    if reply is not True:
        raise BadReply(f"expected SET to answer OK, got {_show(reply)}")
    return True


def count(reply: Any) -> int:
    """A DEL reply: how many keys it deleted."""
    if type(reply) is not int or reply < 0:
        raise BadReply(f"expected DEL to answer a count, got {_show(reply)}")
    return reply
