"""Splitting documents into chunks with exact source offsets, and deterministic chunk ids.

The chunker is versioned: a build records CHUNKER_VERSION, and a change to the rules below must
change it, because chunk ids and offsets depend on them.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from server.core.limits import MAX_CHUNKS_PER_DOC
from server.errors import InvalidArgument

CHUNK_WORDS = 160    # MiniLM reads 256 word pieces; 160 English words stay under that
OVERLAP_WORDS = 32
# v2: ids keyed by (tenant, doc_id); v3: a document with a title and no text is one empty chunk;
# v4: the embedder reads "title text" (see embed_text); v5: two CJK characters count one word,
# and a run without spaces one word per MAX_RUN characters
CHUNKER_VERSION = f"words-{CHUNK_WORDS}-{OVERLAP_WORDS}/v5"

# What counts as a word. Text without spaces between its words (Chinese, Japanese) or none at
# all (minified code, base64) was one "word", so a whole document became one chunk - up to the
# 1,000,000-character cap - of which the embedder read the first ~256 word pieces: a phrase near
# the end was unseen by dense search (outside QA). BERT-family tokenizers read one word piece per
# CJK character; two count as a word, so a chunk holds 320 and the next starts 256 in - about
# where the model stops reading (its 256 pieces hold the title and two markers too, so a few
# characters before each chunk boundary are BM25's only) - and CJK text at the 1,000,000-
# character cap makes ~3,906 chunks, under the 4,096 a write may carry (one character a word
# made 7,800: review). Text that mixes scripts without spaces can still make more, and
# capped_chunks refuses it before anything is embedded. Any other run without spaces counts one
# word per MAX_RUN characters (no English word is that long; such text - base64, Thai - is still
# read only ~256 pieces into each chunk, but no longer one chunk for a whole document).
MAX_RUN = 64
_CJK = ("\u3001-\u303f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
        "\uff01-\uff65\uff66-\uff9f")  # with the full-width punctuation Chinese uses (，：！？)
_WORD = re.compile(f"[{_CJK}]{{1,2}}|[^\\s{_CJK}]{{1,{MAX_RUN}}}")


@dataclass(frozen=True)
class Chunk:
    index: int
    start: int  # character offsets into the document text: text[start:end] == chunk text
    end: int
    text: str


def chunk_text(text: str, words: int = CHUNK_WORDS, overlap: int = OVERLAP_WORDS) -> list[Chunk]:
    """Windows of `words` words (see _WORD), overlapping by `overlap` words."""
    spans = [m.span() for m in _WORD.finditer(text)]
    if not spans:
        return []
    step = max(1, words - overlap)
    chunks = []
    start_word = 0
    while True:
        end_word = min(start_word + words, len(spans))
        s, e = spans[start_word][0], spans[end_word - 1][1]
        chunks.append(Chunk(len(chunks), s, e, text[s:e]))
        if end_word == len(spans):
            return chunks
        start_word += step


def document_chunks(title: str, text: str) -> list[Chunk]:
    """The chunks of a document. One with a title but no words of text still gets one (empty)
    chunk, so it can be found by its title (CACM has dozens of title-only documents)."""
    chunks = chunk_text(text)
    if not chunks and title.strip():
        return [Chunk(0, 0, 0, "")]
    return chunks


def capped_chunks(title: str, text: str, what: str = "the text") -> list[Chunk]:
    """document_chunks, refused (InvalidArgument, naming `what`) past the chunks a write may
    carry: the write path and the builder check before embedding any (review: the shard refused
    such a write after every chunk was embedded, and the builder built a document that could
    never be upserted again)."""
    chunks = document_chunks(title, text)
    if len(chunks) > MAX_CHUNKS_PER_DOC:
        raise InvalidArgument(f"{what} splits into {len(chunks)} chunks; a document may have at "
                              f"most {MAX_CHUNKS_PER_DOC}: split it")
    return chunks


def given_chunks(texts: list[str], separator: str = "\n\n") -> tuple[str, list[Chunk]]:
    """Chunks a caller made itself (it embedded them with its own model): the document text is
    their concatenation, and each chunk's offsets point into it."""
    chunks, pos = [], 0
    for i, t in enumerate(texts):
        if i:
            pos += len(separator)
        chunks.append(Chunk(i, pos, pos + len(t), t))
        pos += len(t)
    return separator.join(texts), chunks


def embed_text(title: str, text: str) -> str:
    """What the embedder reads for a chunk: the document title gives short chunks their topic.

    Title and text are joined by a space, as BEIR's sentence-transformers evaluation (and the
    reference figures in ../shared/datasets) feed them to the model; v3's "title. text" scored
    0.003-0.004 lower nDCG@10 on CACM and 0.001 higher on Cranfield (within noise on both,
    docs/BENCHMARKS.md), so the model's published convention decides."""
    if not text:
        return title
    return f"{title} {text}" if title else text


def chunk_id(tenant: str, doc_id: str, index: int) -> int:
    """A 63-bit id, a pure function of (tenant, doc_id, chunk_index): replays produce the same
    ids, and two tenants' documents of the same id never share one."""
    digest = hashlib.blake2b(f"{tenant}\x00{doc_id}\x00{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << 63) - 1)


def shard_of(tenant: str, doc_id: str, shards: int) -> int:
    """Documents are sharded by a hash of (tenant, doc_id), so all chunks of a document share a
    shard."""
    digest = hashlib.blake2b(f"{tenant}\x00{doc_id}".encode(), digest_size=8, person=b"shard").digest()
    return int.from_bytes(digest, "big") % shards
