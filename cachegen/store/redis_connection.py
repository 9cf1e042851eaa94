"""Connecting to the redis-server (or Valkey, or Redis Cluster) behind a ``RedisStore``, and
telling a configuration mistake (credentials, ACL, TLS) from a server that is down."""

from __future__ import annotations

import contextlib
import os
import ssl
from collections.abc import Iterator
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from cachegen.store.errors import StoreConfigError, StoreError, StoreUnavailable
from cachegen.store.url import without_password

CERT_REQS = ("none", "optional", "required")
SSL_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
_UNREACHABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.RedisClusterException,
)


class RedisEndpoint:
    """The server (or cluster) a store URL names: connects to it, and turns what redis-py
    raises into the store's errors, in messages that never show the password."""

    def __init__(self, public_url: str, *, cluster: bool) -> None:
        parts = urlsplit(public_url)
        self.cluster = cluster
        self.label = without_password(public_url)
        self.user = unquote(parts.username) if parts.username else "default"
        self.host = _host_port(parts)
        self._password = parts.password

    def connect(
        self, url: str, *, timeout_s: float, retries: int, tls: dict
    ) -> redis.Redis | RedisCluster:
        """A client of ``url`` (``tls``: the ``ssl_*`` store options), checked with one PING.

        Wrong credentials or an untrusted certificate raise ``StoreConfigError``. A server that
        cannot be reached does not, except for a cluster client, which connects at once: the
        first operation that needs it raises ``StoreUnavailable``, so an engine can start while
        its store is down, and recompute."""
        # The client URL may carry a password the public URL names by file or environment.
        self._password = urlsplit(url).password or self._password
        # Few, fast retries: a dead server must turn into StoreUnavailable within about
        # timeout_s, so the caller can recompute instead of waiting on backoff.
        options = dict(
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), retries),
            **_ssl_options(urlsplit(url).scheme.lower() == "rediss", **tls),
        )
        try:
            client = (RedisCluster if self.cluster else redis.Redis).from_url(url, **options)
        except (
            ValueError,
            redis.exceptions.RedisError,
            redis.exceptions.RedisClusterException,
        ) as exc:
            error = self.config_error(exc)
            if error is None and isinstance(exc, _UNREACHABLE):
                error = StoreUnavailable(
                    f"redis at {self.label} is unreachable (connect): {self.redact(exc)}"
                )
            raise error or StoreConfigError(
                f"cannot use redis store {self.label}: {self.redact(exc)}"
            ) from exc
        try:
            client.ping()
        except Exception as exc:
            error = self.config_error(exc)
            if error is not None:
                raise error from exc
        return client

    @contextlib.contextmanager
    def errors(self, what: str) -> Iterator[None]:
        """Redis errors inside the block as ``StoreUnavailable`` (down) or ``StoreError``."""
        try:
            yield
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            # In a cluster a dead node leaves its slots unavailable (until a replica takes over,
            # or for good without quorum): the message says it is the cluster that is down.
            state = "unavailable: a node is unreachable" if self.cluster else "unreachable"
            kind = "redis cluster" if self.cluster else "redis"
            raise StoreUnavailable(
                f"{kind} at {self.label} is {state} ({what}): {self.redact(exc)}"
            ) from exc
        except (redis.exceptions.RedisClusterException, redis.exceptions.ClusterDownError) as exc:
            # ClusterDownError (CLUSTERDOWN, MASTERDOWN: a slot range lost its master and every
            # replica) is a RedisError reply, not a refusal: the cluster cannot serve right now.
            raise StoreUnavailable(
                f"redis cluster at {self.label} is unavailable ({what}): {self.redact(exc)}"
            ) from exc
        except redis.exceptions.RedisError as exc:
            raise StoreError(
                f"redis at {self.label} refused to {what}: {self.redact(exc)}"
            ) from exc

    def redact(self, text: object) -> str:
        """``text`` with the URL's password (should a message ever echo it) replaced by ***."""
        text = str(text)
        for secret in {self._password, unquote(self._password or "")} - {None, ""}:
            text = text.replace(secret, "***")
        return text

    def config_error(self, exc: BaseException) -> StoreConfigError | None:
        """The configuration mistake ``exc`` reveals (credentials, TLS), if any."""
        chain = _chain(exc)
        said = self.redact("; ".join(dict.fromkeys(str(e) for e in chain if str(e))))
        if any(isinstance(e, redis.exceptions.AuthenticationError) for e in chain) or any(
            code in said for code in ("WRONGPASS", "NOAUTH", "invalid password")
        ):
            hint = (
                "check the password or the ACL user"
                if self._password is not None
                else "check the password or the ACL user: the server requires one and the URL "
                "gives none (name it with ?password_file=/path or ?password_env=NAME, and an "
                "ACL user as redis://USER@host:port/db)"
            )
            return StoreConfigError(
                f"authentication failed for user {self.user!r} at {self.host}: {hint} "
                f"(redis said: {_first_line(said)})"
            )
        if any(isinstance(e, redis.exceptions.NoPermissionError) for e in chain):
            return StoreConfigError(
                f"user {self.user!r} at {self.host} is not allowed to run the commands the "
                f"chunk store needs: check the user's ACL rules (redis said: {_first_line(said)})"
            )
        return self._tls_error(chain, said)

    def _tls_error(self, chain: list[BaseException], said: str) -> StoreConfigError | None:
        cert = next((e for e in chain if isinstance(e, ssl.SSLCertVerificationError)), None)
        if cert is not None or "CERTIFICATE_VERIFY_FAILED" in said:
            reason = getattr(cert, "verify_message", None) or _first_line(said)
            if "mismatch" in reason:
                return StoreConfigError(
                    f"the TLS certificate of redis at {self.host} does not name that host "
                    f"({reason}): connect by a host name or address the certificate lists "
                    "(its subjectAltName), or have the server's certificate list this one"
                )
            return StoreConfigError(
                f"the TLS certificate of redis at {self.host} could not be verified ({reason}): "
                "set the store option ssl_ca_certs to the CA certificate that signed the "
                "server's certificate (URL ?ssl_ca_certs=/path/ca.pem or open_store(..., "
                "ssl_ca_certs=...)) and check that the certificate names this host"
            )
        tls = next((e for e in chain if isinstance(e, ssl.SSLError)), None)
        if tls is not None:
            return StoreConfigError(
                f"the TLS handshake with redis at {self.host} failed "
                f"({tls.reason or _first_line(str(tls))}): check that the server speaks TLS on "
                "this port, and ssl_certfile / ssl_keyfile if it requires a client certificate"
            )
        return None


