"""The models of a front end: query and passage embedding, and cross-encoder scoring, each behind
its micro-batcher (server/core/batcher.py), with the query-embedding cache in front.

Nothing here tokenizes on the event loop: a batch's cost is estimated from the text length, and
the exact token count (for the "query was truncated" note) is taken on the model's device thread,
only for texts long enough to be truncated at all.
"""
from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from typing import Optional, Sequence

import numpy as np

from server.config import ModelConfig
from server.core import metrics
from server.core.batcher import MicroBatcher
from server.core.collection import ReleaseDescriptor
from server.errors import FailedPrecondition


class Encoders:
    def __init__(self, embedder=None, reranker=None, config: ModelConfig = ModelConfig(),
                 cuda: bool = False):
        self.embedder = embedder
        self.reranker = reranker
        self.config = config
        max_batch = config.max_batch(cuda)
        self.embed_batcher = (MicroBatcher("embed", self._encode, max_batch, config.embed_max_tokens,
                                           config.batch_max_wait_ms) if embedder is not None else None)
        self.rerank_batcher = (MicroBatcher("rerank", reranker.score, max_batch,
                                            config.rerank_max_tokens, config.batch_max_wait_ms)
                               if reranker is not None else None)
        # (vector, token count when the text may have been truncated): a cached answer says
        # what the first did
        self._cache: OrderedDict[tuple, tuple[np.ndarray, Optional[int]]] = OrderedDict()

    @property
    def model_id(self) -> Optional[str]:
        return self.embedder.model_id if self.embedder is not None else None

    def can_embed(self, desc: ReleaseDescriptor) -> bool:
        return self.embedder is not None and self.embedder.model_id == desc.model_id

    def check_model(self, desc: ReleaseDescriptor, writing: bool = False) -> None:
        """Whether this server can embed for `desc`; else what the caller should send instead
        (`writing`: a document's chunks with their vectors, not a query vector)."""
        send = ("chunks with their vectors and vector_model_id" if writing
                else "a query vector with its model id")
        if self.embedder is None:
            raise FailedPrecondition(f"this server has no embedder; collection {desc.collection!r} "
                                     f"takes vectors of {desc.model_id!r} (send {send})")
        if self.embedder.model_id != desc.model_id:
            raise FailedPrecondition(f"the server's embedder {self.embedder.model_id!r} cannot embed "
                                     f"for build {desc.build_id} ({desc.model_id!r}); send {send} "
                                     "of that model")

    def _estimate(self, text: str) -> int:
        """Tokens, roughly (a word piece spans >= 1 character), for batch sizing only."""
        return min(len(text) // 3 + 2, self.embedder.max_length)

    def _encode(self, texts: Sequence[str]) -> list[tuple[np.ndarray, Optional[int]]]:
        """On the device thread: vectors, and exact token counts of texts that may be truncated."""
        vectors = self.embedder.encode(texts)
        limit = self.embedder.max_length
        long = [i for i, t in enumerate(texts) if len(t) + 2 > limit]
        counts: list[Optional[int]] = [None] * len(texts)
        if long:
            for i, n in zip(long, self.embedder.count_tokens([texts[i] for i in long])):
                counts[i] = n
        return list(zip(vectors, counts))

    async def embed(self, text: str, desc: ReleaseDescriptor, deadline: Optional[float] = None,
                    notes: Optional[list[str]] = None, flow: object = None, *,
                    partition: tuple) -> np.ndarray:
        """A query's vector, through the cache and the micro-batcher; `flow`: the request it is
        part of (batcher.py). The cache's key is the model id, `partition` - the caller's tenant
        and ACL scopes - and sha256 of the text: a hit is ~1,000x faster than a miss, and the
        request's timings show it, so a cache shared by tenants let one confirm another's query
        texts by guessing them (outside QA). Passages being written never enter it
        (`embed_many`): their texts would be confirmable the same way."""
        self.check_model(desc)
        key = (self.embedder.model_id, partition, hashlib.sha256(text.encode()).hexdigest())
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            metrics.labelled(metrics.EMBED_CACHE, "hit").inc()
            vec, tokens = cached
        else:
            metrics.labelled(metrics.EMBED_CACHE, "miss").inc()
            vec, tokens = await self.embed_batcher.submit(text, self._estimate(text), deadline,
                                                          False, flow)
        if tokens is not None and tokens > self.embedder.max_length and notes is not None:
            notes.append(f"query has {tokens} tokens; embedded its first {self.embedder.max_length}")
        if cached is not None:
            return vec
        self._cache[key] = (vec, tokens)
        if len(self._cache) > self.config.embedding_cache_size:
            self._cache.popitem(last=False)
        return vec

    async def embed_many(self, texts: Sequence[str], desc: ReleaseDescriptor) -> np.ndarray:
        """Passages being written: background class, so they never delay queries."""
        if not texts:
            return np.zeros((0, desc.dim), np.float32)
        self.check_model(desc, writing=True)
        # not through the query cache: a passage's text in it could be confirmed by any caller
        # who guesses it (the embed time in a search's timings)
        out = await asyncio.gather(*(self.embed_batcher.submit(t, self._estimate(t), None, True)
                                     for t in texts))
        return np.vstack([vec for vec, _ in out]).astype(np.float32)

    def can_rerank(self) -> bool:
        return self.rerank_batcher is not None

    async def rerank(self, query: str, passages: Sequence[str], deadline: Optional[float],
                     flow: object = None) -> list[float]:
        if self.rerank_batcher is None:
            raise FailedPrecondition("rerank_depth was given but this server has no cross-encoder "
                                     "(start it with --reranker DIR)")
        # each distinct text scored once: the same pair in two model batches can score apart in
        # the last bits (padding changes the arithmetic), which made identical passages order -
        # and an answer cite one or another - by how the request was batched (outside QA);
        # scored once, they tie exactly and break by chunk id
        distinct = list(dict.fromkeys(passages))
        scores = await asyncio.gather(*(
            self.rerank_batcher.submit((query, p), (len(query) + len(p)) // 4 + 3, deadline,
                                       flow=flow)
            for p in distinct))
        by_text = {p: float(s) for p, s in zip(distinct, scores)}
        return [by_text[p] for p in passages]

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Blocking: call from a worker thread (context budgets)."""
        if self.embedder is None:
            raise FailedPrecondition("a context token budget needs the server's tokenizer (embedder)")
        return self.embedder.count_tokens(texts)

    async def close(self) -> None:
        for b in (self.embed_batcher, self.rerank_batcher):
            if b is not None:
                await b.close()
