"""BM25 over one shard with tantivy.

Analyzer (documented and measured in docs/ARCHITECTURE.md): Unicode NFKC normalisation of the text
(so a decomposed "e" + combining accent, a ligature or a full-width letter index as the composed
form a query types), then tantivy's `simple` tokenizer (splits on
non-alphanumerics, so identifiers like NACA-TN-1234 become naca/tn/1234 and still match as terms),
tokens of 100 bytes or more dropped (40 before v3), lowercase, English stopwords removed, Snowball
English stemming.
Queries go through the same analyzer and become a disjunction of term queries over title and text,
a repeated term boosted by 1 + ln(count); no query syntax is parsed, so user text can never change
the query's structure.

Restriction happens inside the query (MUST clauses on the tenant, the ACL scopes, metadata terms
and, for range filters, the set of eligible rows), so ranking only ever sees eligible chunks.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import unicodedata
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, NamedTuple, Optional, Sequence

import tantivy

from server.core.types import TermStats
from server.errors import IndexCorruptError

log = logging.getLogger(__name__)

ANALYZER_NAME = "en_bm25"
ANALYZER_VERSION = "nfkc+fold_latin_greek+simple+remove_long100+lower+stop_en+snowball_en/v3"

# accents (combining marks) on a Latin or Greek letter; other scripts keep theirs, where a mark
# can make another letter (Cyrillic й, Japanese kana's dakuten)
_LATIN_GREEK_MARKS = re.compile("(?<=[A-Za-z\u00c0-\u024f\u1e00-\u1eff\u0370-\u03ff\u1f00-\u1fff])"
                                "[\u0300-\u036f]+")


# Latin letters that are not a base letter plus a mark, folded as Elasticsearch's asciifolding
# folds them (outside QA: "strasse" missed "Straße", "lodz" "Łódź", "isik" Turkish "ışık")
_LATIN_LETTERS = str.maketrans({"ß": "ss", "ẞ": "SS", "æ": "ae", "Æ": "AE", "œ": "oe", "Œ": "OE",
                                "ł": "l", "Ł": "L", "ø": "o", "Ø": "O", "đ": "d", "Đ": "D",
                                "ı": "i", "þ": "th", "Þ": "TH", "ð": "d", "Ð": "D"})


def analyzer_folds(version: str) -> bool:
    """Whether a build's analyzer (its descriptor's `lexical_analyzer`) folds accents and Greek
    final sigma: v3 on. Older builds are analysed as they were built, or their terms would stop
    matching."""
    return "+fold_latin_greek+" in version


def longest_token(version: str) -> int:
    """Bytes from which a build's analyzer drops a token: 100 from v3 (40 before, which dropped
    a 21-letter Russian or Greek word - two bytes a letter - so it could never be found)."""
    return 100 if "+remove_long100+" in version else 40


def normalize(text: str, fold: bool = True) -> str:
    """NFKC, before tantivy's tokenizer: it splits on anything not alphanumeric, so "resume" +
    U+0301 (a combining accent) would index as "resume" and never match a query's "résumé".
    Then (v3, `fold`) accents of Latin and Greek letters go, letters such as ß, æ, ł and ı
    become their ASCII spelling, and Greek final sigma becomes sigma, as Vespa's and
    Meilisearch's default analysis (and Elasticsearch's asciifolding) does: "cafe" finds
    "café", and a query or title in capitals finds the text's words - Greek capitals carry no accents, and lowercasing
    maps Σ to σ wherever it stands, so "ΚΟΣΜΟΣ" never matched "κόσμος" (outside QA)."""
    if text.isascii():
        return text
    if not fold:
        return unicodedata.normalize("NFKC", text)
    # NFKC is NFKD then composition: the marks come off in between
    text = _LATIN_GREEK_MARKS.sub("", unicodedata.normalize("NFKD", text))
    return unicodedata.normalize("NFC", text).replace("ς", "σ").translate(_LATIN_LETTERS)


def prepare(text: str, version: str = ANALYZER_VERSION) -> str:
    """`text` as an index of that analyzer version reads it before tokenizing: as given (v1),
    NFKC (v2), NFKC and folded (v3)."""
    return normalize(text, analyzer_folds(version)) if version.startswith("nfkc") else text


def make_analyzer(version: str = ANALYZER_VERSION) -> "tantivy.TextAnalyzer":
    return (tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple())
            .filter(tantivy.Filter.remove_long(longest_token(version)))
            .filter(tantivy.Filter.lowercase())
            .filter(tantivy.Filter.stopword("english"))
            .filter(tantivy.Filter.stemmer("english"))
            .build())


_local = threading.local()


def analyze(text: str, version: str = ANALYZER_VERSION) -> list[str]:
    """`text`'s terms as an index of that analyzer version holds them, with one analyzer per
    thread and version."""
    analyzers = getattr(_local, "analyzers", None)
    if analyzers is None:
        analyzers = _local.analyzers = {}
    analyzer = analyzers.get(version)
    if analyzer is None:
        analyzer = analyzers[version] = make_analyzer(version)
    return analyzer.analyze(prepare(text, version))



def meta_path(key: str) -> str:
    """The JSON path of a metadata key: a dot in a key is part of its name, not a step into an
    object (tantivy reads an unescaped one as a step, and the filter matched nothing)."""
    return "meta." + key.replace(".", "\\.")


# tantivy indexes a JSON string that parses as an RFC 3339 date-time as a date, so a term query
# for the string never matches it; this is broader than the parse (a wrong month too), which only
# costs the slower path
_DATETIME_LIKE = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}")


def term_filterable(values: Sequence[str]) -> bool:
    """Whether an equality filter on these values can run as terms inside the BM25 query; else
    the caller restricts by the rows the filter allows (as for a range)."""
    return not any(_DATETIME_LIKE.match(v) for v in values)


_DELETES_FILE = re.compile(r"^([0-9a-f]{32})\.(\d+)\.del$")


def remove_stray_deletes(directory: Path) -> list[str]:
    """Delete-bitset files (`<segment>.<opstamp>.del`) that meta.json does not name: what a
    commit cut off by a crash leaves. Call before a writer opens (none may be committing).
    Returns the names removed."""
    meta = json.loads((directory / "meta.json").read_text())
    kept = {(seg["segment_id"].replace("-", ""), (seg.get("deletes") or {}).get("opstamp"))
            for seg in meta.get("segments", [])}
    last = int(meta.get("opstamp") or 0)
    removed = []
    for entry in directory.iterdir():
        m = _DELETES_FILE.match(entry.name)
        # only what no commit reached: a merge finishing in the background writes its segment's
        # delete file at the last commit's opstamp before meta.json names it (review)
        if m and int(m.group(2)) > last and (m.group(1), int(m.group(2))) not in kept:
            entry.unlink(missing_ok=True)
            removed.append(entry.name)
    return removed


class _Snapshot(NamedTuple):
    """A searcher and what BM25 counts on it (see LexicalIndex._snapshot)."""

    searcher: "tantivy.Searcher"
    generation: int
    docs: int = 0      # documents, deleted ones included until a merge (tantivy's N)
    tenants: int = 0   # tenant terms
    only: str = ""     # the tenant, when there is one


def bm25_idf(doc_freq: int, docs: int) -> float:
    """BM25's idf as tantivy computes it: ln(1 + (N - n + 0.5) / (n + 0.5))."""
    return math.log(1.0 + (docs - doc_freq + 0.5) / (doc_freq + 0.5))


