"""A shard's writable state, kept apart from its read-only build.

A published build is immutable and may sit on a read-only volume. Everything a running shard
writes lives under the state directory instead:

    <state_dir>/<collection>/<build_id>/shard-NNN/docstore.sqlite   (+ -wal, -shm)
    <state_dir>/<collection>/<build_id>/shard-NNN/lexical/          tantivy segments, locks, merges
    <state_dir>/<collection>/<build_id>/replay.json                 writes replayed from other builds

The first time a shard of a build is opened, its state is made from the build: the SQLite store is
copied with SQLite's online backup (reading the build with `immutable=1`, which needs no write
access), and the tantivy files are hard-linked when both sit on one filesystem (segments are never
modified in place) or copied otherwise. The copy is made under a temporary name and renamed into
place, so a crash mid-copy leaves nothing half made. The faiss index and exact vectors are read
from the build directly (memory-mapped); rows added since live in the store.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import sqlite3
import stat
import time
from pathlib import Path
from typing import Optional

from server.backends.docstore import read_only_uri
from server.errors import FailedPrecondition, IndexCorruptError, StorageFull, is_storage_full

log = logging.getLogger(__name__)

READY = "STATE_READY"
# the last write the store committed, recorded after each flip (the store's commit is durable
# first: synchronous=FULL): a store found without it at load lost committed writes (a removed or
# cut -wal takes a suffix of its commits, the last among them); a crash before the record is
# written leaves an earlier write there, which the store holds
COMMITTED = "COMMITTED_WRITE"
TANTIVY_LOCKS = (".tantivy-writer.lock", ".tantivy-meta.lock")


def state_shard_dir(state_root: Path, collection: str, build_id: str, shard_dir: str) -> Path:
    return Path(state_root) / collection / build_id / shard_dir


def check_writable(directory: Path, what: str = "state directory") -> Path:
    """Create `directory` if needed and prove it takes writes; the error names the path."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise FailedPrecondition(
            f"{what} {directory} is not writable ({exc.strerror or exc}); a serving shard writes "
            "its BM25 segments, SQLite WAL and streaming writes there: point --state-dir at a "
            "writable volume") from None
    return directory


def prepare(build_shard: Path, state_shard: Path, files: Optional[dict] = None) -> Path:
    """Make `state_shard` from `build_shard` unless it is there already; returns it. The build's
    files a shard reads beside the faiss index (checked at every load) are checked against what
    the build recorded of them (`files`, the descriptor's shard_files): the exact vectors, read
    from the build itself, at every load too; the document store and BM25 segments once, before
    the state is made from them (the state's copies are what a shard reads afterwards). A
    damaged build is refused by name, never served."""
    from server.backends.dense import recorded_problems  # (faiss: only when a shard loads)

    ready = (state_shard / READY).is_file()
    checked = ("vectors.npy",) if ready else ("vectors.npy", "docstore.sqlite", "lexical")
    problems = recorded_problems(build_shard, {k: v for k, v in (files or {}).items()
                                               if k in checked})
    if problems:
        raise IndexCorruptError(f"build file {problems[0]}")
    if ready:
        return state_shard
    parent = check_writable(state_shard.parent)
    with open(parent / f".{state_shard.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two processes opening one shard's state: one copies
        if (state_shard / READY).is_file():
            return state_shard
        if (state_shard / "docstore.sqlite").exists():
            # every state is renamed into place with its marker inside, so a store without one
            # lost the marker, not its copy; remaking the state would delete the writes the
            # store holds (outside QA: a removed marker silently undid every acknowledged write)
            raise IndexCorruptError(
                f"shard state {state_shard} holds a document store but no {READY} marker: it "
                f"may hold writes applied since the build. If the state is intact, restore the "
                f"marker (a file holding the build's shard directory, {build_shard}); to serve "
                f"the build again without those writes, remove {state_shard}")
        tmp = parent / f".tmp-{state_shard.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            _copy_store(build_shard / "docstore.sqlite", tmp / "docstore.sqlite")
            _link_tree(build_shard / "lexical", tmp / "lexical")
            (tmp / READY).write_text(str(build_shard) + "\n")
            if state_shard.exists():  # a leftover without a store (nothing written): replace it
                shutil.rmtree(state_shard)
            os.rename(tmp, state_shard)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return state_shard


def _copy_store(src: Path, dst: Path) -> None:
    if not src.is_file():
        raise IndexCorruptError(f"missing document store {src}")
    source = sqlite3.connect(read_only_uri(src), uri=True)
    target = sqlite3.connect(str(dst))
    try:
        source.backup(target)
        target.execute("PRAGMA journal_mode=WAL")
    except sqlite3.DatabaseError as exc:  # truncated or overwritten: name the file, not a traceback
        if is_storage_full(exc) or ("disk I/O error" in str(exc) and _no_room(src, dst)):
            # the state's volume, not the build, is at fault (review); SQLite may say only
            # "disk I/O error" when the volume fills mid-copy (re-probe)
            raise StorageFull(f"cannot copy {src} into the shard state {dst.parent}: its volume "
                              f"is full ({exc}); free space there and start again") from exc
        raise IndexCorruptError(f"document store {src} is unreadable: {exc}") from exc
    finally:
        target.close()
        source.close()


def _no_room(src: Path, dst: Path) -> bool:
    """Whether the copy's volume lacks room for the whole store (its partial copy counted)."""
    try:
        held = dst.stat().st_size if dst.exists() else 0
        return shutil.disk_usage(dst.parent).free + held < src.stat().st_size
    except OSError:
        return False


def _link_tree(src: Path, dst: Path) -> None:
    if not src.is_dir():
        raise IndexCorruptError(f"missing lexical index {src}")
    dst.mkdir()
    for entry in src.iterdir():
        if entry.name in TANTIVY_LOCKS or not entry.is_file():
            continue
        target = dst / entry.name
        try:
            os.link(entry, target)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EACCES, errno.EROFS, errno.EMLINK):
                raise
            shutil.copy2(entry, target)


