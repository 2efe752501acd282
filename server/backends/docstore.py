"""The shard's chunk store in SQLite (WAL): text, offsets, tenant, ACL, metadata and liveness per row.

It is the authority for which rows are visible: the dense branch searches only rows whose bit is set
in a mask computed here (live, tenant, ACL scopes, metadata filters), and every hit is re-checked
against it. A chunk's ACL is a list of scopes; PUBLIC_ACL marks a chunk every caller of its tenant
may read. A caller sees a chunk when the ACL shares a scope with the caller's scopes + PUBLIC_ACL.

A build writes its store once (read-only afterwards); a serving shard works on a copy of it in its
state directory (server/core/engine/state.py), where streaming writes land.
"""
from __future__ import annotations

import hashlib
import json
import operator
import os
import re
import sqlite3
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from server.errors import FailedPrecondition, IndexCorruptError, InvalidArgument, storage_error

SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (
    row          INTEGER PRIMARY KEY,      -- the dense index row (faiss sequential id)
    chunk_id     INTEGER NOT NULL,         -- deterministic hash of (tenant, doc_id, chunk_index)
    version      INTEGER NOT NULL DEFAULT 1,
    doc_id       TEXT    NOT NULL,
    chunk_index  INTEGER NOT NULL,
    start_offset INTEGER NOT NULL,
    end_offset   INTEGER NOT NULL,
    title        TEXT    NOT NULL DEFAULT '',
    text         TEXT    NOT NULL,
    tenant       TEXT    NOT NULL,
    acl          TEXT    NOT NULL DEFAULT '["@all"]',  -- JSON list of scopes
    metadata     TEXT    NOT NULL DEFAULT '{}',
    text_hash    INTEGER NOT NULL DEFAULT 0,  -- fingerprint of the normalised text (de-duplication)
    live         INTEGER NOT NULL DEFAULT 1,  -- 0 pending, 1 live, 2 dead (replaced/deleted), 3 orphan
    purged       INTEGER NOT NULL DEFAULT 0,  -- 1 once a dead/orphan row left the lexical index
    vector       BLOB                         -- float32 vector of rows added after the build
);
CREATE INDEX IF NOT EXISTS chunks_doc ON chunks(tenant, doc_id, live);
CREATE INDEX IF NOT EXISTS chunks_tenant ON chunks(tenant, live);
CREATE UNIQUE INDEX IF NOT EXISTS chunks_live_id ON chunks(chunk_id) WHERE live = 1;
-- documents are keyed by (tenant, doc_id): tenants can neither see nor block each other's ids
CREATE TABLE IF NOT EXISTS documents (
    tenant  TEXT NOT NULL,
    doc_id  TEXT NOT NULL,
    version INTEGER NOT NULL,
    live    INTEGER NOT NULL DEFAULT 1,   -- 0: deleted at `version` (a tombstone: older writes are no-ops)
    source_modified_at REAL,
    ingested_at REAL,
    PRIMARY KEY (tenant, doc_id)
);
-- every applied write, in order: replayed into a new build before its alias flip. log_seq is its
-- position in the replicated write log (0 in the embedded default).
CREATE TABLE IF NOT EXISTS writes (
    seq      INTEGER PRIMARY KEY AUTOINCREMENT,
    log_seq  INTEGER NOT NULL DEFAULT 0,
    op       TEXT NOT NULL,               -- upsert | delete
    tenant   TEXT NOT NULL,
    doc_id   TEXT NOT NULL,
    version  INTEGER NOT NULL,
    body     TEXT NOT NULL,               -- JSON: title, text, metadata, acl, times
    chunks   TEXT NOT NULL DEFAULT '[]',  -- JSON: [[index, start, end, text], ...]
    vectors  BLOB,                        -- float32 (chunks x dim): a replay needs no model
    model_id TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

PENDING, LIVE, DEAD, ORPHAN = 0, 1, 2, 3
STATE_NAMES = {PENDING: "pending", LIVE: "live", DEAD: "dead", ORPHAN: "orphan"}
# how long a statement waits for another connection's lock (another process's: a backup job, an
# sqlite3 shell) before SQLite says "database is locked": a write then answers UNAVAILABLE, a
# start fails naming the lock (errors.storage_error)
BUSY_TIMEOUT_S = 30.0
SCHEMA_VERSION = "3"  # 2: documents keyed by (tenant, doc_id); 3: text_hash, log_seq, replayable writes

FILTER_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
PUBLIC_ACL = "@all"
PUBLIC_ACL_JSON = json.dumps([PUBLIC_ACL])
_SPACE = re.compile(r"\s+")


def chunk_fingerprint(title: str, text: str) -> int:
    """63-bit fingerprint of what a reader sees of a chunk (its document's title and its text),
    whitespace and case folded: equal passages (the same boilerplate in two documents) match, so
    de-duplication at query time is a set lookup instead of hashing every hit's text. The title
    is part of it: CACM has hundreds of documents whose text is only their authors' names."""
    norm = (_SPACE.sub(" ", title).strip() + "\x00" + _SPACE.sub(" ", text).strip()).lower().encode()
    return int.from_bytes(hashlib.blake2b(norm, digest_size=8).digest(), "big") & ((1 << 63) - 1)


@dataclass(slots=True)
class ChunkRecord:
    """One chunk version as stored: read-only once made (a row never changes; its liveness lives
    in the store and the shard's live bitmap). Not frozen: a frozen dataclass costs ~8x as much to
    create, and the search path makes one per hit it ships."""

    row: int
    chunk_id: int
    doc_id: str
    chunk_index: int
    start_offset: int
    end_offset: int
    title: str
    text: str
    tenant: str
    metadata: dict
    acl: tuple = (PUBLIC_ACL,)
    text_hash: int = 0
    # what a hit with it may take in a message, once counted (codec.record_bytes): a cached
    # record is counted once, not once per answer that shows it
    nbytes: int = field(default=-1, compare=False)

    def __reduce__(self):
        # its fields as one tuple: ~3x faster to pickle than a slots dataclass's own state, and
        # `serve --workers` pickles one per hit over the engine link
        return (ChunkRecord, _record_fields(self))


_record_fields = operator.attrgetter(*(f.name for f in fields(ChunkRecord)))


@dataclass
class LoggedWrite:
    """A write as the store logged it: enough to apply it again to another build."""

    seq: int
    log_seq: int
    op: str
    tenant: str
    doc_id: str
    version: int
    body: dict
    chunks: list          # [(index, start, end, text)]
    vectors: Optional[np.ndarray]
    model_id: str


@dataclass
class FlipEntry:
    """One write of a group's visibility flip."""

    op: str
    tenant: str
    doc_id: str
    version: int
    new_rows: Sequence[int]
    body: dict
    chunks: list
    vectors: Optional[np.ndarray]
    model_id: str
    log_seq: int = 0


def read_only_uri(path: Path) -> str:
    """Open a store for reading only. On a read-only volume SQLite cannot create the WAL index
    (-shm), so the file is opened as immutable (a published build never changes); elsewhere a
    plain read-only open also sees a WAL that was not checkpointed."""
    path = Path(path)
    immutable = "&immutable=1" if not os.access(path.parent, os.W_OK) else ""
    return f"file:{path}?mode=ro{immutable}"


def check_filter_key(key: str, what: str = "filter key") -> str:
    """A metadata key as filters name it (`what` says which of the two the caller checks)."""
    if not FILTER_KEY.match(key):
        raise InvalidArgument(f"{what} {key[:80]!r} must match {FILTER_KEY.pattern}")
    return key


_RECORD_COLUMNS = ("row, chunk_id, doc_id, chunk_index, start_offset, end_offset, title, text, "
                   "tenant, metadata, acl, text_hash")


# the record columns of live rows as one JSON array of arrays (acl and metadata as JSON values)
_PACKED_FETCH = ("SELECT json_group_array(json_array(row, chunk_id, doc_id, chunk_index, "
                 "start_offset, end_offset, title, text, tenant, json(metadata), json(acl), "
                 "text_hash)) FROM chunks WHERE live=1 AND row IN ({})")
_JSON_FETCH = True


def _disable_json_fetch() -> None:
    global _JSON_FETCH
    _JSON_FETCH = False


def _record(r) -> ChunkRecord:
    return ChunkRecord(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], json.loads(r[9]),
                       tuple(json.loads(r[10])), r[11])


