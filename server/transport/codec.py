"""Conversions between protobuf messages and the core's plain types, in one place.

Vectors cross the shard port as raw float32 bytes (no per-element conversion). The same ShardWrite
encoding serves the shard port's ApplyWrites and the replicated write log's message bodies.
"""
from __future__ import annotations

import json
from typing import Optional

import numpy as np

from server.backends.docstore import ChunkRecord
from server.core import limits
from server.core.chunking import Chunk
from server.core.types import (Candidate, FetchRequest, Filter, SearchQuery, SearchResult,
                               ShardInfo, ShardQuery, ShardResult, ShardWrite, TermStats,
                               WriteOutcome, WriteRequest)
from server.errors import InvalidArgument, ResponseTooLarge
from server.rpc import search_pb2 as pb
from server.rpc import shard_pb2 as spb

MODE_NAMES = {pb.SEARCH_MODE_UNSPECIFIED: "", pb.DENSE: "dense", pb.LEXICAL: "lexical",
              pb.HYBRID: "hybrid"}
SCORE_KIND = {"cosine": pb.COSINE_SIMILARITY, "inner_product": pb.INNER_PRODUCT,
              "l2": pb.L2_DISTANCE, "bm25": pb.BM25, "rrf": pb.RRF, "cross_encoder": pb.CROSS_ENCODER,
              "minmax": pb.MIN_MAX_FUSED}
FUSIONS = {pb.FUSION_DEFAULT: "rrf", pb.FUSION_RRF: "rrf", pb.FUSION_MIN_MAX: "minmax"}


def _f32(data: bytes, what: str) -> Optional[np.ndarray]:
    if not data:
        return None
    if len(data) % 4:
        raise InvalidArgument(f"{what} is {len(data)} bytes, not a float32 array")
    return np.frombuffer(data, dtype="<f4")


def _vector(values, raw: bytes, what: str) -> np.ndarray:
    """A caller's vector, given as repeated floats or as raw little-endian float32 bytes (one of
    the two); a writable array of its own either way."""
    if not raw:
        return np.array(values, dtype=np.float32)
    if len(values):
        raise InvalidArgument(f"{what} is given twice (as floats and as float32 bytes): give one")
    return _f32(raw, what).astype(np.float32)


# --- public API --------------------------------------------------------------------------------
def query_from_pb(req: pb.SearchRequest) -> SearchQuery:
    mode = MODE_NAMES.get(req.mode)
    if mode is None:
        raise InvalidArgument(f"unknown search mode value {req.mode}")
    vector, model_id = None, ""
    if req.HasField("vector"):
        vector = _vector(req.vector.values, req.vector.values_f32, "the query vector")
        model_id = req.vector.model_id
    return SearchQuery(
        collection=req.collection, text=req.text, vector=vector, vector_model_id=model_id,
        top_k=req.top_k, mode=mode,
        filters=tuple(Filter(f.key, tuple(f.any_of), f.gte or None, f.lte or None)
                      for f in req.filters),
        include_trace=req.include_trace, dense_depth=req.dense_depth,
        lexical_depth=req.lexical_depth, rrf_k=req.rrf_k, rerank_depth=req.rerank_depth,
        context_token_budget=req.context_token_budget, allow_partial=req.allow_partial,
        min_applied_sequence=req.min_applied_sequence,
        feedback_docs=req.feedback_docs if req.HasField("feedback_docs") else None,
        feedback_weight=req.feedback_weight if req.HasField("feedback_weight") else None,
        lexical_feedback_terms=(req.lexical_feedback_terms if req.HasField("lexical_feedback_terms")
                                else None),
        dense_weight=req.dense_weight if req.HasField("dense_weight") else None,
        fusion=_fusion(req.fusion))


def _fusion(value: int) -> str:
    if value not in FUSIONS:
        raise InvalidArgument(f"unknown fusion method value {value}")
    return FUSIONS[value]


