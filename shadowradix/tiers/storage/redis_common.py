"""What the Redis-protocol backends share: the client options that bound every call, the
breaker-guarded call that turns a fault into a counted miss, and the messages for
refused credentials.

`redis://` guards its one server with one breaker; `redis-cluster://` guards each node
with its own, so a dead master costs misses on its slots only.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from shadowradix.tiers.storage.breaker import CircuitBreaker
from shadowradix.tiers.storage.replies import BadReply
from shadowradix.tiers.storage.urls import redact

__all__ = ["Guard", "client_options", "redact", "refused_credentials", "refused_resp3",
           "scan_delete", "store_errors", "unreachable_errors"]
log = logging.getLogger("shadowradix.storage")
T = TypeVar("T")


def client_options(timeout_s: float, deadline_s: float | None = None, *, tls: bool = False,
                   seed: tuple[str, int] | None = None) -> dict[str, Any]:
    """redis-py options that bound every call: socket timeouts (each wait for bytes), a
    deadline over each whole call from its connection's checkout to its last reply
    (`deadline_s`, by default `timeout_s`; see deadline.py), and no retries inside the
    client (the breaker decides when to try again). `tls`: the URL is rediss://. `seed`:
    for RedisCluster, one seed (host, port), passed as its `url`: only then does redis-py
    build each node's pool from these options (otherwise it hands them to redis.Redis,
    which takes no connection class). ValueError for a deadline that is not > 0."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from shadowradix.tiers.storage.deadline import check_deadline, connection_class

    deadline = check_deadline(timeout_s if deadline_s is None else deadline_s)
    options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
                               "retry": Retry(NoBackoff(), 0),
                               "connection_class": connection_class(deadline, tls)}
    if seed is not None:
        host, port = seed
        options["url"] = f"redis://[{host}]:{port}" if ":" in host else f"redis://{host}:{port}"
    return options


def unreachable_errors() -> tuple[type[BaseException], ...]:
    """The store did not answer (down, refused, timed out): worth backing off from."""
    import redis

    return (redis.ConnectionError, redis.TimeoutError, OSError)


def store_errors() -> tuple[type[BaseException], ...]:
    """Every fault of the store, including answers that are errors (OOM, CLUSTERDOWN)."""
    import redis

    return (redis.RedisError, OSError)


class Guard:
    """One endpoint's breaker and the fault counting of every call to it.

    `errors` is the backend's counter (shared by all its guards); `where` names the
    endpoint in logs ("" for a single server); `reset` drops the endpoint's idle
    connections, called after a reply it could not read: such a connection may be out of
    step with the server (an extra reply would answer the next command)."""

    def __init__(self, errors: Counter[str], breaker: CircuitBreaker, where: str = "",
                 reset: Callable[[], None] | None = None) -> None:
        self.errors = errors
        self.breaker = breaker
        self.where = where
        self._reset = reset
        self._unreachable = unreachable_errors()
        self._faults = store_errors()

    def __call__(self, call: Callable[[], T], miss: T) -> T:
        """`call()`, or `miss` at once while the breaker is open or when the call fails
        (counted: "skipped", "unreachable", "server" or "bad_reply"). Never raises an
        Exception: a reply that `call` refuses (BadReply) or that redis-py could not
        make sense of (a malformed redirection, an undecodable value) is "bad_reply"."""
        if not self.breaker.allow():
            self.errors["skipped"] += 1
            return miss
        try:
            out = call()
        except self._unreachable as e:
            self.errors["unreachable"] += 1
            self.breaker.failed()
            log.warning("storage %sunreachable (%s); skipping it for %.1f s",
                        f"node {self.where} " if self.where else "", e, self.breaker.wait_s)
            return miss
        except self._faults as e:  # the server answered with an error (e.g. OOM)
            self.errors["server"] += 1
            log.warning("storage error%s: %s", self._on, e)
            self.breaker.succeeded()
            return miss
        except Exception as e:  # BadReply, or raised parsing a reply: it answered, wrongly
            self.bad_reply(e)
            return miss
        self.breaker.succeeded()
        return out

    def bad_reply(self, e: Exception, n: int = 1) -> None:
        """Count `n` replies of the wrong shape or type (`e`: the first); the server
        answered, so the breaker stays closed."""
        self.errors["bad_reply"] += n
        self.breaker.succeeded()
        log.warning("storage reply%s not understood (%s: %s); a miss", self._on,
                    type(e).__name__, e, exc_info=not isinstance(e, BadReply))
        if self._reset is not None:
            try:
                self._reset()
            except Exception as err:  # dropping sockets: nothing more to do
                log.debug("storage: dropping connections%s failed: %s", self._on, err)

    @property
    def _on(self) -> str:
        return f" on {self.where}" if self.where else ""


def refused_credentials(e: BaseException) -> bool:
    """Whether `e` (or what caused it) is the server refusing our credentials."""
    import redis

    while e is not None:
        if isinstance(e, redis.AuthenticationError | redis.exceptions.AuthorizationError):
            return True
        if isinstance(e, redis.ResponseError) and ("NOAUTH" in str(e) or "WRONGPASS" in str(e)):
            return True
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return False


def refused_resp3(e: BaseException | None) -> bool:
    """Whether `e` (or what caused it) is the server refusing RESP3's handshake: a server
    older than Redis 6 knows no HELLO; one that knows it may still refuse protocol 3
    (NOPROTO)."""
    while e is not None:
        if "HELLO" in str(e).upper() or str(e).upper().startswith("NOPROTO"):
            return True
        e = e.__cause__ or e.__context__
    return False


def scan_delete(client: Any, namespace: str, delete: Callable[[list[Any]], int],
                batch_size: int = 1000) -> Iterator[int]:
    """SCAN one server for the namespace's keys and `delete` them in batches, yielding how
    many each batch deleted (a caller that a fault interrupts knows what went)."""
    batch: list[Any] = []
    for key in client.scan_iter(match=f"{namespace}/*", count=batch_size):
        batch.append(key)
        if len(batch) >= batch_size:
            yield delete(batch)
            batch = []
    if batch:
        yield delete(batch)
