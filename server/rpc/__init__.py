"""Generated gRPC/protobuf modules for proto/search.proto and proto/shard.proto.

They are produced by grpcio-tools at development time (`python -m server.rpc.codegen`), committed,
and never edited by hand or generated at import; `python -m server.rpc.codegen --check` (run by the
test suite) fails when they no longer match the .proto files.
"""
from server.rpc.gen import search_pb2, search_pb2_grpc, shard_pb2, shard_pb2_grpc

__all__ = ["search_pb2", "search_pb2_grpc", "shard_pb2", "shard_pb2_grpc"]
