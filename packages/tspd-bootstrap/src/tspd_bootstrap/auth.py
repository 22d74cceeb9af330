"""The cluster credential: one shared secret whose seals (HMAC-SHA256) prove a rendezvous message
came from a member of the cluster.

TokenSpeed, SGLang and vLLM authenticate none of their rendezvous traffic: whoever reaches a
bootstrap port may register a rank, and whoever reaches a P rank's control socket may register
a D session. With a credential configured, tspd seals:

* every bootstrap request that registers, looks up or removes a rank (``PUT``/``GET /route``,
  ``GET``/``DELETE /ranks``): the ``Authorization`` header (:func:`sign_request`), checked by the
  server (:func:`check_request`);
* every tspd D -> P registration and staging offer (wire.md §2.1 plus one frame), only towards P
  ranks that announced :data:`AUTH_EXTENSION` (a TokenSpeed P reads exactly 8 registration
  frames and never announces it).

A seal is ``<unix seconds>.<nonce>.<mac>``: 32 hex digits of randomness, and HMAC-SHA256 under a
key derived from the secret for one *domain* (bootstrap HTTP, PD frames: a seal of one never
verifies as the other) over the time, the nonce and every part of the message, each part
length-prefixed. The verifier accepts a seal whose time is within :data:`WINDOW_S` of its own
clock (so a captured one goes stale) and, where a replay would change state (registrations,
removals), remembers its nonce for that window and refuses it a second time (:class:`ReplayGuard`).
MACs are compared in constant time (:func:`hmac.compare_digest`).

What a seal does not do: encrypt, or protect answers (a look-up's answer is not sealed; an
attacker who can impersonate the bootstrap server on the network path is out of its reach),
or cover Mooncake's listeners (docs/OPERATIONS.md, "Security and exposure").

Threading: a :class:`ClusterCredential` is immutable and may be shared; a :class:`ReplayGuard`
belongs to one thread (the server's loop, a P worker's control thread).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tspd_bootstrap.errors import BootstrapError

#: The secret itself (the environment is not shown by ``ps``; a command-line flag is).
TOKEN_ENV = "TSPD_CLUSTER_TOKEN"
#: A file holding the secret (its first line; surrounding whitespace is ignored).
TOKEN_FILE_ENV = "TSPD_CLUSTER_TOKEN_FILE"
MIN_TOKEN_BYTES = 16
MAX_TOKEN_BYTES = 4096
#: A seal is accepted this long either side of the verifier's clock; hosts must agree this well.
WINDOW_S = 60.0
#: What a tspd P rank announces at the bootstrap server (``tspd_extensions``) when it holds the
#: credential: its registrations and staging offers must carry a seal frame.
AUTH_EXTENSION = "tspd.auth/1"
#: The ``Authorization`` scheme of a sealed bootstrap request.
HTTP_SCHEME = "TSPD-HMAC-SHA256"
HTTP_DOMAIN = b"bootstrap-http/1"
FRAMES_DOMAIN = b"pd-frames/1"

_SEAL = re.compile(r"([0-9]{1,12})\.([0-9a-f]{32})\.([0-9a-f]{64})")
_HEADER = re.compile(re.escape(HTTP_SCHEME) + r" (\S{1,200})")


class CredentialError(BootstrapError, PermissionError):
    """A seal is missing or does not verify; ``code`` is a stable reason (``unauthenticated``,
    ``bad_seal``, ``stale_seal``, ``replayed_seal``), the message says what and why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class CredentialConfigError(BootstrapError, ValueError):
    """The credential could not be loaded (a missing or unreadable file, too short a secret)."""


@dataclass(frozen=True, slots=True)
class Seal:
    """One seal: when it was made, its nonce and its MAC (hex)."""

    ts: int
    nonce: str
    mac: str

    @property
    def text(self) -> str:
        return f"{self.ts}.{self.nonce}.{self.mac}"

    @classmethod
    def parse(cls, text: str) -> Seal:
        match = _SEAL.fullmatch(text)
        if match is None:
            raise CredentialError("bad_seal", "the seal is not <seconds>.<32 hex>.<64 hex>")
        return cls(int(match[1]), match[2], match[3])


