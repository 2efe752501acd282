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