def make_schema() -> "tantivy.Schema":
    sb = tantivy.SchemaBuilder()
    sb.add_unsigned_field("row", stored=True, indexed=True, fast=True)
    sb.add_text_field("title", stored=False, tokenizer_name=ANALYZER_NAME)
    sb.add_text_field("text", stored=False, tokenizer_name=ANALYZER_NAME)
    sb.add_text_field("tenant", stored=False, tokenizer_name="raw")
    sb.add_text_field("acl", stored=False, tokenizer_name="raw")  # one value per scope
    sb.add_json_field("meta", stored=False, tokenizer_name="raw")
    return sb.build()


class LexicalIndex:
    """A tantivy index whose documents are chunks, keyed by the shard's row number."""

    # hits read to find the ties at a page's cut (search(with_ties=True)): 4x the depth, at
    # least 64 more. A larger run of ties stays cut in tantivy's order: one-term queries tie by
    # the thousands (field lengths are quantised to 256 values), and reading every tie cost
    # ~13 ms a query per shard at 10,000 (review)
    TIE_READ_FACTOR, TIE_READ_EXTRA = 4, 64

    def __init__(self, index: "tantivy.Index", schema: "tantivy.Schema",
                 directory: Optional[Path] = None, version: str = ANALYZER_VERSION):
        self.index = index
        self.schema = schema
        self.directory = directory
        # the build's analyzer version (its descriptor's): a build made by analyzer v1 indexed
        # text as given, v2 without folding accents and final sigma and dropping tokens from 40
        # bytes: its queries and new writes are analysed as it was built, so old and new text
        # match alike
        self.version = version
        self.analyzer = make_analyzer(version)
        # the searcher and its document count move together, on reload (see _snapshot)
        self._snap_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._generation = 0
        # (documents, tenants, the tenant when there is one) as BM25 counts them
        self._docs: Optional[tuple[int, int, str]] = None
        self._scoped: dict[tuple, int] = {}  # (generation, tenant, field, term) -> live count

    def _text(self, text: str) -> str:
        return prepare(text, self.version)

    @classmethod
    def create(cls, directory: Path) -> "LexicalIndex":
        """A new index, of this version's analyzer (ANALYZER_VERSION)."""
        directory.mkdir(parents=True, exist_ok=True)
        schema = make_schema()
        index = tantivy.Index(schema, path=str(directory))
        index.register_tokenizer(ANALYZER_NAME, make_analyzer())
        return cls(index, schema, directory)

    @classmethod
    def open(cls, directory: Path, read_only: bool = False,
             version: str = ANALYZER_VERSION) -> "LexicalIndex":
        """Open an index. tantivy takes a lock file in the directory even to read, so a read-only
        open (an audit of a published build on a read-only volume) reads a private copy."""
        directory = Path(directory)
        if not (directory / "meta.json").is_file():
            raise IndexCorruptError(f"missing lexical index {directory / 'meta.json'}")
        if read_only and not os.access(directory, os.W_OK):
            scratch = Path(tempfile.mkdtemp(prefix="lexical-ro-"))
            for entry in directory.iterdir():
                if entry.is_file() and not entry.name.startswith(".tantivy-"):
                    shutil.copy2(entry, scratch / entry.name)
            opened = cls.open(scratch, version=version)
            opened._scratch = scratch
            return opened
        try:
            index = tantivy.Index.open(str(directory))
            index.register_tokenizer(ANALYZER_NAME, make_analyzer(version))
            # searchers move only on reload(): a write commits, then becomes visible together
            # with the store's visibility flip (see ShardIndex.apply_writes)
            index.config_reader(reload_policy="Manual")
            index.reload()
            index.searcher().num_docs  # touch the segments: a damaged one fails here, not mid-query
        except Exception as exc:
            raise IndexCorruptError(f"cannot open lexical index in {directory}: {exc}") from exc
        return cls(index, index.schema, directory, version)

    def add(self, rows: Iterable[tuple[int, str, str, str, dict, Sequence[str]]], writer=None) -> int:
        """Add (row, title, text, tenant, metadata, acl) chunks; commit when we own the writer."""
        own = writer is None
        writer = writer or self.index.writer(heap_size=128_000_000, num_threads=1)
        n = 0
        for row, title, text, tenant, meta, acl in rows:
            doc = tantivy.Document()
            doc.add_unsigned("row", int(row))
            if title:
                doc.add_text("title", self._text(title))
            doc.add_text("text", self._text(text))
            doc.add_text("tenant", tenant)
            for scope in acl:
                doc.add_text("acl", scope)
            if meta:
                doc.add_json("meta", {str(k): str(v) for k, v in meta.items()})
            writer.add_document(doc)
            n += 1
        if own:
            writer.commit()
            writer.wait_merging_threads()
            self._reload()
        return n

    def writer(self):
        """A long-lived writer for streaming writes (one per index: tantivy locks the directory)."""
        if getattr(self, "_writer", None) is None:
            # a process killed mid-commit can leave a segment's `.del` file of the opstamp it was
            # writing; the commit that reaches that opstamp again failed with FileAlreadyExists
            # (a valid write answered INTERNAL). No commit refers to such a file: remove it, and
            # let tantivy collect the other files it tracks and no commit uses
            if self.directory is not None:
                remove_stray_deletes(self.directory)
            self._writer = self.index.writer(heap_size=32_000_000, num_threads=1)
            self._writer.garbage_collect_files()
        return self._writer

    @contextmanager
    def _one_commit(self):
        """The long-lived writer, for operations that commit together or not at all: when the
        commit (or anything before it) fails, the writer is rolled back to the last commit.
        Otherwise the failed write's queued adds and deletes rode along with the next write's
        commit (outside QA: after a commit failed on a full disk, the next write carried out the
        failed replace's deletes, and the document dropped out of lexical search)."""
        w = self.writer()
        try:
            yield w
            w.commit()
        except BaseException:
            try:
                w.rollback()
                # the failed commit's delete files (outside QA re-probe: one half written on a
                # full disk made every later commit that reached its opstamp fail
                # FileAlreadyExists, deletes answering INTERNAL until a restart); no commit
                # runs now: the shard's writes hold its write mutex
                if self.directory is not None:
                    remove_stray_deletes(self.directory)
            except BaseException as exc:  # noqa: BLE001 - a writer that cannot roll back goes
                log.error("BM25 writer of %s could not roll back a failed commit (%s): "
                          "reopened", self.directory, exc)
                self._writer = None  # the next write opens a new one
            raise

    def add_committed(self, rows) -> None:
        """Add chunks and commit (durable), then make them searchable (the caller masks them until
        the store says they are live)."""
        with self._one_commit() as w:
            self.add(rows, writer=w)
        self._reload()

    def delete_rows(self, rows: Sequence[int]) -> None:
        """Delete the chunks of these rows and commit.

        By query, not by term: `delete_documents_by_term("row", n)` on the unsigned `row` field
        deletes nothing with tantivy 0.27 (the term it builds does not match the indexed u64), so
        replaced and deleted chunks stayed in the index and filled the BM25 top-N
        (tests/test_live_data.py pins this)."""
        if not len(rows):
            return
        with self._one_commit() as w:
            self._delete(w, rows)
        self._reload()

    DELETE_BATCH = 4096

    def _delete(self, writer, rows: Sequence[int]) -> None:
        """Queue the deletion of these rows' chunks on `writer`, a term-set query a block."""
        for start in range(0, len(rows), self.DELETE_BATCH):
            block = [int(r) for r in rows[start:start + self.DELETE_BATCH]]
            writer.delete_documents_by_query(tantivy.Query.term_set_query(self.schema, "row", block))

    def stage(self, add: Iterable, delete: Sequence[int]) -> None:
        """Add chunks and delete rows in ONE commit, durable but not yet searched: `publish`
        makes searchers see it (the shard does that in the same step as its visibility flip)."""
        with self._one_commit() as w:
            self.add(add, writer=w)
            self._delete(w, delete)

    def publish(self) -> None:
        """Searchers see everything committed so far."""
        self._reload()

    def _reload(self) -> None:
        with self._snap_lock:
            self.index.reload()
            self._generation += 1
            self._docs = None
            self._scoped = {}

    def _snapshot(self, count: bool) -> _Snapshot:
        """The current searcher, its generation and (with `count`) the document count BM25
        scores with on it, the number of tenants and the tenant when there is only one: tantivy's
        N counts deleted documents until a merge drops them (as its document frequencies do),
        and every document holds exactly one tenant term, so the tenant terms' counts sum to it.
        Counted once per reload (a walk of the tenant terms: ~1 us for a few tenants, ~0.1 s for
        200,000)."""
        with self._snap_lock:
            searcher, generation, docs = self.index.searcher(), self._generation, self._docs
        if docs is not None or not count:
            return _Snapshot(searcher, generation, *(docs or ()))
        with self._count_lock:  # one walk per reload, however many searches want it at once
            with self._snap_lock:
                if self._generation == generation and self._docs is not None:
                    return _Snapshot(searcher, generation, *self._docs)
            tenants = list(searcher.terms_with_prefix("tenant", ""))
            docs = (sum(n for _, n in tenants), len(tenants),
                    tenants[0][0] if len(tenants) == 1 else "")
            with self._snap_lock:
                if self._generation == generation:
                    self._docs = docs
        return _Snapshot(searcher, generation, *docs)

    def _scoped_stats(self, snap: _Snapshot, tenant: Optional[str], terms: Sequence[str],
                      hidden: Optional[tuple[tuple[str, ...], tuple[str, ...]]] = None
                      ) -> Optional[TermStats]:
        """The statistics BM25 should score a tenant's query with where the index holds other
        tenants' documents: its own live documents only. tantivy's count every tenant's
        documents (and deleted ones until a merge), so one tenant's documents would move
        another's scores and reveal how common a term is elsewhere. None for an index of the
        caller's tenant alone: it pays no count query (its deleted documents still count until
        a merge, as in tantivy: counting them out on every query after every write would cost a
        large index a posting walk per term). Counted with count queries (live documents only),
        cached per index version; an index of only another tenant's counts none of the caller's.
        `hidden` = (the caller's scopes, the tenant's scope names the caller lacks), given when
        some of the tenant's documents need a scope the caller does not hold: those documents
        are counted out - they moved the scores of callers who cannot see them, and told them
        how many hold a term. Counting them walks only the postings of those scope names."""
        single = snap.tenants == 1 and snap.only == tenant
        if tenant is None or (single and hidden is None):
            return None
        Q, Must, MustNot = tantivy.Query, tantivy.Occur.Must, tantivy.Occur.MustNot
        own = Q.term_query(self.schema, "tenant", tenant)
        cache = self._scoped
        searcher = snap.searcher

        def count(scope: Optional[tuple], field: Optional[str], term: Optional[str]) -> int:
            key = (snap.generation, tenant, scope, field, term)
            n = cache.get(key)
            if n is None:
                clauses = [(Must, own)]
                if scope is not None:  # documents of a scope the caller lacks, and of none it has
                    clauses += [(Must, Q.term_set_query(self.schema, "acl", list(scope[1]))),
                                (MustNot, Q.term_set_query(self.schema, "acl", list(scope[0])))]
                if field is not None:
                    clauses.append((Must, Q.term_query(self.schema, field, term)))
                n = cache[key] = int(searcher.search(Q.boolean_query(clauses), 1, count=True).count)
                if len(cache) > self.SCOPED_CACHE:
                    cache.clear()
            return n

        def base(field: Optional[str], term: Optional[str]) -> int:
            if single:  # tantivy's own for an index of this tenant alone: no count walk
                return snap.docs if field is None else searcher.doc_freq(field, term)
            return count(None, field, term)

        def visible(field: Optional[str], term: Optional[str]) -> int:
            n = base(field, term)
            return n if hidden is None else max(0, n - count(hidden, field, term))

        return TermStats(visible(None, None), tuple((t, visible("text", t), visible("title", t))
                                                    for t in dict.fromkeys(terms)))

    SCOPED_CACHE = 100_000  # cached tenant-scoped counts (cleared on reload, or when full)

    def term_stats(self, text: str, expansion: Sequence[tuple[str, float]] = (),
                   tenant: Optional[str] = None,
                   hidden: Optional[tuple[tuple[str, ...], tuple[str, ...]]] = None) -> TermStats:
        """This index's BM25 statistics for a query's terms (and its expansion terms): the
        documents counted and, per term, how many hold it in the text and in the title - the
        tenant's live documents (less those `hidden` from the caller, when given) when they differ
        from the index's (see _scoped_stats)."""
        snap = self._snapshot(count=True)
        terms = list(self.query_terms(text)) + [t for t, _ in expansion]
        scoped = self._scoped_stats(snap, tenant, terms, hidden)
        if scoped is not None:
            return scoped
        searcher = snap.searcher
        return TermStats(snap.docs, tuple((t, searcher.doc_freq("text", t),
                                           searcher.doc_freq("title", t))
                                          for t in dict.fromkeys(terms)))

    def close(self) -> None:
        """Let background merges finish and release the directory lock."""
        writer = getattr(self, "_writer", None)
        if writer is not None:
            writer.wait_merging_threads()
            self._writer = None
        scratch = getattr(self, "_scratch", None)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

    def num_docs(self) -> int:
        """Documents in the index, deleted ones excluded."""
        return int(self.index.searcher().num_docs)

    def indexed_rows(self) -> list[int]:
        """Every row the index holds (deleted ones excluded): the full check that recovery and
        the audit use when the document count disagrees with the store."""
        searcher = self.index.searcher()
        n = int(searcher.num_docs)
        if n == 0:
            return []
        result = searcher.search(tantivy.Query.all_query(), n, count=False)
        return [int(r) for r in searcher.fast_field_values("row", [addr for _, addr in result.hits])]

    def query_terms(self, text: str) -> dict[str, int]:
        """Analysed query terms with how often each occurs. One-character tokens are dropped
        when longer ones exist: in conversational queries they are debris ("I'm" -> i, m) that
        matches authors' initials (measured on CACM: docs/BENCHMARKS.md)."""
        counts: dict[str, int] = {}
        for tok in self.analyzer.analyze(self._text(text)):
            counts[tok] = counts.get(tok, 0) + 1
        if any(len(t) > 1 for t in counts):
            counts = {t: n for t, n in counts.items() if len(t) > 1}
        return counts

    def search(self, text: str, k: int, tenant: Optional[str] = None,
               equal_filters: Sequence[tuple[str, Sequence[str]]] = (),
               acl_scopes: Optional[Sequence[str]] = None,
               rows: Optional[Sequence[int]] = None,
               expansion: Sequence[tuple[str, float]] = (),
               stats: Optional[TermStats] = None,
               hidden: Optional[tuple[tuple[str, ...], tuple[str, ...]]] = None,
               with_ties: bool = False) -> tuple[list[float], list[int]]:
        """BM25 top-k (scores, rows), best first, restricted inside the query to the tenant, the
        ACL scopes (None: no ACL check), metadata equality filters and, if given, a row set.
        `expansion`: analysed terms with boosts added to the query (lexical feedback). `stats`:
        the whole collection's statistics for these terms (summed `term_stats` of every shard,
        the tenant's live documents): each term's weight is scaled by the collection's idf over
        this index's own, so every shard scores on one scale and a ranking does not depend on
        how documents fall into shards. Without them, the tenant's own live statistics where
        they differ from the index's (_scoped_stats). tantivy takes no statistics from outside,
        so a boost carries them; the field-length part of BM25 stays this index's (every
        tenant's documents, deleted ones until a merge). `with_ties`: also the hits that tie
        with the k-th (up to TIE_READ_FACTOR x k, or k + TIE_READ_EXTRA, in all), so the caller
        can cut the ties by its own key: which of many equal hits tantivy returns at the cut
        follows its segments, which differ between replicas (the same text in several
        documents)."""
        terms = self.query_terms(text)
        if not terms or k <= 0:
            return [], []
        snap = self._snapshot(count=stats is not None or tenant is not None)
        searcher, docs = snap.searcher, snap.docs
        weighted = [(t, 1.0 + math.log(n)) for t, n in terms.items()]
        weighted += [(t, float(w)) for t, w in expansion if t not in terms]
        if stats is None:  # one shard: the tenant's own live statistics where they differ
            stats = self._scoped_stats(snap, tenant, [t for t, _ in weighted], hidden)
        shared = {} if stats is None else {t: (text_df, title_df) for t, text_df, title_df in stats.df}
        # terms the given statistics lack (a feedback round's expansion terms: the statistics
        # round counted the query's own) score with this shard's statistics of the tenant's
        # live documents, never tantivy's, which count every tenant's and hidden ones (outside
        # QA: another tenant's writes of an expansion term moved a caller's scores by 5-7%)
        unshared = [t for t, _ in weighted if t not in shared] if stats is not None else []
        own_stats = self._scoped_stats(snap, tenant, unshared, hidden) if unshared else None
        own = {} if own_stats is None else {t: (a, b) for t, a, b in own_stats.df}
        Q, Occur = tantivy.Query, tantivy.Occur
        should = []
        for t, w in weighted:
            # a term the query repeats weighs more, sublinearly (1 + ln n), as BM25 over the
            # query's own term frequency would; deduplicating lost it on long queries
            for j, field in enumerate(("text", "title")):
                boost = w
                given, n_docs = ((shared, stats.docs) if t in shared else
                                 (own, own_stats.docs) if t in own else (None, 0))
                if given is not None:  # score with those statistics' idf, not tantivy's own
                    df = searcher.doc_freq(field, t)
                    if 0 < df <= docs and 0 < given[t][j] <= n_docs:  # else: this shard's own
                        boost *= bm25_idf(given[t][j], n_docs) / bm25_idf(df, docs)
                q = Q.term_query(self.schema, field, t)
                should.append((Occur.Should, Q.boost_query(q, boost) if boost != 1.0 else q))
        restrict = []
        if tenant is not None:
            restrict.append(Q.term_query(self.schema, "tenant", tenant))
        if acl_scopes is not None:
            restrict.append(Q.term_set_query(self.schema, "acl", list(acl_scopes)))
        for key, values in equal_filters:
            restrict.append(Q.term_set_query(self.schema, meta_path(key), list(values)))
        if rows is not None:
            if not rows:
                return [], []
            restrict.append(Q.term_set_query(self.schema, "row", [int(r) for r in rows]))
        # restrictions filter and never score: a scoring clause would add the tenant term's own
        # BM25 (which differs between shards with another tenant mix) and 1.0 per term set to
        # every hit, so scores would move with the tenant and the filters, and merges across
        # shards would compare unlike sums
        clauses = [(Occur.Must, Q.boolean_query(should))]
        clauses += [(Occur.Must, Q.const_score_query(r, 0.0)) for r in restrict]
        query = Q.boolean_query(clauses) if len(clauses) > 1 else clauses[0][1]
        ask = k + 1 if with_ties else k
        result = searcher.search(query, ask, count=False)
        if (with_ties and len(result.hits) == ask
                and result.hits[-1][0] == result.hits[k - 1][0]):  # ties run past what was read
            ask = max(self.TIE_READ_FACTOR * k, k + self.TIE_READ_EXTRA)
            result = searcher.search(query, ask, count=False)
        hits = result.hits
        if with_ties:  # the k best and those tied with the k-th
            cut = hits[k - 1][0] if len(hits) >= k else None
            hits = hits[:k] + [h for h in hits[k:] if h[0] == cut]
        if not hits:
            return [], []
        scores = [float(s) for s, _ in hits]
        rows = searcher.fast_field_values("row", [addr for _, addr in hits])
        return scores, [int(r) for r in rows]