class DocStore:
    """One SQLite database; a connection per thread (sqlite3 objects are not shared)."""

    def __init__(self, path: Path, create: bool = False, read_only: bool = False):
        self.path = Path(path)
        self.read_only = read_only
        if not create and not self.path.is_file():
            raise IndexCorruptError(f"missing document store {self.path}")
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._all_lock = threading.Lock()
        conn = self._conn()
        if create:
            conn.executescript(SCHEMA)
            self.set_meta("schema_version", SCHEMA_VERSION)
        else:
            try:
                conn.execute("SELECT count(*) FROM chunks").fetchone()
                version = self.get_meta("schema_version")
            except sqlite3.DatabaseError as exc:
                # a lock, a volume: not damage
                clear = storage_error(exc, f"document store {self.path}", "open it again")
                raise clear or IndexCorruptError(
                    f"document store {self.path} is unreadable: {exc}") from exc
            if version != SCHEMA_VERSION:
                raise FailedPrecondition(
                    f"document store {self.path} has schema {version or '1'}; this release reads "
                    f"schema {SCHEMA_VERSION}: rebuild the collection with index-builder build")

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self.read_only:  # a published build, possibly on a read-only volume
                conn = sqlite3.connect(read_only_uri(self.path), uri=True, timeout=BUSY_TIMEOUT_S,
                                       isolation_level=None, check_same_thread=True)
            else:
                conn = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                       check_same_thread=True)
                conn.execute("PRAGMA journal_mode=WAL")
                # every commit durable across a power loss too (NORMAL: a process crash only), as
                # BM25's commits are (tantivy syncs them): an acknowledged write survives, and a
                # BM25 row past the store's last is a loss the load refuses (index.py), never a
                # store that merely missed its last commits. ~0.3 ms a commit, 2-3 per write group
                conn.execute("PRAGMA synchronous=FULL")
            self._local.conn = conn
            with self._all_lock:
                self._all.append(conn)
        return conn

    def _transaction(self, fn, immediate: bool = True):
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
        try:
            out = fn(conn)
            conn.execute("COMMIT")
            return out
        except BaseException:
            # SQLite has rolled back already after some errors (SQLITE_FULL: a full disk); a
            # ROLLBACK then raised "no transaction is active" in place of the error itself
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    # --- writes (builder) --------------------------------------------------------------------
    def insert_chunks(self, records: Iterable[ChunkRecord]) -> None:
        self._transaction(lambda conn: conn.executemany(
            "INSERT INTO chunks(row, chunk_id, doc_id, chunk_index, start_offset, end_offset, "
            "title, text, tenant, acl, metadata, text_hash, live) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,1)",
            [(r.row, r.chunk_id, r.doc_id, r.chunk_index, r.start_offset, r.end_offset, r.title,
              r.text, r.tenant, json.dumps(sorted(r.acl)), json.dumps(r.metadata, sort_keys=True),
              r.text_hash or chunk_fingerprint(r.title, r.text)) for r in records]), immediate=False)

    def insert_documents(self, docs: Iterable[tuple[str, str, int, int]]) -> None:
        """(tenant, doc_id, version, live) rows; live=0 keeps a deletion's tombstone."""
        self._transaction(lambda conn: conn.executemany(
            "INSERT OR REPLACE INTO documents(tenant, doc_id, version, live) VALUES (?,?,?,?)",
            list(docs)), immediate=False)

    # --- streaming writes (server/core/engine/index.py ShardIndex.apply_writes) --------------
    def documents_of(self, keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], tuple[int, int]]:
        """(version, live) of these (tenant, doc_id) keys, tombstones included."""
        out = {}
        conn = self._conn()
        for tenant, doc_id in keys:
            row = conn.execute("SELECT version, live FROM documents WHERE tenant=? AND doc_id=?",
                               (tenant, doc_id)).fetchone()
            if row is not None:
                out[(tenant, doc_id)] = row
        return out

    def versions_of(self, keys: Sequence[tuple[str, str]]) -> tuple[dict[tuple[str, str], int], int]:
        """(the version of each of these documents the store holds, tombstones included; the
        index version) read in one transaction: one flip's state (flips move both in one)."""
        def run(_conn):  # both reads use this thread's connection, inside the transaction
            found = self.documents_of(keys)
            return {key: version for key, (version, _) in found.items()}, self.index_version()

        return self._transaction(run, immediate=False)

    def live_rows_of(self, keys: Sequence[tuple[str, str]]) -> list[int]:
        """The live rows of these documents (the rows a replace of them will retire)."""
        conn = self._conn()
        out: list[int] = []
        for tenant, doc_id in keys:
            out.extend(r[0] for r in conn.execute(
                "SELECT row FROM chunks WHERE tenant=? AND doc_id=? AND live=1", (tenant, doc_id)))
        return out

    def next_row(self) -> int:
        last = self._conn().execute("SELECT max(row) FROM chunks").fetchone()[0]
        return 0 if last is None else last + 1  # (not `or -1`: row 0 is a row)

    def insert_pending(self, records: Sequence[ChunkRecord], versions: Sequence[int],
                       vectors: np.ndarray) -> None:
        """Write new versions' chunks, invisible (pending), with their vectors: durable first."""
        self._transaction(lambda conn: conn.executemany(
            "INSERT INTO chunks(row, chunk_id, version, doc_id, chunk_index, start_offset, "
            "end_offset, title, text, tenant, acl, metadata, text_hash, live, vector) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,0,?)",
            [(r.row, r.chunk_id, ver, r.doc_id, r.chunk_index, r.start_offset, r.end_offset,
              r.title, r.text, r.tenant, json.dumps(sorted(r.acl)),
              json.dumps(r.metadata, sort_keys=True), r.text_hash,
              np.ascontiguousarray(v, dtype=np.float32).tobytes())
             for r, ver, v in zip(records, versions, vectors)]))

    def flip(self, entries: Sequence[FlipEntry], applied_seq: Optional[int] = None
             ) -> list[Optional[tuple[list[tuple[int, bool]], bool]]]:
        """THE visibility change for a group of writes, one transaction: each document's live rows
        die, its new rows go live, its version moves, the write is logged; index_version moves
        once, and the write-log position applied is recorded with them.

        Returns per entry (the rows that died as (row, tenant_public), whether the document was
        live before), or None when the entry's version is not newer than the stored one (it
        changed nothing)."""
        def run(conn):
            out = []
            for e in entries:
                cur = conn.execute("SELECT version, live FROM documents WHERE tenant=? AND doc_id=?",
                                   (e.tenant, e.doc_id)).fetchone()
                if cur is not None and cur[0] >= e.version:
                    out.append(None)
                    continue
                dead = [(r, acl == PUBLIC_ACL_JSON) for r, acl in conn.execute(
                    "SELECT row, acl FROM chunks WHERE tenant=? AND doc_id=? AND live=1",
                    (e.tenant, e.doc_id))]
                conn.execute(f"UPDATE chunks SET live={DEAD} WHERE tenant=? AND doc_id=? AND live=1",
                             (e.tenant, e.doc_id))
                if e.new_rows:
                    conn.execute(f"UPDATE chunks SET live={LIVE} WHERE row IN "
                                 f"({','.join('?' * len(e.new_rows))})", list(e.new_rows))
                conn.execute(
                    "INSERT INTO documents(tenant, doc_id, version, live, source_modified_at, "
                    "ingested_at) VALUES (?,?,?,?,?,?) ON CONFLICT(tenant, doc_id) DO UPDATE SET "
                    "version=excluded.version, live=excluded.live, "
                    "source_modified_at=excluded.source_modified_at, ingested_at=excluded.ingested_at",
                    (e.tenant, e.doc_id, e.version, 1 if e.op == "upsert" else 0,
                     e.body.get("source_modified_at"), e.body.get("ingested_at")))
                conn.execute(
                    "INSERT INTO writes(log_seq, op, tenant, doc_id, version, body, chunks, vectors, "
                    "model_id) VALUES (?,?,?,?,?,?,?,?,?)",
                    (e.log_seq, e.op, e.tenant, e.doc_id, e.version, json.dumps(e.body),
                     json.dumps(e.chunks),
                     None if e.vectors is None else np.ascontiguousarray(e.vectors, np.float32).tobytes(),
                     e.model_id))
                out.append((dead, cur is not None and cur[1] == 1))
            if any(d is not None for d in out):
                conn.execute("INSERT INTO meta(key, value) VALUES ('index_version', '1') "
                             "ON CONFLICT(key) DO UPDATE SET value = CAST(value AS INTEGER) + 1")
            if applied_seq is not None:
                conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('applied_seq', ?)",
                             (str(applied_seq),))
            return out

        return self._transaction(run)

    def pending_tail(self) -> list[int]:
        """Recovery: the pending rows after the last settled row - a group whose flip a crash cut
        off. Deleted (`delete_rows_from`), so the next write numbers its rows as if that group had
        never run: replicas of a shard apply the same log from the same build, and rows are how a
        router fetches texts and vectors from any replica, so a crash must not shift one
        replica's rows against its siblings'."""
        conn = self._conn()
        settled = conn.execute(f"SELECT max(row) FROM chunks WHERE live != {PENDING}").fetchone()[0]
        return [r[0] for r in conn.execute(
            f"SELECT row FROM chunks WHERE live={PENDING} AND row > ? ORDER BY row",
            (-1 if settled is None else settled,))]

    def delete_rows_from(self, first: int) -> None:
        """Delete every row from `first` on (only ever a pending tail: see pending_tail)."""
        self._transaction(lambda conn: conn.execute(
            f"DELETE FROM chunks WHERE row >= ? AND live={PENDING}", (first,)))

    def orphan_pending(self) -> int:
        """Recovery: pending rows whose flip never happened and that later rows follow (a group
        that failed without a crash) become orphans (never served; compaction drops them)."""
        cur = self._conn().execute(f"UPDATE chunks SET live={ORPHAN} WHERE live={PENDING}")
        return cur.rowcount

    def unpurged(self) -> list[int]:
        return [r[0] for r in self._conn().execute(
            f"SELECT row FROM chunks WHERE live IN ({DEAD},{ORPHAN}) AND purged=0")]

    def mark_purged(self, rows: Sequence[int]) -> None:
        rows = list(rows)
        for start in range(0, len(rows), 900):  # SQLite's bound-parameter limit
            block = rows[start:start + 900]
            self._conn().execute(f"UPDATE chunks SET purged=1 WHERE row IN ({','.join('?' * len(block))})",
                                 block)

    def added_vectors(self, first_row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, chunk ids, vectors) of every row from `first_row` on, in row order."""
        rows, ids, vecs = [], [], []
        for row, cid, blob in self._conn().execute(
                "SELECT row, chunk_id, vector FROM chunks WHERE row >= ? ORDER BY row", (first_row,)):
            rows.append(row)
            ids.append(cid)
            vecs.append(np.frombuffer(blob, dtype=np.float32) if blob is not None else None)
        if any(v is None for v in vecs):
            raise IndexCorruptError(f"{self.path}: rows added after the build lack their vectors")
        dim = len(vecs[0]) if vecs else 0
        return (np.array(rows, np.int64), np.array(ids, np.int64),
                np.vstack(vecs) if vecs else np.zeros((0, dim), np.float32))

    def index_version(self) -> int:
        v = self.get_meta("index_version")
        return int(v) if v else 0

    def applied_seq(self) -> int:
        """The last write-log position applied (replicated writes; 0 in the embedded default)."""
        v = self.get_meta("applied_seq")
        return int(v) if v else 0

    def write_log(self, after_seq: int = 0, limit: int = 10_000) -> list[LoggedWrite]:
        """Writes logged after `after_seq` (this store's own numbering), in order."""
        out = []
        for s, ls, op, t, d, v, b, c, vec, m in self._conn().execute(
                "SELECT seq, log_seq, op, tenant, doc_id, version, body, chunks, vectors, model_id "
                "FROM writes WHERE seq > ? ORDER BY seq LIMIT ?", (after_seq, limit)):
            chunks = [tuple(x) for x in json.loads(c)]
            vectors = None
            if vec is not None:
                vectors = np.frombuffer(vec, dtype=np.float32).reshape(len(chunks), -1)
            out.append(LoggedWrite(s, ls, op, t, d, v, json.loads(b), chunks, vectors, m))
        return out

    def write_models(self) -> dict[str, int]:
        """Logged upserts that carry vectors, by the model that embedded them."""
        return dict(self._conn().execute(
            "SELECT model_id, count(*) FROM writes WHERE op != 'delete' AND vectors IS NOT NULL "
            "GROUP BY model_id"))

    def last_write_seq(self) -> int:
        return self._conn().execute("SELECT coalesce(max(seq), 0) FROM writes").fetchone()[0]

    def row_states(self) -> dict[str, int]:
        out = {n: 0 for n in STATE_NAMES.values()}
        for state, n in self._conn().execute("SELECT live, count(*) FROM chunks GROUP BY live"):
            out[STATE_NAMES[state]] = n
        return out

    def documents(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(tenant, doc_id) -> (version, live), tombstones included."""
        return {(t, d): (v, l) for t, d, v, l in self._conn().execute(
            "SELECT tenant, doc_id, version, live FROM documents")}

    def live_records(self) -> list[ChunkRecord]:
        """Every live chunk, in row order (compaction input)."""
        return [_record(r) for r in self._conn().execute(
            f"SELECT {_RECORD_COLUMNS} FROM chunks WHERE live=1 ORDER BY row")]

    def set_meta(self, key: str, value: str) -> None:
        self._conn().execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?,?)", (key, value))

    def get_meta(self, key: str) -> Optional[str]:
        row = self._conn().execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    # --- reads -------------------------------------------------------------------------------
    def counts(self, tenant: Optional[str] = None) -> dict:
        """Live chunks, documents and tenants; of one tenant only when `tenant` is given."""
        conn = self._conn()
        where, args = ("live=1 AND tenant=?", (tenant,)) if tenant is not None else ("live=1", ())
        chunks = conn.execute(f"SELECT count(*) FROM chunks WHERE {where}", args).fetchone()[0]
        docs = conn.execute("SELECT count(*) FROM (SELECT DISTINCT tenant, doc_id FROM chunks "
                            f"WHERE {where})", args).fetchone()[0]
        tenants = conn.execute(f"SELECT count(DISTINCT tenant) FROM chunks WHERE {where}",
                               args).fetchone()[0]
        return {"chunks": chunks, "documents": docs, "tenants": tenants}

    def live_digest(self) -> str:
        """sha256 over the live rows' (chunk id, tenant, document, version, text fingerprint), in
        chunk-id order: two replicas that applied the same writes have the same digest."""
        h = hashlib.sha256()
        for cid, t, d, v, th in self._conn().execute(
                "SELECT chunk_id, tenant, doc_id, version, text_hash FROM chunks WHERE live=1 "
                "ORDER BY chunk_id"):
            h.update(f"{cid}\x00{t}\x00{d}\x00{v}\x00{th}\n".encode())
        return h.hexdigest()

    def documents_per_tenant(self) -> dict[str, int]:
        """Live documents per tenant."""
        return dict(self._conn().execute(
            "SELECT tenant, count(DISTINCT doc_id) FROM chunks WHERE live=1 GROUP BY tenant").fetchall())

    def tenants(self) -> dict[str, int]:
        return dict(self._conn().execute(
            "SELECT tenant, count(*) FROM chunks WHERE live=1 GROUP BY tenant").fetchall())

    def restricted_acl_rows(self) -> dict[str, int]:
        """Per tenant, how many live rows are not tenant-public (their ACL needs a scope)."""
        return dict(self._conn().execute(
            "SELECT tenant, count(*) FROM chunks WHERE live=1 AND acl != ? GROUP BY tenant",
            (PUBLIC_ACL_JSON,)).fetchall())

    def restricted_acl_scopes(self) -> dict[str, set[str]]:
        """Per tenant, the scope names its live restricted rows carry."""
        out: dict[str, set[str]] = {}
        for tenant, acl in self._conn().execute(
                "SELECT DISTINCT tenant, acl FROM chunks WHERE live=1 AND acl != ?",
                (PUBLIC_ACL_JSON,)):
            out.setdefault(tenant, set()).update(a for a in json.loads(acl) if a != PUBLIC_ACL)
        return out

    def allowed_mask(self, nrows: int, tenant: Optional[str], filters: Sequence = (),
                     acl_scopes: Optional[Sequence[str]] = None, live_only: bool = True,
                     first_row: int = 0) -> np.ndarray:
        """Boolean mask over rows [first_row, nrows): owned by `tenant` (None = any), readable with
        `acl_scopes` (None = no ACL check), passing every filter (objects with key, any_of, gte,
        lte), and live unless live_only=False (rows never change but their liveness does, so the
        shard caches the rest and ANDs its in-memory live bitmap)."""
        where, args = ["row >= ?", "row < ?"], [first_row, nrows]
        if live_only:
            where.append("live=1")
        if tenant is not None:
            where.append("tenant=?")
            args.append(tenant)
        if acl_scopes is not None:
            scopes = sorted(set(acl_scopes) | {PUBLIC_ACL})
            where.append(f"EXISTS (SELECT 1 FROM json_each(chunks.acl) "
                         f"WHERE json_each.value IN ({','.join('?' * len(scopes))}))")
            args.extend(scopes)
        for f in filters:
            path = f"json_extract(metadata, '$.\"{check_filter_key(f.key)}\"')"
            if f.any_of:
                where.append(f"{path} IN ({','.join('?' * len(f.any_of))})")
                args.extend(f.any_of)
            if f.gte is not None:
                where.append(f"{path} >= ?")
                args.append(f.gte)
            if f.lte is not None:
                where.append(f"{path} <= ?")
                args.append(f.lte)
        rows = self._conn().execute(f"SELECT row FROM chunks WHERE {' AND '.join(where)}", args)
        mask = np.zeros(max(0, nrows - first_row), dtype=bool)
        idx = np.fromiter((r[0] for r in rows), dtype=np.int64)
        mask[idx - first_row] = True
        return mask

    def live_rows(self) -> np.ndarray:
        return np.fromiter((r[0] for r in self._conn().execute("SELECT row FROM chunks WHERE live=1")),
                           dtype=np.int64)

    def stored_bytes(self, rows: Sequence[int]) -> int:
        """The bytes the texts, titles, metadata and ACLs of these rows hold, read without
        reading them: what a fetch of them would build, known before it is built."""
        rows = [int(x) for x in rows]
        total = 0
        for start in range(0, len(rows), 900):
            block = rows[start:start + 900]
            (n,), = self._conn().execute(
                "SELECT coalesce(sum(length(CAST(text AS BLOB)) + length(CAST(title AS BLOB)) + "
                "length(CAST(metadata AS BLOB)) + length(CAST(acl AS BLOB))), 0) FROM chunks "
                f"WHERE row IN ({','.join('?' * len(block))})", block).fetchall()
            total += n
        return total

    def fetch(self, rows: Sequence[int]) -> dict[int, ChunkRecord]:
        """Records of the given rows that are live now (the final visibility check).

        On the search path, beside the event loop. Python's sqlite3 releases the GIL around every
        row step, so a row-by-row read waits to take the GIL back once per row, up to the
        interpreter's switch interval (5 ms) each time another thread is running Python: 70 rows
        cost 0.3 ms alone and 270 ms beside a busy thread. So SQLite packs the block into ONE JSON
        value (one step, one GIL hand-back) that one C call decodes; without SQLite's JSON
        functions the rows are read one by one."""
        out: dict[int, ChunkRecord] = {}
        rows = [int(x) for x in rows]
        conn = self._conn()
        for start in range(0, len(rows), 900):  # SQLite's bound-parameter limit
            block = rows[start:start + 900]
            marks = ",".join("?" * len(block))
            if _JSON_FETCH:
                try:
                    (packed,), = conn.execute(_PACKED_FETCH.format(marks), block).fetchall()
                except sqlite3.OperationalError as exc:
                    if "no such function" not in str(exc):
                        raise  # e.g. a corrupt metadata column: not a reason to change paths
                    _disable_json_fetch()  # an SQLite built without JSON functions
                else:
                    for r in json.loads(packed):
                        out[r[0]] = ChunkRecord(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8],
                                                r[9], tuple(r[10]), r[11])
                    continue
            q = f"SELECT {_RECORD_COLUMNS} FROM chunks WHERE live=1 AND row IN ({marks})"
            for r in conn.execute(q, block):
                out[r[0]] = _record(r)
        return out

    def seal(self) -> None:
        """A build's store once written: out of WAL mode (checkpointed, its -wal and -shm gone),
        so the build directory holds the one file a build records; a state's copy goes back to
        WAL when it is made (engine/state.py)."""
        self._conn().execute("PRAGMA journal_mode=DELETE")

    def close(self) -> None:
        with self._all_lock:
            conns, self._all = self._all, []
        for conn in conns:
            try:
                conn.close()
            except sqlite3.ProgrammingError:  # a connection of another thread: closed at its exit
                pass
        self._local = threading.local()
