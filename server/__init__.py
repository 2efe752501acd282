"""Hybrid search server: transport (gRPC) -> core (orchestration) -> backends (faiss, tantivy, models)."""
