"""Corpus readers: BEIR `corpus.jsonl` ({_id, title, text}) or JSONL of {id, text, title?, metadata?,
tenant?, acl?}; and the demo corpus built from the Python standard library's own docstrings."""
from __future__ import annotations

import importlib
import inspect
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional


@dataclass
class Document:
    doc_id: str
    text: str
    title: str = ""
    metadata: dict = field(default_factory=dict)
    tenant: str = "default"
    acl: tuple = ()  # scopes allowed to read it; empty = every caller of its tenant
    version: int = 1
    vector: Optional[list] = None  # your own embedding of this document (one chunk), if any
    record: int = -1  # its position among the corpus file's records (non-blank lines), from 0


def _check_unicode(value, field: str) -> None:
    """JSON's \\ud800-style escapes can spell a lone surrogate, which no UTF-8 text holds (the
    tokenizer would fail on it later without naming the document)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{field} is not valid Unicode ({exc.reason} at character "
                             f"{exc.start})") from None


def check_document(doc: Document) -> None:
    """The write API's rules (ids, versions, sizes, metadata, ACL scopes; validate_write) and a
    valid tenant: a build takes no document that UpsertDocument would refuse, or that could then
    never be replaced or deleted. For a document with text or a title. Raises ValueError."""
    from server.core.types import WriteRequest
    from server.core.validation import NAME, validate_write
    from server.errors import InvalidArgument

    try:
        validate_write(WriteRequest("upsert", "", doc.doc_id, doc.version, doc.text, doc.title,
                                    doc.metadata, tuple(doc.acl)))
    except InvalidArgument as exc:
        raise ValueError(str(exc)) from None
    if not NAME.match(doc.tenant):
        raise ValueError(f"tenant {doc.tenant!r} must match {NAME.pattern}")


def read_corpus(path: Path, default_tenant: str = "default",
                tally: Optional[dict] = None) -> Iterator[Document]:
    """Yield documents; a malformed line raises ValueError naming the file and line. A document
    with neither text nor title is skipped (nothing could find it; the write API refuses one),
    and the skips are reported on stderr. Each document knows its record number (`record`: the
    non-blank lines before it), skipped ones counted, so rows of a vectors file made line by
    line stay with their documents. Once the file is read to its end, `tally` (if given) holds
    "records" and "skipped"."""
    path = Path(path)
    if path.is_dir():
        path = path / "corpus.jsonl"
    skipped: list[str] = []
    record = -1
    with open(path, "rb") as f:  # decoded line by line: a bad byte is reported with its line
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            record += 1
            try:
                obj = json.loads(raw.decode("utf-8-sig" if lineno == 1 else "utf-8"))
                if not isinstance(obj, dict):
                    raise ValueError(f"a record must be a JSON object, not {type(obj).__name__}")
                doc_id = obj.get("_id", obj.get("id"))
                if doc_id is None or "text" not in obj:
                    raise ValueError("needs an id (or _id) and a text")
                # what would otherwise be stored as Python's repr of it ("None", "{'x': 1}")
                if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):
                    raise ValueError(f"id must be a string or an integer, not {doc_id!r}")
                for field in ("text", "title", "tenant"):
                    if obj.get(field) is not None and not isinstance(obj[field], str):
                        raise ValueError(f"{field} must be a string, not {type(obj[field]).__name__}")
                if obj["text"] is None:
                    obj["text"] = ""  # as absent: a record with a title alone is still findable
                meta = obj.get("metadata") or {}
                if not isinstance(meta, dict):
                    raise ValueError("metadata must be an object")
                meta = {k: v for k, v in meta.items() if v is not None}  # null: the key is absent
                for k, v in meta.items():  # 1e400 parses as infinity, stored as "Infinity"
                    try:                     # (and NaN, and either inside a list or object)
                        json.dumps(v, allow_nan=False)
                    except ValueError:
                        raise ValueError(f"metadata {k!r} holds a number that is not finite "
                                         f"({str(v)[:80]})") from None
                # values are text, as the write API's; anything else (BEIR's list of authors, a
                # flag) is kept as its JSON text - [..], {..}, true, 1.5 - not as Python's repr
                # of it ("True" matched no filter for "true"; outside QA)
                meta = {k: v if isinstance(v, str) else
                        json.dumps(v, ensure_ascii=False, separators=(",", ":"))
                        for k, v in meta.items()}
                acl = obj.get("acl") or []
                if not isinstance(acl, list) or not all(isinstance(a, str) for a in acl):
                    raise ValueError("acl must be a list of scope names")
                vector = obj.get("vector")
                if vector is not None and (not isinstance(vector, list) or not vector
                                           or not all(isinstance(x, (int, float))
                                                      and not isinstance(x, bool) for x in vector)):
                    raise ValueError("vector must be a non-empty list of numbers")
                for field in ("text", "title"):
                    _check_unicode(obj.get(field), field)
                version = obj.get("version")
                if version is None:  # absent: 1 (0, "" or false were made 1 too, silently, where
                    version = 1      # the write API refuses them - outside QA)
                if isinstance(version, (bool, float)) or not str(version).lstrip("-").isdigit():
                    raise ValueError(f"version must be an integer, not {version!r}")
                version = int(version)
                doc = Document(str(doc_id), str(obj["text"]), str(obj.get("title") or ""),
                               {str(k): str(v) for k, v in meta.items()},
                               str(obj.get("tenant") or default_tenant), tuple(str(a) for a in acl),
                               version, vector, record)
                if not (doc.text.strip() or doc.title.strip()):
                    skipped.append(f"{path}:{lineno} ({doc.doc_id!r})")
                    continue
                check_document(doc)
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from None
            yield doc
    if tally is not None:
        tally.update(records=record + 1, skipped=len(skipped))
    if skipped:
        print(f"index-builder: skipped {len(skipped)} document(s) with neither text nor title: "
              f"{', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}", file=sys.stderr)


# Modules whose import has no side effects and whose docstrings are worth searching.
DEMO_MODULES = (
    "argparse asyncio base64 bisect calendar collections contextlib copy csv dataclasses datetime "
    "decimal difflib enum fnmatch fractions functools glob gzip hashlib heapq hmac html http.client "
    "inspect io ipaddress itertools json logging math mimetypes operator os os.path pathlib pickle "
    "pprint queue random re secrets shlex shutil socket sqlite3 statistics string struct subprocess "
    "tarfile tempfile textwrap threading time timeit typing unicodedata unittest urllib.parse uuid "
    "warnings weakref xml.etree.ElementTree zipfile zlib"
).split()


def stdlib_docs(limit: int | None = None) -> Iterator[Document]:
    """One document per documented public module, class, function and method of DEMO_MODULES."""
    n = 0
    for modname in DEMO_MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        items = [(modname, mod)]
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or getattr(obj, "__module__", modname) not in (modname, mod.__name__):
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj):
                items.append((f"{modname}.{name}", obj))
                if inspect.isclass(obj):
                    for mname, meth in sorted(vars(obj).items()):
                        if not mname.startswith("_") and callable(meth):
                            items.append((f"{modname}.{name}.{mname}", meth))
        for qualname, obj in items:
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < 40:
                continue
            yield Document(qualname, doc, qualname, {"module": modname})
            n += 1
            if limit is not None and n >= limit:
                return
