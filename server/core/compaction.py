"""Compaction: a new build holding only the live chunks of the live build.

Dead and orphaned rows (tombstones) are dropped, rows are renumbered, every index is rebuilt from
the exact vectors (no re-embedding), and the documents table travels whole, tombstones included,
so replays of older versions stay no-ops. Writes that land while compaction runs are in the old
build's write log after the snapshot's sequence number; the switch replays them before the flip.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import shutil
import time

import numpy as np

from server.backends.lexical import ANALYZER_VERSION
from server.core.audit import AUDIT_QUERIES
from server.core.build_writer import write_shard
from server.core.collection import CollectionStore, atomic_write, shard_dir_name
from server.core.engine.index import crash_point

REPLAY_FILE = "replay.json"  # {source build id: {shard number: last replayed write seq}}


def compact_build(store: CollectionStore, loaded, seed: int = 0):
    """Write the compacted build (not published). Returns its descriptor."""
    desc = loaded.desc
    build_id = time.strftime("%Y%m%dT%H%M%S") + "-c" + secrets.token_hex(3)
    rng = np.random.default_rng(seed)
    files, counts, tenants, dedicated, marker = {}, {}, {}, {}, {}
    version_hash = hashlib.sha256(desc.corpus_version.encode())
    with store.staging(desc.collection, build_id) as tmp_dir:
        log_positions = {}
        for local in loaded.shards:
            shard = local.index  # compaction runs in the engine that owns the shards
            with shard._write_mutex:  # a snapshot consistent with its write-log position
                records = shard.store.live_records()
                documents = shard.store.documents()
                seq = shard.store.last_write_seq()
                applied = shard.applied_seq
                x = shard.vectors[np.array([r.row for r in records], dtype=np.int64)]
            records = [dataclasses.replace(r, row=i) for i, r in enumerate(records)]
            name = shard_dir_name(shard.shard_no)
            dedicated_min = None
            if desc.dedicated_tenants.get(name):  # keep dedicated tenants dedicated
                dedicated_min = min(shard.tenant_counts.get(t, 0) for t in desc.dedicated_tenants[name])
            out = write_shard(tmp_dir / name, records, np.asarray(x, np.float32), documents,
                              desc.factory, desc.metric, rng, dedicated_min, desc.corpus_version,
                              build_id)
            files[name], counts[name] = out.files, out.counts
            for t, n in out.tenants.items():
                tenants[t] = tenants.get(t, 0) + n
            if out.dedicated:
                dedicated[name] = out.dedicated
            marker[str(shard.shard_no)] = seq
            log_positions[name] = applied
            version_hash.update(f"{shard.shard_no}:{shard.index_version}".encode())
            crash_point("compaction_after_shard")
        new = dataclasses.replace(
            desc, build_id=build_id, created_at=time.time(), shard_files=files, shard_counts=counts,
            tenants=tenants, dedicated_tenants=dedicated, audit=None, reconciliation=None,
            documents=sum(c["documents"] for c in counts.values()),
            chunks=sum(c["chunks"] for c in counts.values()), compacted_from=desc.build_id,
            corpus_version=version_hash.hexdigest()[:16], log_positions=log_positions,
            # the BM25 index is written anew from the text, with this version's analyzer: the
            # label must say so, or its queries would be analysed as the source's were (review:
            # a v2 build compacted held "cafe" and was asked for "café")
            lexical_analyzer=ANALYZER_VERSION, unknown={})
        (tmp_dir / "release.json").write_text(new.to_json())
        (tmp_dir / REPLAY_FILE).write_text(json.dumps({desc.build_id: marker}))
        held_out = store.build_dir(desc.collection, desc.build_id) / AUDIT_QUERIES
        if held_out.is_file():  # the new build is audited with the source's held-out queries
            shutil.copyfile(held_out, tmp_dir / AUDIT_QUERIES)
    return new


def read_replay_marker(state_build_dir, build_dir=None) -> dict:
    """Replay progress: the state's copy when the server has replayed into this build, else the
    marker the build was written with (compaction records where its snapshot stopped)."""
    for d in (state_build_dir, build_dir):
        if d is not None and (d / REPLAY_FILE).is_file():
            return json.loads((d / REPLAY_FILE).read_text())
    return {}


def write_replay_marker(state_build_dir, marker: dict) -> None:
    atomic_write(state_build_dir / REPLAY_FILE, json.dumps(marker))
