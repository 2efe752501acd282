"""Offline builder: read a corpus, chunk, embed, train, add, write, audit, publish, evaluate."""
