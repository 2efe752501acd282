"""The shard's chunk store in SQLite (WAL): text, offsets, tenant, ACL, metadata and liveness per row.

It is the authority for which rows are visible: the dense branch searches only rows whose bit is set
in a mask computed here (live, tenant, ACL scopes, metadata filters), and every hit is re-checked
against it. A chunk's ACL is a list of scopes; PUBLIC_ACL marks a chunk every caller of its tenant
may read. A caller sees a chunk when the ACL shares a scope with the caller's scopes + PUBLIC_ACL.
"""
from __future__ import annotations

import json
import re
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from server.errors import FailedPrecondition, IndexCorruptError, InvalidArgument

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
-- every applied write, in order: replayed into a new build before its alias flip
CREATE TABLE IF NOT EXISTS writes (
    seq     INTEGER PRIMARY KEY AUTOINCREMENT,
    op      TEXT NOT NULL,                -- upsert | delete
    tenant  TEXT NOT NULL,
    doc_id  TEXT NOT NULL,
    version INTEGER NOT NULL,
    body    TEXT NOT NULL                 -- JSON: tenant, title, text, metadata, acl, times
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

PENDING, LIVE, DEAD, ORPHAN = 0, 1, 2, 3
SCHEMA_VERSION = "2"  # 2: documents keyed by (tenant, doc_id)

FILTER_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
PUBLIC_ACL = "@all"


@dataclass(frozen=True)
class ChunkRecord:
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


def check_filter_key(key: str) -> str:
    if not FILTER_KEY.match(key):
        raise InvalidArgument(f"filter key {key[:80]!r} must match {FILTER_KEY.pattern}")
    return key


class DocStore:
    def __init__(self, path: Path, create: bool = False):
        self.path = path
        if not create and not path.is_file():
            raise IndexCorruptError(f"missing document store {path}")
        self._local = threading.local()
        conn = self._conn()
        if create:
            conn.executescript(SCHEMA)
            self.set_meta("schema_version", SCHEMA_VERSION)
        else:
            try:
                conn.execute("SELECT count(*) FROM chunks").fetchone()
                version = self.get_meta("schema_version")
            except sqlite3.DatabaseError as exc:
                raise IndexCorruptError(f"document store {path} is unreadable: {exc}") from exc
            if version != SCHEMA_VERSION:
                raise FailedPrecondition(
                    f"document store {path} has schema {version or '1'}; this release reads "
                    f"schema {SCHEMA_VERSION} (documents keyed by tenant and id): rebuild the "
                    "collection with index-builder build")

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(str(self.path), timeout=30, isolation_level=None,
                                   check_same_thread=True)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            self._local.conn = conn
        return conn

    # --- writes (builder) --------------------------------------------------------------------
    def insert_chunks(self, records: Iterable[ChunkRecord]) -> None:
        conn = self._conn()
        conn.execute("BEGIN")
        try:
            conn.executemany(
                "INSERT INTO chunks(row, chunk_id, doc_id, chunk_index, start_offset, end_offset, "
                "title, text, tenant, acl, metadata, live) VALUES (?,?,?,?,?,?,?,?,?,?,?,1)",
                [(r.row, r.chunk_id, r.doc_id, r.chunk_index, r.start_offset, r.end_offset, r.title,
                  r.text, r.tenant, json.dumps(sorted(r.acl)), json.dumps(r.metadata, sort_keys=True))
                 for r in records])
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    # --- streaming writes (server/core/shards.py LocalShard.apply_write) ----------------------
    def document(self, tenant: str, doc_id: str) -> Optional[tuple[int, int]]:
        """(version, live) of a tenant's document, tombstones included; None if never seen."""
        return self._conn().execute("SELECT version, live FROM documents WHERE tenant=? AND doc_id=?",
                                    (tenant, doc_id)).fetchone()

    def next_row(self) -> int:
        return (self._conn().execute("SELECT max(row) FROM chunks").fetchone()[0] or -1) + 1

    def insert_pending(self, records: Sequence[ChunkRecord], version: int,
                       vectors: np.ndarray) -> None:
        """Write a new version's chunks, invisible (pending), with their vectors: durable first."""
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(
                "INSERT INTO chunks(row, chunk_id, version, doc_id, chunk_index, start_offset, "
                "end_offset, title, text, tenant, acl, metadata, live, vector) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,0,?)",
                [(r.row, r.chunk_id, version, r.doc_id, r.chunk_index, r.start_offset, r.end_offset,
                  r.title, r.text, r.tenant, json.dumps(sorted(r.acl)),
                  json.dumps(r.metadata, sort_keys=True),
                  np.ascontiguousarray(v, dtype=np.float32).tobytes())
                 for r, v in zip(records, vectors)])
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def flip(self, op: str, tenant: str, doc_id: str, version: int, new_rows: Sequence[int],
             body: dict) -> Optional[list[int]]:
        """THE visibility change, one transaction: the document's live rows die, `new_rows` go
        live, the document's version moves, the write is logged and index_version moves.
        Returns the rows that died, or None when `version` is not newer than the stored one."""
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            cur = conn.execute("SELECT version FROM documents WHERE tenant=? AND doc_id=?",
                               (tenant, doc_id)).fetchone()
            if cur is not None and cur[0] >= version:
                conn.execute("ROLLBACK")
                return None
            dead = [r[0] for r in conn.execute(
                "SELECT row FROM chunks WHERE tenant=? AND doc_id=? AND live=1", (tenant, doc_id))]
            conn.execute(f"UPDATE chunks SET live={DEAD} WHERE tenant=? AND doc_id=? AND live=1",
                         (tenant, doc_id))
            if new_rows:
                conn.execute(f"UPDATE chunks SET live={LIVE} WHERE row IN "
                             f"({','.join('?' * len(new_rows))})", list(new_rows))
            conn.execute("INSERT INTO documents(tenant, doc_id, version, live, source_modified_at, "
                         "ingested_at) VALUES (?,?,?,?,?,?) ON CONFLICT(tenant, doc_id) DO UPDATE SET "
                         "version=excluded.version, live=excluded.live, "
                         "source_modified_at=excluded.source_modified_at, "
                         "ingested_at=excluded.ingested_at",
                         (tenant, doc_id, version, 1 if op == "upsert" else 0,
                          body.get("source_modified_at"), body.get("ingested_at")))
            conn.execute("INSERT INTO writes(op, tenant, doc_id, version, body) VALUES (?,?,?,?,?)",
                         (op, tenant, doc_id, version, json.dumps(body)))
            conn.execute("INSERT INTO meta(key, value) VALUES ('index_version', '1') "
                         "ON CONFLICT(key) DO UPDATE SET value = CAST(value AS INTEGER) + 1")
            conn.execute("COMMIT")
            return dead
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def orphan_pending(self) -> int:
        """Recovery: pending rows whose flip never happened become orphans (never served)."""
        cur = self._conn().execute(f"UPDATE chunks SET live={ORPHAN} WHERE live={PENDING}")
        return cur.rowcount

    def unpurged(self) -> list[int]:
        return [r[0] for r in self._conn().execute(
            f"SELECT row FROM chunks WHERE live IN ({DEAD},{ORPHAN}) AND purged=0")]

    def mark_purged(self, rows: Sequence[int]) -> None:
        if rows:
            self._conn().execute(f"UPDATE chunks SET purged=1 WHERE row IN ({','.join('?' * len(rows))})",
                                 list(rows))

    def added_vectors(self, first_row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, chunk ids, vectors) of every row from `first_row` on, in row order."""
        rows, ids, vecs = [], [], []
        for row, cid, blob in self._conn().execute(
                "SELECT row, chunk_id, vector FROM chunks WHERE row >= ? ORDER BY row", (first_row,)):
            rows.append(row)
            ids.append(cid)
            vecs.append(np.frombuffer(blob, dtype=np.float32))
        dim = len(vecs[0]) if vecs else 0
        return (np.array(rows, np.int64), np.array(ids, np.int64),
                np.vstack(vecs) if vecs else np.zeros((0, dim), np.float32))

    def index_version(self) -> int:
        v = self.get_meta("index_version")
        return int(v) if v else 0

    def write_log(self, after_seq: int = 0) -> list[tuple[int, str, str, str, int, dict]]:
        """(seq, op, tenant, doc_id, version, body) of every write after `after_seq`, in order."""
        return [(s, op, t, d, v, json.loads(b)) for s, op, t, d, v, b in self._conn().execute(
            "SELECT seq, op, tenant, doc_id, version, body FROM writes WHERE seq > ? ORDER BY seq",
            (after_seq,))]

    def row_states(self) -> dict[str, int]:
        names = {PENDING: "pending", LIVE: "live", DEAD: "dead", ORPHAN: "orphan"}
        out = {n: 0 for n in names.values()}
        for state, n in self._conn().execute("SELECT live, count(*) FROM chunks GROUP BY live"):
            out[names[state]] = n
        return out

    def insert_documents(self, docs: Iterable[tuple[str, str, int, int]]) -> None:
        """(tenant, doc_id, version, live) rows; live=0 keeps a deletion's tombstone."""
        conn = self._conn()
        conn.execute("BEGIN")
        conn.executemany("INSERT OR REPLACE INTO documents(tenant, doc_id, version, live) "
                         "VALUES (?,?,?,?)", list(docs))
        conn.execute("COMMIT")

    def documents(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(tenant, doc_id) -> (version, live), tombstones included."""
        return {(t, d): (v, l) for t, d, v, l in self._conn().execute(
            "SELECT tenant, doc_id, version, live FROM documents")}

    def live_records(self) -> list[ChunkRecord]:
        """Every live chunk, in row order (compaction input)."""
        out = []
        for r in self._conn().execute(
                "SELECT row, chunk_id, doc_id, chunk_index, start_offset, end_offset, title, text, "
                "tenant, metadata, acl FROM chunks WHERE live=1 ORDER BY row"):
            out.append(ChunkRecord(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8],
                                   json.loads(r[9]), tuple(json.loads(r[10]))))
        return out

    def last_write_seq(self) -> int:
        return self._conn().execute("SELECT coalesce(max(seq), 0) FROM writes").fetchone()[0]

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

    def tenants(self) -> dict[str, int]:
        return dict(self._conn().execute(
            "SELECT tenant, count(*) FROM chunks WHERE live=1 GROUP BY tenant").fetchall())

    def restricted_acl_rows(self) -> dict[str, int]:
        """Per tenant, how many live rows are not tenant-public (their ACL needs a scope)."""
        return dict(self._conn().execute(
            "SELECT tenant, count(*) FROM chunks WHERE live=1 AND acl != ? GROUP BY tenant",
            (json.dumps([PUBLIC_ACL]),)).fetchall())

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
        mask = np.zeros(nrows - first_row, dtype=bool)
        idx = np.fromiter((r[0] for r in rows), dtype=np.int64)
        mask[idx - first_row] = True
        return mask

    def live_rows(self) -> np.ndarray:
        return np.fromiter((r[0] for r in self._conn().execute("SELECT row FROM chunks WHERE live=1")),
                           dtype=np.int64)

    def fetch(self, rows: Sequence[int]) -> dict[int, ChunkRecord]:
        """Records of the given rows that are live now (the final visibility check)."""
        if not rows:
            return {}
        out = {}
        q = ("SELECT row, chunk_id, doc_id, chunk_index, start_offset, end_offset, title, text, "
             f"tenant, metadata, acl FROM chunks WHERE live=1 AND row IN ({','.join('?' * len(rows))})")
        for r in self._conn().execute(q, [int(x) for x in rows]):
            out[r[0]] = ChunkRecord(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8],
                                    json.loads(r[9]), tuple(json.loads(r[10])))
        return out

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
