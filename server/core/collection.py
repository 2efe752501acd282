"""Versioned collections on disk: immutable builds, a release descriptor each, and an alias.

    <data_dir>/<collection>/ALIAS                  {"live": build_id, "previous": build_id|null}
    <data_dir>/<collection>/builds/<build_id>/release.json
    <data_dir>/<collection>/builds/<build_id>/shard-000/{dense.faiss, rows.npy, docstore.sqlite, lexical/}

A build holds the dense and the lexical index of every shard, so flipping the alias (one atomic
rename of one small file) moves both together; the previous build stays for rollback.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from server.errors import FailedPrecondition, IndexCorruptError, InvalidArgument, NotFound

log = logging.getLogger(__name__)

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
DESCRIPTOR = "release.json"
# The release descriptor's format. Fields a server may ignore are added without raising it (an
# older server skips them, with a warning); a field an older server must not ignore raises it,
# and an older server then refuses the build, saying why.
DESCRIPTOR_FORMAT = 1
_WARNED_UNKNOWN: set = set()


# what a tenant admin sees of an audit: its verdict, not what sizes show through (the number of
# queries sampled from a build under 200 chunks is its chunk count; timings grow with its size;
# a reconciliation's mismatches quote counts)
_AUDIT_FOR_TENANTS = ("k", "recall", "min_recall", "passed", "query_source", "audited_at",
                      "search_defaults")


def _audit_for_tenant(audit: dict) -> dict:
    out = {k: audit[k] for k in _AUDIT_FOR_TENANTS if k in audit}
    if isinstance(audit.get("reconciliation"), dict):
        out["reconciliation"] = {k: v for k, v in audit["reconciliation"].items() if k == "passed"}
    return out


@dataclass
class ReleaseDescriptor:
    collection: str
    build_id: str
    model_id: str
    model_revision: str
    dim: int
    metric: str
    chunker: str
    lexical_analyzer: str
    factory: str
    shards: int
    corpus_version: str
    documents: int
    chunks: int
    created_at: float
    shard_files: dict = field(default_factory=dict)    # "shard-000" -> {file: {bytes, sha256}}
    shard_counts: dict = field(default_factory=dict)   # "shard-000" -> {documents, chunks, tenants}
    tenants: dict = field(default_factory=dict)        # tenant -> chunks
    search_defaults: dict = field(default_factory=dict)  # nprobe / ef_search / k_factor
    dedicated_tenants: dict = field(default_factory=dict)  # "shard-000" -> [tenant, ...]
    audit: Optional[dict] = None                       # ANN recall audit (index-builder audit)
    reconciliation: Optional[dict] = None              # count reconciliation (before publish)
    compacted_from: Optional[str] = None               # build this one compacts
    log_positions: dict = field(default_factory=dict)  # "shard-000" -> write-log position included
    audit_queries: Optional[str] = None                # held-out audit queries file in the build
    audit_queries_file: Optional[dict] = None          # its {bytes, sha256}, checked before use
    format: int = DESCRIPTOR_FORMAT                    # raised only by a change older servers must not ignore
    # fields of a newer index-builder this version skips: kept through a rewrite of the same
    # build (an audit's record), dropped by a new build made from it (a compaction)
    unknown: dict = field(default_factory=dict, compare=False, repr=False)

    def to_json(self) -> str:
        data = asdict(self)
        data = {**data.pop("unknown"), **data}
        if data["format"] == 1:  # written only once raised: servers older than the field refuse
            del data["format"]   # any key they do not know
        return json.dumps(data, indent=2, sort_keys=True)

    def for_tenant(self, tenant: str) -> "ReleaseDescriptor":
        """The view a tenant-scoped admin gets: no other tenant's name or size appears in it -
        no collection-wide count either (the whole minus its own is the others' size), so the
        per-shard counts go and the reconciliation keeps only its verdict."""
        from dataclasses import replace

        own = self.tenants.get(tenant, 0)
        recon = self.reconciliation
        return replace(
            self, tenants={tenant: own} if own else {},
            dedicated_tenants={s: [t for t in ts if t == tenant]
                               for s, ts in self.dedicated_tenants.items() if tenant in ts},
            # file sizes count rows too (outside QA: (bytes - 128) / 8 of rows.npy per shard;
            # the audit queries' file, min(200, chunks) of them, a small build's chunk count)
            shard_counts={}, log_positions={}, shard_files={}, audit_queries_file=None,
            reconciliation=None if recon is None else {k: recon[k] for k in ("passed", "reconciled_at")
                                                       if k in recon},
            audit=None if self.audit is None else _audit_for_tenant(self.audit),
            chunks=own, documents=0, unknown={})

    @classmethod
    def from_json(cls, text: str, source: Path) -> "ReleaseDescriptor":
        """Fields this version does not know (a newer index-builder wrote the build) are
        skipped, unless the descriptor's format says they must not be: a builder upgraded before
        its servers made every new build unloadable, reported as a corrupt file (outside QA)."""
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError(f"a JSON object is expected, not {type(data).__name__}")
            fmt = data.get("format", 1)
            if isinstance(fmt, int) and not isinstance(fmt, bool) and fmt > DESCRIPTOR_FORMAT:
                raise FailedPrecondition(
                    f"release descriptor {source} is of format {fmt}, written by a newer "
                    f"index-builder; this server reads format {DESCRIPTOR_FORMAT}: upgrade the "
                    "server to serve it")
            known = set(cls.__dataclass_fields__) - {"unknown"}
            unknown = {k: v for k, v in data.items() if k not in known}
            if unknown:
                key = (str(source), data.get("collection"), data.get("build_id"))
                if key not in _WARNED_UNKNOWN:
                    _WARNED_UNKNOWN.add(key)
                    log.warning("release descriptor %s (%s build %s) has fields this version "
                                "does not know (%s), written by a newer index-builder: not used "
                                "here, kept when the descriptor is rewritten", source,
                                data.get("collection"), data.get("build_id"),
                                ", ".join(sorted(unknown)))
            return cls(**{k: v for k, v in data.items() if k in known}, unknown=unknown)
        except (ValueError, TypeError) as exc:
            raise IndexCorruptError(f"release descriptor {source} is invalid: {exc}") from exc


def shard_dir_name(shard_no: int) -> str:
    return f"shard-{shard_no:03d}"


def check_name(name: str, what: str = "collection") -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise InvalidArgument(f"{what} name {str(name)[:80]!r} must match {NAME.pattern}")
    return name


def readable_by_all(root: Path, recursive: bool = True) -> None:
    """Add read (and, for directories, search) permission for everyone under `root` (or on `root`
    alone): a build is served read-only, often by another user than the one that built it, and
    some writers (tantivy's meta.json, temporary-file renames) create files readable by their
    owner only."""
    for path in [root, *(Path(root).rglob("*") if recursive else ())]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        extra = (stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH
                 | ((stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH) if path.is_dir() else 0))
        if mode & extra != extra:
            path.chmod(mode | extra)


def atomic_write(path: Path, text: str) -> None:
    """Write to a temporary file in the same directory, fsync, rename over the target."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600: servers may run as another user than the builder
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class CollectionStore:
    """Reads and writes the on-disk layout above; holds no open indexes."""

    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir)

    @property
    def writable(self) -> bool:
        """Whether builds can be written here (compaction, sweeps); serving needs only reads."""
        return os.access(self.data_dir, os.W_OK)

    def collection_dir(self, name: str) -> Path:
        return self.data_dir / check_name(name)

    def build_dir(self, name: str, build_id: str) -> Path:
        return self.collection_dir(name) / "builds" / check_name(build_id, "build")

    def collections(self, unpublished: bool = False) -> list[str]:
        """Published collections; with `unpublished`, also those with builds but no alias yet."""
        if not self.data_dir.is_dir():
            return []
        return sorted(p.name for p in self.data_dir.iterdir()
                      if (p / "ALIAS").is_file() or (unpublished and NAME.match(p.name)
                                                     and self.builds(p.name)))

    def builds(self, name: str) -> list[str]:
        """The finished builds: not a staging directory (`.tmp-*`: a build or compaction being
        written, or a removal cut short), which holds a descriptor too (review: prune failed on
        one)."""
        d = self.collection_dir(name) / "builds"
        return sorted(p.name for p in d.iterdir()
                      if NAME.match(p.name) and (p / DESCRIPTOR).is_file()) if d.is_dir() else []

    def alias(self, name: str) -> dict:
        path = self.collection_dir(name) / "ALIAS"
        if not path.is_file():
            raise NotFound(f"collection {name!r} does not exist (no published build)")
        try:
            return json.loads(path.read_text())
        except ValueError as exc:
            raise IndexCorruptError(f"alias file {path} is invalid: {exc}") from exc

    @contextmanager
    def staging(self, name: str, build_id: str) -> Iterator[Path]:
        """A temporary directory for a new build (offline build or compaction), renamed into
        builds/<build_id> when the block succeeds and removed when it fails.

        The staging directory `builds/.tmp-<id>` is guarded by an flock on `builds/.tmp-<id>.lock`,
        held for the whole build: the kernel drops it when the process dies (even by SIGKILL), so
        `sweep_abandoned` can tell a build in progress from one whose process is gone."""
        final = self.build_dir(name, build_id)
        if final.exists():
            raise FileExistsError(f"build {final} already exists")
        builds = final.parent
        lock_path = builds / f".tmp-{build_id}.lock"
        for attempt in range(3):
            made = [p for p in (self.data_dir, builds.parent, builds) if not p.exists()]
            try:
                builds.mkdir(parents=True, exist_ok=True)
                for path in made:  # a strict umask (077) made them owner-only: another user's
                    readable_by_all(path, recursive=False)  # server could not reach the builds
                    # inside (an existing directory keeps the mode its owner gave it)
                self.sweep_abandoned(name)
                fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
                break
            except FileNotFoundError:  # a concurrent first build of this collection failed and
                if attempt == 2:        # removed the empty directories it found (review)
                    raise
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise FileExistsError(f"build {build_id} of {name!r} is being written by another "
                                      "process") from None
            tmp = builds / f".tmp-{build_id}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            try:
                yield tmp
                readable_by_all(tmp)
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            finally:
                try:
                    os.unlink(lock_path)
                except FileNotFoundError:
                    pass
        except BaseException:
            # a build that failed (a NaN vector, too few training vectors) leaves no trace: the
            # directories made for it go too, when nothing else is in them (outside QA: an
            # empty DATA/<name>/builds/ after each refused build)
            for path in reversed(made):
                try:
                    path.rmdir()
                except OSError:  # not empty: another build's, or a concurrent builder's
                    break
            raise
        finally:
            os.close(fd)

    def sweep_abandoned(self, name: str, remove: bool = True) -> list[str]:
        """Remove staging directories (`builds/.tmp-*`) whose builder is gone: its lock is free (a
        killed build or compaction) or it has none (left by an older release). A build in
        progress holds its lock and is left alone. Returns what was removed - or, `remove`
        False, what would be (prune --dry-run), touching nothing."""
        builds = self.collection_dir(name) / "builds"
        removed = []
        if not builds.is_dir():
            return removed
        for tmp in sorted(builds.glob(".tmp-*")):
            if not tmp.is_dir():
                continue
            lock_path = builds / f"{tmp.name}.lock"
            try:
                # (read-only to look: a dry run by another user than the builder's may)
                fd = os.open(lock_path, os.O_RDWR | os.O_CREAT if remove else os.O_RDONLY, 0o644)
            except FileNotFoundError:  # no lock at all (only looked for when not removing)
                removed.append(tmp.name)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # a builder is writing it now
            try:
                if remove:
                    shutil.rmtree(tmp, ignore_errors=True)
                    log.warning("removed %s: a build or compaction that did not finish", tmp)
                removed.append(tmp.name)
            finally:
                if remove:
                    try:
                        os.unlink(lock_path)
                    except FileNotFoundError:
                        pass
                os.close(fd)
        for stale in builds.glob(".tmp-*.lock") if remove else ():  # locks of builders that
            if not (builds / stale.name[:-len(".lock")]).exists():  # died before mkdir
                try:
                    if time.time() - stale.stat().st_mtime > 3600:
                        stale.unlink()
                except FileNotFoundError:
                    pass
        return removed

    def live_build(self, name: str) -> str:
        return self.alias(name)["live"]

    def descriptor(self, name: str, build_id: str) -> ReleaseDescriptor:
        path = self.build_dir(name, build_id) / DESCRIPTOR
        if not path.is_file():
            raise NotFound(f"build {build_id!r} of collection {name!r} has no {DESCRIPTOR}")
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError) as exc:  # a flipped byte: name the file
            raise IndexCorruptError(f"release descriptor {path} is unreadable: {exc}") from exc
        return ReleaseDescriptor.from_json(text, path)

    def write_descriptor(self, desc: ReleaseDescriptor) -> None:
        atomic_write(self.build_dir(desc.collection, desc.build_id) / DESCRIPTOR, desc.to_json())

    def file_problems(self, name: str, build_id: str, audit_queries: bool = True,
                      hashes: bool = True) -> list[str]:
        """What is wrong with the build's files against what it recorded of them: every shard's
        document store must be there, and every recorded file must have its size and sha256
        (the held-out audit queries unless `audit_queries` is False: an audit given its own;
        sizes only with `hashes=False`)."""
        from server.backends.dense import recorded_problems

        desc = self.descriptor(name, build_id)
        build_dir = self.build_dir(name, build_id)
        problems = []
        for s in range(desc.shards):
            shard = shard_dir_name(s)
            store = build_dir / shard / "docstore.sqlite"
            if not store.is_file():
                problems.append(f"missing {store}")
            problems += recorded_problems(build_dir / shard, desc.shard_files.get(shard, {}), hashes)
        if audit_queries and desc.audit_queries and desc.audit_queries_file:
            problems += recorded_problems(build_dir, {desc.audit_queries: desc.audit_queries_file},
                                          hashes)
        return problems

    def verify_files(self, name: str, build_id: str) -> None:
        """The build's files are whole (file_problems): a build damaged after its audit is
        refused at publish, not found by each server that follows the alias (and by the next
        start, which would fail)."""
        problems = self.file_problems(name, build_id)
        if problems:
            raise FailedPrecondition(f"build {build_id}: {problems[0]}; not published")

    def publish(self, name: str, build_id: str, require_audit: bool = True,
                min_recall: Optional[float] = None, verify_files: bool = True,
                expect_live: Optional[str] = None) -> dict:
        """Point the alias at `build_id` in one atomic write; the old live build becomes `previous`.
        Refused unless the build's recall audit and count reconciliation passed and its files
        are whole (`verify_files`; a compaction that has just written and audited them skips it),
        and, with `expect_live`, unless that build is still the live one (a compaction of it must
        not undo a build an operator published meanwhile). Publishers take turns on an flock."""
        desc = self.descriptor(name, build_id)
        if verify_files:  # first: a damaged build is damaged whatever its audit (outside QA: it
            self.verify_files(name, build_id)  # was told to run an audit, which then said so)
        if require_audit:
            audit = desc.audit
            if not audit:
                raise FailedPrecondition(f"build {build_id} has no recall audit; run index-builder audit")
            recon = desc.reconciliation
            if not recon or not recon.get("passed"):
                raise FailedPrecondition(
                    f"build {build_id} count reconciliation "
                    + ("was not run; run index-builder audit" if not recon
                       else "failed: " + "; ".join(recon.get("mismatches", []))) + "; not published")
            # an explicit min_recall replaces the audit's own threshold, lower or higher (the
            # operator's decision); without one the audit must have passed its threshold
            threshold = min_recall if min_recall is not None else audit.get("min_recall", 0.0)
            passed = audit.get("passed") if min_recall is None else True
            if not passed or audit.get("recall", 0.0) < threshold:
                raise FailedPrecondition(
                    f"build {build_id} recall@{audit.get('k')} = {audit.get('recall'):.4f} is below "
                    f"the required {threshold:.4f}; not published")
        alias_path = self.collection_dir(name) / "ALIAS"
        with open(self.collection_dir(name) / ".ALIAS.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released on close, or by the kernel if we die
            previous, before = None, None
            if alias_path.is_file():
                current = self.alias(name)
                previous, before = current.get("live"), current.get("previous")
            if expect_live is not None and previous != expect_live:
                raise FailedPrecondition(
                    f"{name}: build {previous} was published while {build_id} was made from "
                    f"{expect_live}; {build_id} not published")
            if not (self.build_dir(name, build_id) / DESCRIPTOR).is_file():  # pruned meanwhile
                raise NotFound(f"build {build_id!r} of collection {name!r} is gone (pruned?); "
                               f"not published")
            # publishing the live build again keeps its rollback target (outside QA: it was lost)
            alias = {"live": build_id, "previous": previous if previous != build_id else before}
            # when each build left live/previous: prune keeps one a lagging server may still read
            left = dict(current.get("left", {})) if alias_path.is_file() else {}
            for b in (previous, before):
                if b and b not in alias.values():
                    left[b] = time.time()
            for b in alias.values():
                left.pop(b, None)
            if left:
                alias["left"] = dict(sorted(left.items(), key=lambda kv: kv[1])[-32:])
            atomic_write(alias_path, json.dumps(alias))
        return alias

    # --- retention -----------------------------------------------------------------------------
    def retention(self, name: str, keep: int, grace_s: float = 0.0,
                  now: Optional[float] = None) -> list[tuple[str, bool, str]]:
        """Which builds of `name` to keep, and why: (build id, kept, reason), newest first. Kept:
        the live build and its rollback target (`previous`), the `keep` newest builds, those
        made or that left the alias less than `grace_s` ago (one being audited and published
        now; one a server that has not followed yet still reads: the exact vectors are
        memory-mapped from the build), and every build any of these was compacted from: a
        compacted build's base holds its source's writes, its own log does not, so a later
        publish of it or of a corpus build over it replays its sources' logs (re-probe: a build
        kept as one of the newest lost its source, and publishing it later lost that source's
        writes). A build whose descriptor cannot be read is kept (it may be one an operator is
        repairing)."""
        alias = self.alias(name)
        now = time.time() if now is None else now
        descs: dict = {}
        damaged = set()
        for b in self.builds(name):
            try:
                descs[b] = self.descriptor(name, b)
            except (IndexCorruptError, KeyError, TypeError, ValueError):
                damaged.add(b)
        made = {b: d.created_at or 0.0 for b, d in descs.items()}
        newest = sorted(made, key=lambda b: (made[b], b), reverse=True)
        why: dict[str, str] = {}
        for role, b in (("the live build", alias.get("live")),
                        ("the rollback target", alias.get("previous"))):
            if b in made:
                why.setdefault(b, role)
        for b in newest[:max(0, keep)]:
            why.setdefault(b, f"one of the {keep} newest")
        for b in newest:
            if now - made[b] < grace_s:
                why.setdefault(b, f"made {(now - made[b]) / 60:.0f} min ago (--grace-s {grace_s:g})")
        for b, when in alias.get("left", {}).items():
            if b in made and now - float(when) < grace_s:
                why.setdefault(b, f"left the alias {(now - float(when)) / 60:.0f} min ago "
                                  f"(--grace-s {grace_s:g})")
        for head in list(why):
            source, seen = descs[head].compacted_from, {head}
            while source and source in made and source not in seen:
                seen.add(source)
                why.setdefault(source, f"{head} ({why[head]}) was compacted from it")
                source = descs[source].compacted_from
        for b in damaged:
            why[b] = "its descriptor is unreadable"
        return [(b, b in why, why.get(b, "")) for b in newest + sorted(damaged)]

    def build_size(self, name: str, build_id: str) -> int:
        """Bytes of the build's files."""
        return sum(st.st_size for st in (p.lstat() for p in self.build_dir(name, build_id).rglob("*"))
                   if stat.S_ISREG(st.st_mode))

    def remove_build(self, name: str, build_id: str) -> int:
        """Remove one build's directory - never the live build or its rollback target (checked
        under the alias lock, which publishers take: a publish cannot flip to it meanwhile).
        Renamed to a staging name first, so a removal cut short is swept, never half served.
        Returns the bytes freed."""
        path = self.build_dir(name, build_id)
        size = self.build_size(name, build_id)  # before the lock: publishers wait on it
        with open(self.collection_dir(name) / ".ALIAS.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            alias = self.alias(name)
            if build_id in (alias.get("live"), alias.get("previous")):
                raise FailedPrecondition(f"build {build_id} of {name!r} is the live build or its "
                                         f"rollback target; not removed")
            doomed = path.parent / f".tmp-pruned-{build_id}"
            os.rename(path, doomed)
        shutil.rmtree(doomed)  # an error says so (the staging name is swept later)
        return size

