"""Core orchestration: collections, shards, fan-out, fusion, batching, assembly. Never imports grpc."""
