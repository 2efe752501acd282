"""The one table from domain errors to gRPC status codes, and the boundary that applies it.

`boundary` wraps every servicer method: a domain error becomes its status with its message; anything
unexpected becomes INTERNAL, is logged with its traceback, and the server keeps serving.
"""
from __future__ import annotations

import functools
import logging

import grpc

from server import errors
from server.core import metrics

log = logging.getLogger(__name__)

STATUS = (  # most specific first
    (errors.ModelMismatch, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.IndexCorruptError, grpc.StatusCode.DATA_LOSS),
    (errors.CorpusVersionMismatch, grpc.StatusCode.ABORTED),
)


def status_for(exc: BaseException) -> grpc.StatusCode:
    for cls, code in STATUS:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def boundary(method: str):
    """Decorator for async servicer methods: map errors once, count every answer by code."""

    def wrap(fn):
        @functools.wraps(fn)
        async def handler(self, request, context):
            try:
                response = await fn(self, request, context)
            except errors.SearchError as exc:
                code = status_for(exc)
                metrics.REQUESTS.labels(method, code.name).inc()
                await context.abort(code, str(exc))
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # a bug: report INTERNAL, keep serving
                log.exception("unexpected error in %s", method)
                metrics.REQUESTS.labels(method, "INTERNAL").inc()
                await context.abort(grpc.StatusCode.INTERNAL,
                                    f"internal error in {method}: {type(exc).__name__}")
            metrics.REQUESTS.labels(method, "OK").inc()
            return response

        return handler

    return wrap