def _ssl_options(tls: bool, **given: str | None) -> dict:
    """redis-py's keyword arguments for the ``ssl_*`` store options (``rediss://`` only)."""
    chosen = {name: value for name, value in given.items() if value is not None}
    if not tls:
        if chosen:
            raise StoreConfigError(
                f"store option(s) {sorted(chosen)} need a TLS URL: use rediss:// (or valkeys://, "
                "rediss+cluster://) instead of redis://"
            )
        return {}
    reqs = str(chosen.get("ssl_cert_reqs", "required")).lower()
    if reqs not in CERT_REQS:
        raise StoreConfigError(
            f"store option ssl_cert_reqs={reqs!r}: expected one of {', '.join(CERT_REQS)}"
        )
    for name in SSL_FILES:
        path = chosen.get(name)
        if path is not None and not os.path.isfile(os.path.expanduser(path)):
            raise StoreConfigError(f"store option {name}: {path!r} is not a readable file")
    out = {name: os.path.expanduser(chosen[name]) for name in SSL_FILES if name in chosen}
    out["ssl_cert_reqs"] = reqs
    # A verified certificate must also name the host connected to (a certificate of another
    # host signed by the same CA would pass otherwise); ssl_cert_reqs=none turns both off.
    out["ssl_check_hostname"] = reqs != "none"
    return out


def _host_port(parts) -> str:
    host = parts.netloc.rsplit("@", 1)[-1]
    try:
        port = parts.port
    except ValueError:  # shown as written
        return host
    return host if port is not None or not host else f"{host}:6379"


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling."""
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "no details"
