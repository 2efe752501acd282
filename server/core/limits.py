"""Documented caps on request sizes. Anything beyond them is refused with INVALID_ARGUMENT."""

MAX_TOP_K = 1000
MAX_DEPTH = 2000               # dense_depth / lexical_depth
DEFAULT_DEPTH = 100
DEFAULT_RRF_K = 60
MAX_RRF_K = 10_000
MAX_QUERY_CHARS = 8192
MAX_FILTERS = 16
MAX_FILTER_VALUES = 256
MAX_FILTER_VALUE_CHARS = 1_024         # = MAX_METADATA_VALUE_CHARS: any value a write stores can be
                                      # filtered on (outside QA: 257-1,024 could not)
MAX_COLLECTION_NAME = 128
MAX_CONTEXT_TOKENS = 100_000
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # gRPC receive limit on every listener (a SearchBatch of
                                      # 1,024 queries with 384-d vectors is ~1.6 MB)
MAX_RESPONSE_BYTES = 64 * 1024 * 1024  # gRPC send limit of every listener, the client's receive
                                       # limit; answers are budgeted against it as they are
                                       # written (servicers.py), not refused by gRPC after
ANSWERS_BUDGET_BYTES = MAX_RESPONSE_BYTES - 1024 * 1024  # room left for refused slots' messages
RESPONSE_FULL_NOTE = "the response size limit"  # in a SearchBatch slot's message: send it again
RESPONSE_TOO_LARGE_NOTE = "a response may carry"  # in the message of an answer too large alone
OVER_THE_RESPONSE_LIMIT = f"over the {MAX_RESPONSE_BYTES // 2**20} MiB {RESPONSE_TOO_LARGE_NOTE}"
DEFAULT_RERANK_CAP = 200              # server cap on rerank_depth (configurable)
MAX_DOC_ID_CHARS = 512
MAX_VERSION = 2 ** 63 - 1             # document versions: the proto field is uint64, SQLite's int64
MAX_ROW = 2 ** 63 - 1                 # shard row numbers (FetchChunks)
MAX_SEQUENCE = 2 ** 63 - 1            # write-log sequence numbers
MAX_FETCH_ROWS = 4096                 # rows per FetchChunks call
MAX_CHUNKS_PER_DOC = 4096             # chunks (with vectors) per UpsertDocument
MAX_BATCH_QUERIES = 1024              # queries per SearchBatch call
MAX_VECTOR_NORM = 1e18                # l2 collections: longer vectors overflow float32 distances
                                      # (ip collections scale every vector to unit length)
MAX_DOC_TEXT_CHARS = 1_000_000
MAX_TITLE_CHARS = 1_000
MAX_METADATA_ENTRIES = 64
MAX_METADATA_VALUE_CHARS = MAX_FILTER_VALUE_CHARS
MAX_ACL_SCOPES = 64
MAX_FEEDBACK_DOCS = 100               # hits fed back (dense and lexical feedback)
MAX_EXPANSION_TERMS = 64              # lexical feedback terms per query (and per shard query)
MAX_TERM_CHARS = 64                   # one analysed expansion term
MAX_TERM_WEIGHT = 10.0                # an expansion term's boost