def _retriever(pair, kind) -> Optional[pb.RetrieverScore]:
    if pair is None:
        return None
    return pb.RetrieverScore(rank=pair[0], score=pair[1], kind=kind)


# What a response's parts may take, over-counted (a budget's bound, not a size): a hit's numbers,
# kinds and field tags; an answer's ids, flags, timings and notes; a trace entry
HIT_BYTES, ANSWER_BYTES, TRACE_ITEM_BYTES = 128, 1024, 96


def _fixed_bytes(rec: ChunkRecord) -> int:
    """What a hit with this record takes without its text, title and metadata (an upper bound):
    its numbers, ids, tenant and ACL scopes, four bytes a character."""
    return HIT_BYTES + 4 * (len(rec.doc_id) + len(rec.tenant) + sum(map(len, rec.acl))
                            + 2 * len(rec.acl))


def record_bytes(rec: ChunkRecord) -> int:
    """What a hit with this record may take in a message (an upper bound): its text's UTF-8
    bytes (exact and O(1) for ASCII), other strings four bytes a character, its numbers; counted
    once per record (`nbytes`)."""
    n = rec.nbytes
    if n < 0:
        text = rec.text or ""
        n = (_fixed_bytes(rec) + 4 * len(rec.title)
             + (len(text) if text.isascii() else len(text.encode("utf-8", "replace"))))
        if rec.metadata:
            n += 4 * sum(len(str(k)) + len(str(v)) + 2 for k, v in rec.metadata.items())
        rec.nbytes = n
    return n


class TextBudget:
    """The room one shard message has for hit texts: a hit past it travels without its record
    (row, chunk id and text fingerprint, as a page's tail does), for the router to fetch if its
    answer shows it. Before, a shard built every text of a batch (128 queries x 10 texts of up
    to a million characters) into one message that gRPC then refused (outside QA)."""

    def __init__(self, room: int):
        self.left = room

    def take(self, rec: ChunkRecord) -> bool:
        n = record_bytes(rec)  # its fixed part too, counted already: an over-count
        if n > self.left:
            return False
        self.left -= n
        return True


def shard_texts_budget(results: list[ShardResult], room: int) -> Optional[TextBudget]:
    """The room for hit texts in one shard message of these results: None when every hit fits
    with its text (the common case), else what the hits' fixed parts (ids, tenant, ACL scopes,
    vectors) leave. Raises ResponseTooLarge when those alone do not fit (deep pages of a large
    batch), rather than build a message gRPC refuses."""
    hits = [c for r in results for part in (r.dense, r.lexical) for c in part]
    vectors = sum(4 * len(c.vector) + 8 for c in hits if c.vector is not None)
    if vectors + sum(record_bytes(c.record) for c in hits) <= room:
        return None
    fixed = vectors + sum(_fixed_bytes(c.record) for c in hits)
    if fixed > room:
        raise ResponseTooLarge(
            f"the {len(hits)} hits of this message take more than {fixed / 2**20:.1f} MiB "
            f"without their texts, {limits.OVER_THE_RESPONSE_LIMIT}: send fewer queries per "
            f"message, or shallower")
    return TextBudget(room - fixed)


class AnswerTooLarge(Exception):
    """The answer would take more than the room it was given (`spent`: at least this much)."""

    def __init__(self, spent: int):
        super().__init__(spent)
        self.spent = spent


def result_to_pb(res: SearchResult, dense_kind: int,
                 out: Optional[pb.SearchResponse] = None) -> pb.SearchResponse:
    """The response message; `out` (an empty one) is filled in place: a SearchBatch writes each
    answer into its own slot instead of copying a finished message there."""
    if out is None:
        out = pb.SearchResponse()
    write_answer(res, dense_kind, out)
    return out


