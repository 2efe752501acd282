from server.core.chunking import chunk_id, chunk_text, document_chunks, embed_text, shard_of


def test_chunk_offsets_point_at_the_chunk_text():
    text = "  alpha beta\ngamma   delta epsilon " * 50
    chunks = chunk_text(text, words=7, overlap=2)
    assert len(chunks) > 10
    for c in chunks:
        assert text[c.start:c.end] == c.text
        assert len(c.text.split()) <= 7
    # consecutive chunks overlap by two words
    assert chunks[1].text.split()[:2] == chunks[0].text.split()[-2:]
    assert chunks[-1].end == len(text.rstrip())


def test_empty_text_has_no_chunks():
    assert chunk_text("   \n ") == []


def test_chunk_ids_are_deterministic_63_bit_and_distinct():
    ids = {chunk_id(t, f"doc{i}", j) for t in ("a", "b") for i in range(200) for j in range(5)}
    assert len(ids) == 2000  # the same doc id in two tenants: two sets of chunk ids
    assert chunk_id("a", "doc1", 0) == chunk_id("a", "doc1", 0)
    assert all(0 <= x < 2 ** 63 for x in ids)


def test_sharding_is_stable_and_uses_every_shard():
    shards = [shard_of("t", f"doc{i}", 4) for i in range(400)]
    assert shards == [shard_of("t", f"doc{i}", 4) for i in range(400)]
    assert set(shards) == {0, 1, 2, 3}


def test_the_embedder_reads_title_and_chunk_joined_as_beir_does():
    """BEIR's sentence-transformers evaluation (and the reference figures) join title and text
    with one space; a document that is a title only is embedded as its title."""
    chunks = document_chunks("Wing flutter", "the flutter of thin wings at supersonic speed")
    assert [embed_text("Wing flutter", c.text) for c in chunks] == [
        "Wing flutter the flutter of thin wings at supersonic speed"]
    title_only = document_chunks("Wing flutter", "")
    assert [embed_text("Wing flutter", c.text) for c in title_only] == ["Wing flutter"]
    assert embed_text("", "no title here") == "no title here"


def test_text_without_spaces_is_chunked_like_text_with_them():
    """Regression (outside QA): a 4,571-character Chinese document - no spaces between its words -
    was one chunk (one "word"), of which the embedder read the first ~256 word pieces, so a
    phrase at its end ranked 11th of 24 in dense search. Two CJK characters now count as a word
    (one word piece each), and any other run without spaces one word per MAX_RUN characters;
    English is chunked as before. A document at the text cap stays under the chunks a write may
    carry (review: one character a word made 7,800)."""
    from server.core import limits
    from server.core.chunking import CHUNK_WORDS, MAX_RUN, chunk_text

    text = "自然语言处理的研究" * 500 + "结尾的特别短语"
    chunks = chunk_text(text)
    assert len(chunks) > 1 and all(c.end - c.start <= 2 * CHUNK_WORDS for c in chunks)
    assert all(text[c.start:c.end] == c.text for c in chunks)
    assert chunks[-1].text.endswith("结尾的特别短语")
    minified = "x" * (MAX_RUN * CHUNK_WORDS * 3)  # no space at all: three chunks' worth, and more
    assert len(chunk_text(minified)) > 3
    assert len(chunk_text("字" * limits.MAX_DOC_TEXT_CHARS)) <= limits.MAX_CHUNKS_PER_DOC
    # full-width punctuation pairs with the characters around it, as Chinese text uses it
    sentence = "自然语言处理的研究，"
    assert len(chunk_text(sentence * (limits.MAX_DOC_TEXT_CHARS // len(sentence)))) <= limits.MAX_CHUNKS_PER_DOC
    words = [f"word{i}" for i in range(300)]
    assert [c.text.split() for c in chunk_text(" ".join(words))] == [
        words[0:160], words[128:288], words[256:300]]


def test_a_document_of_more_chunks_than_a_write_may_carry_is_refused_before_embedding(tmp_path,
                                                                                   tiny_embedder):
    """Review: text mixing scripts without spaces ("字a" repeated) chunks into more than the
    4,096 chunks a write may carry; the shard refused it only after every chunk was embedded,
    and the builder, which has no such cap, built a document that could never be upserted
    again. Both now refuse it first, saying why."""
    import asyncio

    import pytest

    from index_builder.build import build_collection
    from index_builder.corpus import Document
    from server.core import limits
    from server.core.collection import CollectionStore
    from server.core.types import WriteRequest
    from server.core.writes import WritePath
    from server.errors import InvalidArgument

    text = "字a" * (limits.MAX_DOC_TEXT_CHARS // 2)
    with pytest.raises(ValueError, match="'big' splits into 7813 chunks; a document may have at most 4096"):
        build_collection([Document("big", text)], CollectionStore(tmp_path), "c", tiny_embedder,
                         "Flat", quiet=True)

    class NoEmbedder:  # the refusal comes before any embedding
        async def embed_many(self, texts, desc):
            raise AssertionError("embedded")

    path = WritePath(None, NoEmbedder())
    with pytest.raises(InvalidArgument, match="splits into 7813 chunks"):
        asyncio.run(path.shard_write(WriteRequest("upsert", "c", "big", 1, text), "default", None))
