"""Domain errors. The core and backends raise these; server/transport/errors.py maps them to gRPC
status codes in one table. Nothing here imports grpc."""
from __future__ import annotations

import errno
import sqlite3
from typing import Optional


class SearchError(Exception):
    """Base class: every error a caller may see with a clear status and message."""


class InvalidArgument(SearchError):
    """The request is malformed or out of range (never retried)."""


class NotFound(SearchError):
    """An unknown collection, build or document."""


class ModelMismatch(InvalidArgument):
    """A query vector tagged with another embedding model than the build's, or untagged."""


class FailedPrecondition(SearchError):
    """The system is not in a state that allows the operation (e.g. an audit that did not pass)."""


class Overloaded(SearchError):
    """Admission control shed the request."""


class Unavailable(SearchError):
    """Not ready, or every replica of a needed shard failed."""


class ShardUnreachable(Unavailable):
    """No replica of a shard answered ShardInfo. `replicas`: each one's state (unreachable, or
    serving another build), which an operator's CollectionStats still shows in the outage."""

    def __init__(self, message: str, replicas: list = ()):
        super().__init__(message)
        self.replicas = list(replicas)


class ReplicaOverloaded(Unavailable):
    """A shard replica shed the call (its RESOURCE_EXHAUSTED): try another, but do not hold it
    against the replica - refusals come in bursts exactly when capacity is short, and ejecting
    replicas then would shrink it further."""


class DeadlineExceeded(SearchError):
    """The request's deadline passed before it could be answered."""


class Unauthenticated(SearchError):
    """No valid credentials."""


class PermissionDenied(SearchError):
    """Valid credentials, but not allowed to do this."""


class ResponseTooLarge(SearchError):
    """An answer larger than a response may carry (limits.MAX_RESPONSE_BYTES): found before it
    is written out, not by gRPC after the whole of it is built."""


class StorageFull(SearchError):
    """The volume a write (or a load) needs to write to is full; nothing is damaged."""


# What storage says when it refuses, by condition: the condition decides the status a caller
# gets (outside QA: a lock held by a backup job, a volume remounted read-only and a deleted state
# directory all answered INTERNAL, and a lock at start was called damage, with "remove the
# state" as its fix). Only storage's own errors are read, each its own way: an OSError by its
# errno, SQLite's by its result code (SQLITE_LOCKED, a connection's own conflict, is a bug, and
# SQLITE_CORRUPT damage: neither is storage refusing), tantivy's by Rust's io::Error kind
_ERRNO = {errno.ENOSPC: "full", errno.EDQUOT: "full", errno.EROFS: "read-only",
          errno.EACCES: "read-only", errno.EPERM: "read-only", errno.ENOENT: "missing",
          errno.EIO: "io"}
_SQLITE_CODES = {"SQLITE_FULL": "full", "SQLITE_BUSY": "locked", "SQLITE_READONLY": "read-only",
                 "SQLITE_PERM": "read-only", "SQLITE_IOERR": "io", "SQLITE_CANTOPEN": "unopenable"}
_SQLITE_TEXTS = (("full", "database or disk is full"), ("locked", "database is locked"),  # an
                 ("read-only", "attempt to write a readonly database"),  # error raised by hand
                 ("io", "disk I/O error"), ("unopenable", "unable to open database file"))
_TANTIVY_KINDS = (("full", ("kind: StorageFull", "kind: QuotaExceeded", "No space left on device")),
                  ("read-only", ("kind: ReadOnlyFilesystem", "kind: PermissionDenied",
                                 "Read-only file system", "Permission denied")),
                  ("missing", ("kind: NotFound", "No such file or directory")))
STORAGE_CONDITION_WORDS = {"full": "full", "locked": "locked by another process",
                           "read-only": "read-only (or not permitted)",
                           "missing": "missing a file it needs",
                           "unopenable": "unable to open a file it needs",
                           "io": "failing (an I/O error)"}