def write_answer(res: SearchResult, dense_kind: int, out: pb.SearchResponse,
                 room: Optional[int] = None) -> int:
    """Write the answer into `out`; returns the bytes it may take (an upper bound). Raises
    AnswerTooLarge, with `out` part-written, as soon as that passes `room`: hit texts up to a
    million characters and pages of 1,000 hits make answers of a gigabyte, which were built
    whole before gRPC refused to send them (outside QA). Texts count their UTF-8 bytes (exact
    and O(1) for ASCII), short strings four bytes a character. `room`: limits.ANSWERS_BUDGET_BYTES
    unless given."""
    if room is None:
        room = limits.ANSWERS_BUDGET_BYTES
    out.build_id, out.corpus_version, out.model_id = res.build_id, res.corpus_version, res.model_id
    out.partial, out.context_tokens = res.partial, res.context_tokens
    out.shard_errors.extend(res.shard_errors)
    spent = ANSWER_BYTES + (4 * sum(map(len, res.shard_errors)) if res.shard_errors else 0)
    hits = out.hits
    for h in res.hits:
        rec = h.candidate.record
        n = rec.nbytes  # record_bytes(rec), inline: this loop runs once a hit
        spent += n if n >= 0 else record_bytes(rec)
        if spent > room:
            raise AnswerTooLarge(spent)
        hit = hits.add(chunk_id=rec.chunk_id, doc_id=rec.doc_id, score=h.score,
                       score_kind=SCORE_KIND[h.score_kind], higher_is_better=True,
                       text=rec.text, title=rec.title, chunk_index=rec.chunk_index,
                       start_offset=rec.start_offset, end_offset=rec.end_offset,
                       shard=h.candidate.shard)
        if rec.metadata:
            hit.metadata.update({str(k): str(v) for k, v in rec.metadata.items()})
        # each `hit.dense` read makes a new wrapper object: take each submessage once
        if h.dense is not None:
            m = hit.dense
            m.rank, m.score, m.kind = h.dense[0], h.dense[1], dense_kind
        if h.lexical is not None:
            m = hit.lexical
            m.rank, m.score, m.kind = h.lexical[0], h.lexical[1], pb.BM25
        if h.fused is not None:
            m = hit.fused
            m.rank, m.score, m.kind = h.fused[0], h.fused[1], SCORE_KIND[h.fused_kind]
        if h.rerank is not None:
            m = hit.rerank
            m.rank, m.score, m.kind = h.rerank[0], h.rerank[1], pb.CROSS_ENCODER
    for stage, ms in res.timings.items():
        out.timings.add(stage=stage, ms=ms)
    if res.trace is not None:
        spent += sum(TRACE_ITEM_BYTES + 4 * len(e.reason) for entries in res.trace.values()
                     for e in entries) + 4 * sum(len(n) for n in res.notes)
        if spent > room:
            raise AnswerTooLarge(spent)
        for name, entries in res.trace.items():
            out.trace.lists.append(pb.TraceList(name=name, items=[
                pb.TraceItem(chunk_id=e.chunk_id, doc_id=e.doc_id, score=e.score, rank=e.rank,
                             reason=e.reason) for e in entries]))
        out.trace.notes.extend(res.notes)
    return spent


def write_from_pb(req, op: str) -> WriteRequest:
    if op == "delete":
        return WriteRequest("delete", req.collection, req.doc_id, req.version)
    chunks = tuple((c.text, _vector(c.vector, c.vector_f32, f"chunk {i}'s vector")
                    if len(c.vector) or c.vector_f32 else None)
                   for i, c in enumerate(req.chunks))
    return WriteRequest("upsert", req.collection, req.doc_id, req.version, req.text, req.title,
                        dict(req.metadata), tuple(req.acl), req.source_modified_at, chunks,
                        req.vector_model_id)