@dataclass(frozen=True, slots=True)
class ClusterCredential:
    """The shared secret (never shown: ``repr`` prints a fingerprint both sides can compare)."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not MIN_TOKEN_BYTES <= len(self.secret) <= MAX_TOKEN_BYTES:
            raise CredentialConfigError(
                f"the cluster token is {len(self.secret)} bytes; it must be "
                f"{MIN_TOKEN_BYTES}..{MAX_TOKEN_BYTES} (e.g. 'openssl rand -hex 32')"
            )

    def __repr__(self) -> str:
        return f"ClusterCredential(fingerprint={self.fingerprint})"

    @property
    def fingerprint(self) -> str:
        """8 hex digits that identify the secret without revealing it (for logs)."""
        return hashlib.sha256(b"tspd fingerprint\0" + self.secret).hexdigest()[:8]

    @classmethod
    def from_text(cls, text: str) -> ClusterCredential:
        return cls(text.strip().encode("utf-8"))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ClusterCredential:
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise CredentialConfigError(
                f"cannot read the cluster token file {os.fspath(path)!r}: {exc.strerror or exc}"
            ) from exc
        lines = raw.strip().splitlines()
        return cls(lines[0].strip() if lines else b"")

    @classmethod
    def resolve(
        cls,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ClusterCredential | None:
        """The credential a flag gives (``token`` or ``token_file``), else the environment's
        (:data:`TOKEN_ENV`, :data:`TOKEN_FILE_ENV`), else ``None`` (the credential is off)."""
        if token is not None and token_file is not None:
            raise CredentialConfigError("give the cluster token or its file, not both")
        if token is not None:
            return cls.from_text(token)
        if token_file is not None:
            return cls.from_file(token_file)
        env = os.environ if env is None else env
        text, path = env.get(TOKEN_ENV), env.get(TOKEN_FILE_ENV)
        if text and path:
            raise CredentialConfigError(f"set {TOKEN_ENV} or {TOKEN_FILE_ENV}, not both")
        if text:
            return cls.from_text(text)
        return cls.from_file(path) if path else None

    # ---- seals ---------------------------------------------------------------------------

    def seal(self, domain: bytes, parts: Sequence[bytes], now: float | None = None) -> Seal:
        """A fresh seal of ``parts`` (a new nonce each time)."""
        ts = int(time.time() if now is None else now)
        nonce = secrets.token_hex(16)
        return Seal(ts, nonce, self._mac(domain, ts, nonce, parts))

    def check(self, domain: bytes, parts: Sequence[bytes], text: str, now: float) -> Seal:
        """The seal ``text`` of ``parts`` if it verifies and is fresh; else
        :class:`CredentialError` saying why (no replay check: see :class:`ReplayGuard`)."""
        seal = Seal.parse(text)
        if not hmac.compare_digest(seal.mac, self._mac(domain, seal.ts, seal.nonce, parts)):
            raise CredentialError(
                "bad_seal", "the seal does not verify: another cluster token, or altered content"
            )
        skew = seal.ts - now
        if abs(skew) > WINDOW_S:
            raise CredentialError(
                "stale_seal",
                f"the seal was made {-skew:.0f} s from now by this host's clock; at most "
                f"{WINDOW_S:g} s are accepted (a replay, or clocks that disagree)",
            )
        return seal

    def _mac(self, domain: bytes, ts: int, nonce: str, parts: Sequence[bytes]) -> str:
        key = hmac.new(self.secret, b"tspd cluster credential\0" + domain, hashlib.sha256)
        mac = hmac.new(key.digest(), f"{ts}.{nonce}".encode(), hashlib.sha256)
        for part in parts:
            mac.update(len(part).to_bytes(8, "little"))
            mac.update(part)
        return mac.hexdigest()


class ReplayGuard:
    """The nonces of seals accepted in the last :data:`WINDOW_S` seconds (at most ``capacity``,
    oldest dropped first): a second use within the window is refused. Only seals that verified
    are remembered, so only holders of the secret can fill it. One thread only."""

    def __init__(self, window_s: float = WINDOW_S, capacity: int = 65_536) -> None:
        self.window_s = window_s
        self.capacity = capacity
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when it expires

    def admit(self, seal: Seal, now: float) -> None:
        """Remember ``seal``'s nonce, or :class:`CredentialError` if it was used already."""
        while self._seen and next(iter(self._seen.values())) <= now:
            self._seen.popitem(last=False)
        if seal.nonce in self._seen:
            raise CredentialError("replayed_seal", "this seal was used already (a replay)")
        if len(self._seen) >= self.capacity:
            self._seen.popitem(last=False)
        # Past ts + window the seal is stale anyway (ClusterCredential.check refuses it).
        self._seen[seal.nonce] = max(now, seal.ts + self.window_s) + 1.0

    def __len__(self) -> int:
        return len(self._seen)


# ---- bootstrap HTTP ----------------------------------------------------------------------


def _request_parts(method: str, path: str, body: bytes) -> list[bytes]:
    return [method.upper().encode(), path.encode(), hashlib.sha256(body).digest()]


def sign_request(credential: ClusterCredential, method: str, path: str, body: bytes = b"") -> str:
    """The ``Authorization`` value that seals one bootstrap request (``path`` with its query,
    exactly as sent)."""
    seal = credential.seal(HTTP_DOMAIN, _request_parts(method, path, body))
    return f"{HTTP_SCHEME} {seal.text}"


def check_request(
    credential: ClusterCredential,
    method: str,
    path: str,
    body: bytes,
    header: str | None,
    now: float,
) -> Seal:
    """The request's seal, verified (:class:`CredentialError` when missing or bad)."""
    if not header:
        raise CredentialError(
            "unauthenticated",
            "this bootstrap server requires the cluster credential: the request carries no "
            f"'Authorization: {HTTP_SCHEME} ...' seal",
        )
    match = _HEADER.fullmatch(header.strip())
    if match is None:
        raise CredentialError(
            "unauthenticated", f"the Authorization header is not '{HTTP_SCHEME} <seal>'"
        )
    return credential.check(HTTP_DOMAIN, _request_parts(method, path, body), match[1], now)
