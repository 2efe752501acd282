"""Who is calling: the tenant comes from credentials in gRPC metadata, never from a request field.

`AnonymousAuth` (the embedded default) gives every caller one configured tenant. A verifier maps a
bearer token to a Principal; the search path only ever sees `Principal.tenant`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Principal:
    tenant: str
    scopes: frozenset = frozenset()


class Authenticator(Protocol):
    def authenticate(self, metadata: tuple) -> Principal: ...


class AnonymousAuth:
    """No credentials required: every caller is `tenant` (single-tenant deployments)."""

    def __init__(self, tenant: str = "default"):
        if not tenant:
            raise ValueError("the anonymous tenant must be a non-empty name")
        self.principal = Principal(tenant)

    def authenticate(self, metadata: tuple) -> Principal:
        return self.principal