# --- shard port --------------------------------------------------------------------------------
def shard_query_to_pb(q: ShardQuery) -> spb.ShardQuery:
    return spb.ShardQuery(
        build_id=q.build_id, tenant=q.tenant, model_id=q.model_id, text=q.text,
        vector=q.vector.astype("<f4").tobytes() if q.vector is not None else b"",
        dense_depth=q.dense_depth, lexical_depth=q.lexical_depth, acl_scopes=list(q.acl_scopes),
        text_top_n=q.text_top_n, min_applied_seq=q.min_applied_seq,
        expansion=[spb.WeightedTerm(term=t, weight=w) for t, w in q.expansion],
        filters=[spb.ShardFilter(key=f.key, any_of=list(f.any_of), gte=f.gte or "", lte=f.lte or "")
                 for f in q.filters],
        stats_only=q.stats_only, term_stats=term_stats_to_pb(q.term_stats))


def shard_query_from_pb(r: spb.ShardQuery) -> ShardQuery:
    return ShardQuery(r.build_id, r.tenant, _f32(r.vector, "the query vector"), r.model_id, r.text,
                      r.dense_depth, r.lexical_depth,
                      tuple(Filter(f.key, tuple(f.any_of), f.gte or None, f.lte or None)
                            for f in r.filters), tuple(r.acl_scopes), r.text_top_n, r.min_applied_seq,
                      tuple((e.term, e.weight) for e in r.expansion), stats_only=r.stats_only,
                      term_stats=term_stats_from_pb(r.term_stats) if r.HasField("term_stats") else None)


def term_stats_to_pb(stats: Optional[TermStats]) -> Optional[spb.TermStats]:
    if stats is None:
        return None
    return spb.TermStats(docs=stats.docs, terms=[spb.TermDocs(term=t, text_docs=a, title_docs=b)
                                                 for t, a, b in stats.df])


def term_stats_from_pb(p: spb.TermStats) -> TermStats:
    return TermStats(p.docs, tuple((t.term, t.text_docs, t.title_docs) for t in p.terms))


def hit_to_pb(c: Candidate, with_text: bool = True) -> spb.ShardHit:
    r = c.record
    with_text = with_text and r.text is not None
    hit = spb.ShardHit(chunk_id=r.chunk_id, score=c.score, doc_id=r.doc_id, acl=list(r.acl),
                       chunk_index=r.chunk_index, start_offset=r.start_offset,
                       end_offset=r.end_offset, tenant=r.tenant, has_text=with_text,
                       row=max(r.row, 0), text_hash=r.text_hash)
    if with_text:
        hit.text, hit.title = r.text, r.title
        if r.metadata:
            hit.metadata.update({str(k): str(v) for k, v in r.metadata.items()})
    if c.vector is not None:
        hit.vector = np.asarray(c.vector, "<f4").tobytes()
    return hit


def hit_from_pb(h: spb.ShardHit, shard: int) -> Candidate:
    return Candidate(h.chunk_id, h.score,
                     ChunkRecord(h.row, h.chunk_id, h.doc_id, h.chunk_index, h.start_offset,
                                 h.end_offset, h.title, h.text if h.has_text else None, h.tenant,
                                 dict(h.metadata), tuple(h.acl), h.text_hash),
                     shard, _f32(h.vector, "a chunk vector"))


def shard_result_to_pb(res: ShardResult, text_top_n: int = 0,
                       texts: Optional[TextBudget] = None) -> spb.ShardQueryResult:
    """`texts`: the message's room for hit texts (TextBudget), shared by its results."""
    def hits(cands):
        return [hit_to_pb(c, (not text_top_n or i < text_top_n)
                          and (texts is None or c.record.text is None or texts.take(c.record)))
                for i, c in enumerate(cands)]

    return spb.ShardQueryResult(dense=hits(res.dense), lexical=hits(res.lexical),
                                corpus_version=res.corpus_version, shard=res.shard,
                                dense_ms=res.dense_ms, lexical_ms=res.lexical_ms,
                                index_version=res.index_version, applied_seq=res.applied_seq,
                                batch_size=res.batch_size,
                                term_stats=term_stats_to_pb(res.term_stats))


