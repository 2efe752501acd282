"""The shard engine: the index of one shard (index.py) and its writable state (state.py), the
schedulers that batch queries and group writes (scheduler.py), and `LocalShard` (local.py), which
puts them behind the shard interface."""
