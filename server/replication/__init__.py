"""Cross-machine write replication.

Writes to a collection are appended to a NATS JetStream stream (one stream per collection, one
subject per shard); every replica of a shard reads that shard's subject through its own durable
pull consumer and applies the entries in log order. See `server.replication.jetstream`.
Nothing in this package imports grpc.
"""