def _condition_of(exc: BaseException) -> Optional[str]:
    if isinstance(exc, OSError):
        return _ERRNO.get(exc.errno)
    if isinstance(exc, sqlite3.Error):
        name = getattr(exc, "sqlite_errorname", None)
        if name:  # extended codes (SQLITE_BUSY_RECOVERY, SQLITE_IOERR_WRITE) by their family
            return _SQLITE_CODES.get("_".join(name.split("_")[:2]))
        text = str(exc)
        return next((c for c, t in _SQLITE_TEXTS if t in text), None)
    text = str(exc)
    if isinstance(exc, ValueError) and "IoError" in text:  # tantivy's
        return next((c for c, words in _TANTIVY_KINDS if any(w in text for w in words)), "io")
    return None


def storage_condition(exc: Optional[BaseException]) -> Optional[str]:
    """'full', 'locked', 'read-only', 'missing', 'unopenable' or 'io' when `exc`, or an error it
    was raised from (`raise ... from`), is storage refusing; a full volume anywhere in that
    chain wins. None for anything else."""
    first = None
    for _ in range(16):  # a chain of causes, bounded
        if exc is None:
            break
        condition = _condition_of(exc)
        if condition == "full":
            return condition
        first = first or condition
        exc = exc.__cause__
    return first


def storage_error(exc: BaseException, where: str, then: str) -> Optional[SearchError]:
    """The clear error for storage refusing (`storage_condition`), or None. `where` names what
    could not be written (a path), `then` what becomes of the request (e.g. "the write may not
    have been applied: send it again")."""
    condition = storage_condition(exc)
    if condition is None:
        return None
    why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    if condition == "full":
        return StorageFull(f"{where}: its volume is full ({why}); nothing is damaged; {then}, "
                           f"once there is room")
    if condition == "locked":
        return Unavailable(f"{where}: another process holds a lock on it ({why}: a backup job, an "
                           f"sqlite3 shell?); nothing is damaged; {then}, once it is released")
    what = {"read-only": "cannot be written (read-only or not permitted)",
            "missing": "is missing (removed while in use?)",
            "unopenable": "cannot be opened (removed while in use, or out of file handles?)",
            "io": "failed to write (an I/O error: is the volume healthy?)"}[condition]
    return FailedPrecondition(f"{where} {what} ({why}); {then}, once it is fixed")


def is_storage_full(exc: Optional[BaseException]) -> bool:
    """Whether `exc` (or an exception it was raised from) says the storage under it is full."""
    return storage_condition(exc) == "full"


class IndexCorruptError(SearchError):
    """An index file is missing, truncated or corrupted; the message names the file."""


def is_panic(exc: BaseException) -> bool:
    """A Rust panic raised through pyo3 (tantivy's on a damaged file): a BaseException, so an
    `except Exception` lets it through and a caller waiting on it never hears back."""
    return type(exc).__name__ == "PanicException"


def is_failure(exc: BaseException) -> bool:
    """Whether `exc` is an operation's failure - any Exception, or a BM25 panic (`is_panic`) -
    rather than a stop to pass on (KeyboardInterrupt, SystemExit, a task's cancellation)."""
    return isinstance(exc, Exception) or is_panic(exc)


def panic_as_corruption(exc: BaseException, what: str) -> IndexCorruptError:
    """A panic of the BM25 library (`is_panic`) as the error its callers get at once: `what`
    failed on a damaged file."""
    return IndexCorruptError(f"{what} failed ({exc}): it is damaged; restore the state directory "
                             "or rebuild")


class CorpusVersionMismatch(SearchError):
    """Dense and lexical candidates came from different corpus versions (never fused)."""


class Internal(SearchError):
    """An unexpected failure of one query of a batch (a bug, a model that failed): that query
    answers INTERNAL in its slot, logged with its traceback, and the others still answer."""


class CatchUpAbandoned(Exception):
    """A replica's catch-up on a build stopped because the build is no longer wanted (a rollback
    or another publish moved the alias while it ran): not a failure, so not a SearchError."""
