"""Backends: faiss dense index, tantivy lexical index, SQLite chunk store, embedder, cross-encoder.

Backends know nothing of requests or gRPC; they take arrays, strings and id sets.
"""
