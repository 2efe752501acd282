"""Who is calling: the tenant and ACL scopes come from credentials in gRPC metadata, never from a
request field, so no request can name, widen or wildcard its tenant.

- `AnonymousAuth` (the embedded default): no credentials; every caller is one configured tenant.
- `TokenFileAuth`: `authorization: Bearer <token>` looked up in a JSON file of token hashes:
    {"tokens": [{"sha256": "<hex sha256 of the token>", "tenant": "acme",
                 "acl": ["eng", "hr"], "roles": ["write", "admin"]}, ...]}
  ("token": "<plain token>" is accepted in place of "sha256" for development files.) The file
  is read again when it changes: a token removed from it stops working within a second.
Any verifier with `authenticate(metadata) -> Principal` plugs in (e.g. JWT or mTLS identity).
Roles gate operations:
- "write": UpsertDocument / DeleteDocument (within the caller's tenant);
- "admin": the admin service's reads, scoped to the caller's tenant (its own counts; no other
  tenant's name appears in a description);
- "operator": collection-wide actions and views (Compact, every tenant's counts); implies "admin".
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from server.core.collection import NAME
from server.errors import PermissionDenied, Unauthenticated

log = logging.getLogger(__name__)

ROLES = ("write", "admin", "operator")


@dataclass(frozen=True)
class Principal:
    tenant: str
    acl_scopes: tuple = ()
    roles: frozenset = field(default_factory=frozenset)

    def require(self, role: str) -> "Principal":
        if not self.has(role):
            raise PermissionDenied(f"tenant {self.tenant!r}: this credential lacks the {role!r} role")
        return self

    def has(self, role: str) -> bool:
        return role in self.roles or (role == "admin" and "operator" in self.roles)

    @property
    def is_operator(self) -> bool:
        return "operator" in self.roles


class Authenticator(Protocol):
    def authenticate(self, metadata) -> Principal: ...


def _check_tenant(tenant: str, where: str) -> str:
    if not isinstance(tenant, str) or not NAME.match(tenant):
        raise ValueError(f"{where}: tenant {str(tenant)[:80]!r} must match {NAME.pattern} "
                         "(no empty or wildcard tenants)")
    return tenant


class AnonymousAuth:
    """No credentials required: every caller is `tenant`, with every role (single-tenant use)."""

    def __init__(self, tenant: str = "default"):
        self.principal = Principal(_check_tenant(tenant, "anonymous tenant"), (), frozenset(ROLES))

    def authenticate(self, metadata) -> Principal:
        return self.principal


def _entry(entry, where: str) -> tuple[str, Principal]:
    """(sha256 of the token, its principal); ValueError naming the entry when it is not valid."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: an object is expected")
    digest = entry.get("sha256") or (
        hashlib.sha256(str(entry["token"]).encode()).hexdigest() if entry.get("token") else None)
    if not digest:
        raise ValueError(f"{where}: needs sha256 (or token)")
    acl = tuple(sorted(str(a) for a in entry.get("acl", [])))
    for scope in acl:
        if not NAME.match(scope):
            raise ValueError(f"{where}: ACL scope {scope!r} must match {NAME.pattern}")
    roles = frozenset(entry.get("roles", []))
    if roles - set(ROLES):
        raise ValueError(f"{where}: unknown roles {sorted(roles - set(ROLES))}")
    return str(digest).lower(), Principal(_check_tenant(entry.get("tenant"), where), acl, roles)


def _read_tokens(path: Path, text: str, strict: bool = True) -> dict[str, Principal]:
    """The token file's text: sha256 of each token -> its principal. `strict` (at start): any
    invalid entry, or none at all, is a ValueError naming it. Not strict (a file read again):
    the valid entries take effect and the others are logged and left out - a token removed
    from a file that parses never survives it - and an empty list locks every caller out.
    Text that is not the file's JSON object is a ValueError either way."""
    data = json.loads(text)
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(tokens, list):
        raise ValueError(f'{path}: a JSON object with a "tokens" list is expected')
    by_hash: dict[str, Principal] = {}
    for i, entry in enumerate(tokens):
        try:
            digest, principal = _entry(entry, f"{path} tokens[{i}]")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            if strict:
                raise ValueError(str(exc)) from None
            log.error("token file %s: %s: left out", path, exc)
            continue
        by_hash[digest] = principal
    if not by_hash and strict:
        raise ValueError(f"{path}: no tokens configured")
    return by_hash


class TokenFileAuth:
    """Callers by bearer token, from a JSON file. The file is read again at most once a second
    (a small file: its bytes are compared, not its modification time, which moves in coarse
    ticks) and takes effect when it changed: a token removed from it stops working within a
    second, with no restart (outside QA: a revoked token kept working until one). Changed
    entries that are not valid are left out (logged); an empty list locks every caller out.
    Only a file that does not parse at all (half-written, garbled) keeps the tokens read before,
    logged at every look until it parses."""

    RECHECK_S = 1.0

    def __init__(self, path: Path):
        self.path = Path(path)
        raw = self.path.read_bytes()
        self._by_hash = _read_tokens(self.path, raw.decode())
        self._seen = hashlib.sha256(raw).digest()
        self._checked = time.monotonic()

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.RECHECK_S:
            return
        self._checked = now
        try:
            raw = self.path.read_bytes()
        except OSError as exc:  # moved away for a moment, say: the tokens read before stand
            log.error("token file %s cannot be read (%s): the tokens read before stay in force",
                      self.path, exc)
            return
        seen = hashlib.sha256(raw).digest()
        if seen == self._seen:
            return
        try:
            by_hash = _read_tokens(self.path, raw.decode(), strict=False)
        except (ValueError, UnicodeDecodeError) as exc:  # not yet whole: looked at again
            log.error("token file %s changed but does not parse (%s): the tokens read before "
                      "stay in force until it does", self.path, exc)
            return
        self._by_hash, self._seen = by_hash, seen
        log.info("token file %s read again: %d tokens", self.path, len(by_hash))

    def authenticate(self, metadata) -> Principal:
        self._maybe_reload()
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        if len(values) != 1:
            raise Unauthenticated("send exactly one 'authorization: Bearer <token>' metadata entry")
        value = values[0] if isinstance(values[0], str) else values[0].decode("latin-1")
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("authorization metadata must be 'Bearer <token>'")
        digest = hashlib.sha256(token.strip().encode()).hexdigest()
        for known, principal in self._by_hash.items():  # constant-time compare per entry
            if hmac.compare_digest(known, digest):
                return principal
        raise Unauthenticated("unknown token")
