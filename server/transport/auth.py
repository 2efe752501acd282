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
import os
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


def _read_tokens(path: Path) -> dict[str, Principal]:
    """The token file: sha256 of each token -> its principal. ValueError (or OSError) naming
    the entry when it is not valid."""
    data = json.loads(path.read_text())
    by_hash: dict[str, Principal] = {}
    for i, entry in enumerate(data.get("tokens", [])):
        where = f"{path} tokens[{i}]"
        digest = entry.get("sha256") or (
            hashlib.sha256(entry["token"].encode()).hexdigest() if entry.get("token") else None)
        if not digest:
            raise ValueError(f"{where}: needs sha256 (or token)")
        acl = tuple(sorted(str(a) for a in entry.get("acl", [])))
        for scope in acl:
            if not NAME.match(scope):
                raise ValueError(f"{where}: ACL scope {scope!r} must match {NAME.pattern}")
        roles = frozenset(entry.get("roles", []))
        if roles - set(ROLES):
            raise ValueError(f"{where}: unknown roles {sorted(roles - set(ROLES))}")
        by_hash[digest.lower()] = Principal(_check_tenant(entry.get("tenant"), where), acl, roles)
    if not by_hash:
        raise ValueError(f"{path}: no tokens configured")
    return by_hash


class TokenFileAuth:
    """Callers by bearer token, from a JSON file. The file is read again when it changes (its
    size, modification time or inode, looked at most once a second): a token removed from it
    stops working within a second, with no restart (outside QA: a revoked token kept working
    until one). A file that changes into something unreadable or invalid keeps the tokens read
    before, and says so in the log, until it is fixed."""

    RECHECK_S = 1.0

    def __init__(self, path: Path):
        self.path = Path(path)
        self._seen = self._stamp()
        self._by_hash = _read_tokens(self.path)
        self._checked = time.monotonic()

    def _stamp(self):
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.RECHECK_S:
            return
        self._checked = now
        stamp = self._stamp()
        if stamp == self._seen:
            return
        self._seen = stamp
        try:
            self._by_hash = _read_tokens(self.path)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.error("token file %s changed but cannot be read (%s): the tokens read before "
                      "stay in force until it is fixed", self.path, exc)
        else:
            log.info("token file %s read again: %d tokens", self.path, len(self._by_hash))

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
