"""Generated gRPC/protobuf modules for proto/search.proto and proto/shard.proto.

The modules are produced by grpcio-tools (see codegen.py), never edited by hand. A wheel build
generates them (setup.py); a source checkout generates them on first import when they are
missing or older than the .proto files.
"""
from server.rpc.codegen import ensure_generated

ensure_generated()

from server.rpc.gen import search_pb2, search_pb2_grpc, shard_pb2, shard_pb2_grpc  # noqa: E402

__all__ = ["search_pb2", "search_pb2_grpc", "shard_pb2", "shard_pb2_grpc"]
