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


class StorageFull(SearchError):
    """The volume a write (or a load) needs to write to is full; nothing is damaged."""


def is_storage_full(exc: Optional[BaseException]) -> bool:
    """Whether `exc` (or an exception it was raised from) says the storage under it is full,
    however its library puts it: an OSError (ENOSPC, EDQUOT), SQLite's "database or disk is
    full", tantivy's I/O error text."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc)
        if any(s in text for s in ("database or disk is full", "No space left on device",
                                   "Disk quota exceeded", "StorageFull")):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


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