def shard_result_from_pb(p: spb.ShardQueryResult) -> ShardResult:
    return ShardResult(p.shard, p.corpus_version, [hit_from_pb(h, p.shard) for h in p.dense],
                       [hit_from_pb(h, p.shard) for h in p.lexical], p.dense_ms, p.lexical_ms,
                       p.index_version, p.applied_seq, p.batch_size,
                       term_stats=term_stats_from_pb(p.term_stats) if p.HasField("term_stats") else None)


def fetch_to_pb(req: FetchRequest) -> spb.FetchChunksRequest:
    return spb.FetchChunksRequest(build_id=req.build_id, tenant=req.tenant,
                                  acl_scopes=list(req.acl_scopes), rows=list(req.rows),
                                  with_vectors=req.with_vectors)


def fetch_from_pb(r: spb.FetchChunksRequest) -> FetchRequest:
    return FetchRequest(r.build_id, r.tenant, tuple(r.acl_scopes), tuple(r.rows), r.with_vectors)


def shard_write_to_pb(w: ShardWrite, collection: str = "", model_id: str = "") -> spb.ShardWrite:
    vectors = b"" if w.vectors is None else np.ascontiguousarray(w.vectors, "<f4").tobytes()
    return spb.ShardWrite(op=w.op, tenant=w.tenant, doc_id=w.doc_id, version=w.version,
                          body_json=json.dumps(w.body),
                          chunks=[spb.ShardChunk(index=c.index, start=c.start, end=c.end, text=c.text)
                                  for c in w.chunks],
                          vectors=vectors, dim=0 if w.vectors is None else int(w.vectors.shape[1]),
                          seq=w.seq, collection=collection, model_id=model_id)


def shard_write_from_pb(m: spb.ShardWrite, seq: Optional[int] = None) -> ShardWrite:
    try:
        body = json.loads(m.body_json) if m.body_json else {}
    except ValueError as exc:
        raise InvalidArgument(f"write body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidArgument("write body must be a JSON object")
    chunks = tuple(Chunk(c.index, c.start, c.end, c.text) for c in m.chunks)
    vectors = None
    if m.vectors:
        flat = _f32(m.vectors, "write vectors")
        if not m.dim or flat.size != m.dim * len(chunks):
            raise InvalidArgument(f"write vectors hold {flat.size} floats for {len(chunks)} chunks "
                                  f"of dimension {m.dim}")
        vectors = flat.reshape(len(chunks), m.dim)
    return ShardWrite(m.op, m.tenant, m.doc_id, m.version, body, chunks, vectors,
                      m.seq if seq is None else seq)


def outcome_to_pb(o: WriteOutcome) -> spb.WriteOutcome:
    return spb.WriteOutcome(outcome=o.outcome, stored_version=o.stored_version,
                            index_version=o.index_version, seq=o.seq)


def outcome_from_pb(o: spb.WriteOutcome) -> WriteOutcome:
    return WriteOutcome(o.outcome, o.stored_version, o.index_version, o.seq)


def info_to_pb(i: ShardInfo) -> spb.ShardInfoResponse:
    return spb.ShardInfoResponse(collection=i.collection, build_id=i.build_id, shard=i.shard_no,
                                 corpus_version=i.corpus_version, model_id=i.model_id,
                                 chunks=i.chunks, descriptor_json=i.descriptor_json,
                                 index_version=i.index_version, applied_seq=i.applied_seq,
                                 documents=i.documents, vectors=i.vectors, live_digest=i.live_digest,
                                 state=i.state, tombstone_ratio=i.tombstone_ratio,
                                 also_serves=i.also_serves)


def info_from_pb(r: spb.ShardInfoResponse, address: str = "") -> ShardInfo:
    return ShardInfo(r.shard, r.collection, r.build_id, r.corpus_version, r.model_id,
                     r.index_version, r.applied_seq, r.documents, r.chunks, r.vectors,
                     r.descriptor_json, r.live_digest, r.state or "serving", r.tombstone_ratio, address,
                     also_serves=tuple(r.also_serves))
