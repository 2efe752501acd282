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

from server.errors import IndexCorruptError, InvalidArgument

SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (
    row          INTEGER PRIMARY KEY,      -- the dense index row (faiss sequential id)
    chunk_id     INTEGER NOT NULL UNIQUE,  -- deterministic hash of (doc_id, chunk_index)
    doc_id       TEXT    NOT NULL,
    chunk_index  INTEGER NOT NULL,
    start_offset INTEGER NOT NULL,
    end_offset   INTEGER NOT NULL,
    title        TEXT    NOT NULL DEFAULT '',
    text         TEXT    NOT NULL,
    tenant       TEXT    NOT NULL,
    acl          TEXT    NOT NULL DEFAULT '["@all"]',  -- JSON list of scopes
    metadata     TEXT    NOT NULL DEFAULT '{}',
    live         INTEGER NOT NULL DEFAULT 1
);
CREATE INDEX IF NOT EXISTS chunks_doc ON chunks(doc_id);
CREATE INDEX IF NOT EXISTS chunks_tenant ON chunks(tenant, live);
CREATE TABLE IF NOT EXISTS documents (
    doc_id  TEXT PRIMARY KEY,
    version INTEGER NOT NULL,
    tenant  TEXT NOT NULL,
    live    INTEGER NOT NULL DEFAULT 1
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

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
        else:
            try:
                conn.execute("SELECT count(*) FROM chunks").fetchone()
            except sqlite3.DatabaseError as exc:
                raise IndexCorruptError(f"document store {path} is unreadable: {exc}") from exc

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

    def insert_documents(self, docs: Iterable[tuple[str, int, str]]) -> None:
        conn = self._conn()
        conn.execute("BEGIN")
        conn.executemany("INSERT OR REPLACE INTO documents(doc_id, version, tenant, live) "
                         "VALUES (?,?,?,1)", list(docs))
        conn.execute("COMMIT")

    def set_meta(self, key: str, value: str) -> None:
        self._conn().execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?,?)", (key, value))

    def get_meta(self, key: str) -> Optional[str]:
        row = self._conn().execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    # --- reads -------------------------------------------------------------------------------
    def counts(self) -> dict:
        conn = self._conn()
        chunks = conn.execute("SELECT count(*) FROM chunks WHERE live=1").fetchone()[0]
        docs = conn.execute("SELECT count(*) FROM documents WHERE live=1").fetchone()[0]
        tenants = conn.execute("SELECT count(DISTINCT tenant) FROM chunks WHERE live=1").fetchone()[0]
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
                     acl_scopes: Optional[Sequence[str]] = None) -> np.ndarray:
        """Boolean mask over rows: live, owned by `tenant` (None = any), readable with `acl_scopes`
        (None = no ACL check), passing every filter (objects with key, any_of, gte, lte)."""
        where, args = ["live=1"], []
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
        mask = np.zeros(nrows, dtype=bool)
        idx = np.fromiter((r[0] for r in rows), dtype=np.int64)
        mask[idx[idx < nrows]] = True
        return mask

    def fetch(self, rows: Sequence[int]) -> dict[int, ChunkRecord]:
        if not rows:
            return {}
        out = {}
        q = ("SELECT row, chunk_id, doc_id, chunk_index, start_offset, end_offset, title, text, "
             f"tenant, metadata, acl FROM chunks WHERE row IN ({','.join('?' * len(rows))})")
        for r in self._conn().execute(q, [int(x) for x in rows]):
            out[r[0]] = ChunkRecord(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8],
                                    json.loads(r[9]), tuple(json.loads(r[10])))
        return out

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
