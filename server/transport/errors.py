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


class Malformed:
    """Stands in for a request whose bytes did not parse; the boundary answers INVALID_ARGUMENT."""

    def __init__(self, message_type: str, error: Exception):
        self.message_type, self.error = message_type, error


def safe_deserializer(cls):
    """Parse a request; on garbage bytes (or invalid UTF-8 in a string field) return Malformed
    instead of letting grpc answer INTERNAL."""
    name = cls.DESCRIPTOR.full_name

    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except Exception as exc:  # google.protobuf.message.DecodeError and friends
            return Malformed(name, exc)

    return parse


def add_service(server, servicer, service_descriptor) -> None:
    """Register `servicer` for every method of a protobuf service, with safe request parsing.

    Used instead of the generated add_*_to_server so malformed bytes get INVALID_ARGUMENT.
    """
    from google.protobuf import message_factory

    handlers = {}
    for method in service_descriptor.methods:
        req_cls = message_factory.GetMessageClass(method.input_type)
        resp_cls = message_factory.GetMessageClass(method.output_type)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name), request_deserializer=safe_deserializer(req_cls),
            response_serializer=resp_cls.SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service_descriptor.full_name, handlers),))


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
                if isinstance(request, Malformed):
                    raise errors.InvalidArgument(f"request is not a valid {request.message_type}: "
                                                 f"{type(request.error).__name__}")
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