def lock_state(state_shard: Path):
    """One engine per state directory: two processes writing one SQLite store and BM25 index
    would each hold a stale picture of the other's rows. Returns the open lock file (closing it
    releases the lock; the kernel releases it when the process dies)."""
    path = Path(state_shard) / ".engine.lock"
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = f.read().strip() or "another process"
        f.close()
        raise FailedPrecondition(
            f"the shard state {state_shard} is in use by {owner}: give each server process its "
            "own --state-dir (or --replica-id for shard servers)") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}\n")
    f.flush()
    return f


DESCRIPTOR_COPY = "release.json"  # <state>/<collection>/<build_id>/release.json


def keep_descriptor(state_root: Path, collection: str, build_id: str, desc_json: str) -> None:
    """A copy of the build's descriptor beside its state: once the build's own directory is
    pruned, the writes its state logged can still be replayed into another build (which needs
    the build's shard count and compaction source)."""
    path = Path(state_root) / collection / build_id / DESCRIPTOR_COPY
    if not path.is_file():
        from server.core.collection import atomic_write

        atomic_write(path, desc_json)


def check_state_is_this_builds(state_root: Path, collection: str, desc) -> None:
    """Refuse a state made for an earlier build of the same id (an id reused after a prune, or
    a build removed by hand and built again): its rows and writes are another build's (re-probe:
    it failed to load with "rows added after the build lack their vectors")."""
    root = Path(state_root) / collection / desc.build_id
    copy = root / DESCRIPTOR_COPY
    if not copy.is_file():
        return
    try:
        made = float(json.loads(copy.read_text()).get("created_at") or 0.0)
    except (ValueError, TypeError, AttributeError, OSError):
        return  # not readable: nothing to compare with (the load checks the state itself)
    if desc.created_at and made and abs(made - desc.created_at) > 1e-3:
        raise IndexCorruptError(
            f"the state {root} belongs to an earlier build also named {desc.build_id} (made at "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(made))} UTC), not to this one "
            f"(made at {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(desc.created_at))} UTC): "
            f"build ids must not be reused. Build again under another id, or move {root} away "
            f"to serve this build without the writes that state holds")


def remove_state(state_root: Path, collection: str, build_id: str) -> Optional[int]:
    """Remove one build's state directory unless a process has one of its shards open (each
    open shard holds its `.engine.lock`). Returns the bytes freed, or None when it is in use."""
    root = Path(state_root) / collection / build_id
    held = []
    try:
        for shard in sorted(root.glob("shard-*")):
            f = open(shard / ".engine.lock", "a+")
            held.append(f)
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None  # served by some process: not ours to remove
        # files hard-linked to a build (BM25 segments) free nothing while the build has them
        size = sum(st.st_size for st in (p.lstat() for p in root.rglob("*"))
                   if stat.S_ISREG(st.st_mode) and st.st_nlink == 1)
        # renamed first: a removal cut short leaves no state that looks whole
        doomed = root.with_name(f".removing-{build_id}")
        os.rename(root, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        return size
    finally:
        for f in held:
            f.close()


def state_builds(state_root: Path, collection: str) -> list[str]:
    """The builds of `collection` with a state under `state_root` (not a staging or removal
    name, which start with a dot)."""
    root = Path(state_root) / collection
    if not root.is_dir():
        return []
    return sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))


def remove_states(state_root: Path, collection: str, build_ids) -> None:
    """Blocking: remove these builds' states (each unless a process has it open: `remove_state`),
    logging each, and what a removal cut short left behind. One that fails is logged and the
    others still go."""
    for build_id in build_ids:
        try:
            freed = remove_state(state_root, collection, build_id)
        except OSError as exc:
            log.warning("%s: could not remove the state of build %s: %s", collection, build_id, exc)
            continue
        if freed is not None:
            log.info("%s: removed the state of build %s (%.1f MB), whose build is gone",
                     collection, build_id, freed / 1e6)
    for leftover in (Path(state_root) / collection).glob(".removing-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def record_committed(state_shard: Path, tenant: str, doc_id: str, version: int) -> None:
    """The last write a committed flip applied (COMMITTED), replaced whole."""
    tmp = state_shard / f".{COMMITTED}.tmp"
    tmp.write_text(json.dumps({"tenant": tenant, "doc_id": doc_id, "version": version}) + "\n")
    os.replace(tmp, state_shard / COMMITTED)


def lost_writes(state_shard: Path, store) -> Optional[str]:
    """What the store lost, when it lacks the last write COMMITTED says it committed: that
    document at that version or a later one (tombstones count). None when it holds it, when
    there is no record (a state no write has changed) or an unreadable one (a power cut before
    it reached the disk: a lost record can only hide a loss, never invent one). It asks about
    content, not counts: a replica's store put in place holds the same writes in other groups."""
    try:
        last = json.loads((state_shard / COMMITTED).read_text())
        key, version = (str(last["tenant"]), str(last["doc_id"])), int(last["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    held = store.documents_of([key]).get(key)
    if held is not None and held[0] >= version:
        return None
    return (f"the document store lacks the last write it had committed ({COMMITTED}: document "
            f"{key[1]!r} of "
            f"tenant {key[0]!r} at version {version}; the store holds "
            f"{'no version' if held is None else f'version {held[0]}'})")
