"""Domain errors. The core and backends raise these; server/transport/errors.py maps them to gRPC
status codes in one table. Nothing here imports grpc."""
from __future__ import annotations

import errno
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


# What storage says when it refuses, by condition, however its library puts it (an OSError's
# errno, SQLite's and tantivy's texts): the condition decides the status a caller gets (outside
# QA: a lock held by a backup job, a volume remounted read-only and a deleted state directory all
# answered INTERNAL, and a lock at start was called damage, with "remove the state" as its fix)
_CONDITIONS = (
    ("full", (errno.ENOSPC, errno.EDQUOT),
     ("database or disk is full", "No space left on device", "Disk quota exceeded", "StorageFull")),
    ("locked", (), ("database is locked", "database table is locked")),
    ("read-only", (errno.EROFS, errno.EACCES, errno.EPERM),
     ("attempt to write a readonly database", "Read-only file system", "Permission denied")),
    ("missing", (errno.ENOENT,),
     ("unable to open database file", "No such file or directory", "Failed to open file for write")),
    ("io", (errno.EIO,), ("disk I/O error", "Input/output error")),
)
STORAGE_CONDITION_WORDS = {"full": "full", "locked": "locked by another process",
                           "read-only": "read-only (or not permitted)",
                           "missing": "missing a file it needs", "io": "failing (an I/O error)"}


def storage_condition(exc: Optional[BaseException]) -> Optional[str]:
    """'full', 'locked', 'read-only', 'missing' or 'io' when `exc` (or an exception it was
    raised from) is storage refusing, the first of them in that order; None for anything else."""
    chain = []
    while exc is not None and all(exc is not e for e in chain):
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    texts_of = [str(e) for e in chain]
    for name, numbers, texts in _CONDITIONS:
        for e, text in zip(chain, texts_of):
            if (isinstance(e, OSError) and e.errno in numbers) or any(t in text for t in texts):
                return name
    return None


def storage_error(exc: BaseException, where: str, retry: str) -> Optional[SearchError]:
    """The clear error for storage refusing (`storage_condition`), or None. `where` names what
    could not be written (a path), `retry` what becomes of the request (e.g. "the write may not
    have been applied: ... send it again")."""
    condition = storage_condition(exc)
    if condition is None:
        return None
    why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    if condition == "full":
        return StorageFull(f"{where}: its volume is full ({why}); {retry}, once there is room")
    if condition == "locked":
        return Unavailable(f"{where}: another process holds a lock on it ({why}: a backup job, an "
                           f"sqlite3 shell?); nothing is damaged; {retry}, once it is released")
    what = {"read-only": "cannot be written (read-only or not permitted)",
            "missing": "is missing (removed while in use?)",
            "io": "failed to write (an I/O error: is the volume healthy?)"}[condition]
    return FailedPrecondition(f"{where} {what} ({why}); {retry}, once it is fixed")


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
