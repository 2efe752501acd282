"""The fan-out policy (server/core/replicas.py) against in-process replicas whose behaviour each
test scripts: which errors retry, which fail fast, hedging and its budget, cancellation of the
loser, least-outstanding choice; and the corpus-version check on fused candidates."""
import asyncio

import pytest

from server.core.replicas import HedgePolicy, ReplicaSet
from server.core.types import ShardQuery, ShardResult
from server.errors import (CorpusVersionMismatch, DeadlineExceeded, InvalidArgument, ReplicaOverloaded,
                           Unavailable)


class Replica:
    """Answers per a script: "ok", "slow" (never answers until cancelled), or an exception."""

    def __init__(self, name, behaviour="ok"):
        self.address, self.behaviour = name, behaviour
        self.calls, self.cancelled = 0, 0

    async def search(self, queries, timeout=None):
        self.calls += 1
        if self.behaviour == "slow":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if isinstance(self.behaviour, Exception):
            raise self.behaviour
        return [ShardResult(0, "v1", [], [], 0.0, 0.0) for _ in queries]


Q = [ShardQuery("b", "t", None, "m", "text", 10, 10)]
FAST_HEDGE = HedgePolicy(hedge_min_ms=1, hedge_max_ms=5, hedge_budget=1.0)


def run(coro):
    return asyncio.run(coro)


def test_invalid_argument_fails_fast_and_is_not_retried():
    a, b = Replica("a", InvalidArgument("bad vector")), Replica("b")
    rs = ReplicaSet(0, [a, b], HedgePolicy(enabled=False))
    with pytest.raises(InvalidArgument, match="bad vector"):
        run(rs.search(Q, 5))
    assert (a.calls, b.calls) == (1, 0)


def test_unavailable_is_retried_on_the_next_replica():
    a, b = Replica("a", Unavailable("down")), Replica("b")
    rs = ReplicaSet(0, [a, b], HedgePolicy(enabled=False))
    assert run(rs.search(Q, 5))[0].corpus_version == "v1"
    assert (a.calls, b.calls) == (1, 1) and rs.stats["retries"] == 1


def test_a_replica_that_cannot_answer_its_queries_now_is_retried_elsewhere_without_a_strike():
    """A replica that has not applied the write a read-your-writes query names, and cannot ask
    the write log (NATS down), answers each query UNAVAILABLE: another replica that applied it
    answers instead; the first is not struck (it answered at once, and is healthy)."""
    a, b = Replica("a"), Replica("b")

    async def not_yet(queries, timeout=None):
        a.calls += 1
        return [Unavailable("shard 0 has applied the write log to 5, not yet 9, and cannot ask "
                            "the log") for _ in queries]

    a.search = not_yet
    rs = ReplicaSet(0, [a, b], HedgePolicy(enabled=False))
    for _ in range(4):  # more than eject_after: answering is not a strike
        answers = run(rs.search(Q, 5))
        assert answers[0].corpus_version == "v1" and answers[0].replica in ("a", "b")
    assert a.calls >= 1 and rs.health[0].strikes == 0 and rs.stats["ejections"] == 0
    # where no replica can, the caller hears UNAVAILABLE naming each replica's answer
    b.search = not_yet
    with pytest.raises(Unavailable, match="2 of 2 replicas failed.*not yet 9"):
        run(rs.search(Q, 5))


def test_a_replica_that_is_down_is_ejected_not_tried_before_every_search():
    """Outside QA: a replica refusing connections fails in microseconds, so it never had calls
    outstanding and looked the least loaded: with it down, every search paid a failing call
    first (600-1,300 in 5 s). UNAVAILABLE now strikes it like a timeout, without counting its
    instant failure as a fast answer."""
    down, up = Replica("down", Unavailable("connection refused")), Replica("up")
    rs = ReplicaSet(0, [down, up], HedgePolicy(enabled=False))

    async def many():
        for _ in range(40):
            assert (await rs.search(Q, 5))[0].corpus_version == "v1"

    run(many())
    assert down.calls == HedgePolicy().eject_after  # then ejected for the rest of the second
    assert up.calls == 40 and rs.stats["ejections"] == 1
    assert rs.health[0].ewma_ms >= rs.health[1].ewma_ms  # its failures did not read as speed


def test_an_overloaded_replica_is_retried_elsewhere_but_never_ejected_and_an_answer_ends_ejection():
    """Review: shedding (RESOURCE_EXHAUSTED) comes in bursts when capacity is short, and ejecting
    replicas for it would shrink capacity further; and a replica that answers again is back in
    rotation at once, not after its ejection runs out."""
    busy, up = Replica("busy", ReplicaOverloaded("shed")), Replica("up")
    rs = ReplicaSet(0, [busy, up], HedgePolicy(enabled=False))

    async def many(n):
        for _ in range(n):
            assert (await rs.search(Q, 5))[0].corpus_version == "v1"

    run(many(20))
    assert rs.stats["ejections"] == 0 and busy.calls >= 3
    down = Replica("down", Unavailable("refused"))
    rs = ReplicaSet(0, [down, Replica("other")], HedgePolicy(enabled=False))
    run(many(5))
    assert not rs.health[0].in_rotation(rs._clock())
    down.behaviour = "ok"  # it recovers: the next call that reaches it (probation) answers
    rs._success(0, 1.0)
    assert rs.health[0].in_rotation(rs._clock())
    for _ in range(HedgePolicy().eject_after):  # slow (stopped): its first answers are backlog,
        rs._strike(0, 2000.0)                   # so it serves out its ejection
    rs._success(0, 2000.0)
    assert not rs.health[0].in_rotation(rs._clock())


def test_when_every_replica_fails_the_error_sums_them_up():
    rs = ReplicaSet(3, [Replica("a", Unavailable("down")), Replica("b", Unavailable("reset"))],
                    HedgePolicy(enabled=False))
    with pytest.raises(Unavailable, match=r"shard 3: 2 of 2 replicas failed: a .*down.*; b .*reset"):
        run(rs.search(Q, 5))


def test_replicas_that_all_ran_out_of_time_answer_deadline_exceeded_not_unavailable():
    """Review: a replica's own DEADLINE_EXCEEDED can arrive before the set's timer fires for the
    same deadline; with no replica left the caller heard UNAVAILABLE (retry) for a deadline."""
    late = ReplicaSet(2, [Replica("a", DeadlineExceeded("Deadline Exceeded"))], HedgePolicy(enabled=False))
    with pytest.raises(DeadlineExceeded, match=r"shard 2: 1 of 1 replicas failed: a "):
        run(late.search(Q, 5))
    mixed = ReplicaSet(2, [Replica("a", DeadlineExceeded("late")), Replica("b", Unavailable("down"))],
                       HedgePolicy(enabled=False))
    with pytest.raises(Unavailable) as err:  # one was down, with time left: UNAVAILABLE still
        run(mixed.search(Q, 5))
    assert not isinstance(err.value, DeadlineExceeded)


def test_a_slow_replica_is_hedged_and_the_loser_cancelled():
    slow, fast = Replica("slow", "slow"), Replica("fast")
    rs = ReplicaSet(0, [slow, fast], FAST_HEDGE)
    rs._rr = iter(range(0, 10 ** 6, 2))  # ties go to replica 0 (the slow one) first
    assert run(rs.search(Q, 5))[0].corpus_version == "v1"
    assert slow.calls == 1 and fast.calls == 1
    assert slow.cancelled == 1 and rs.stats["hedges"] == 1 and rs.stats["hedges_won"] == 1


def test_a_call_a_hedge_won_against_is_timed_as_abandoned_not_dropped():
    """Outside QA: the per-replica latency only saw answered calls, so the slow calls hedging
    cancels vanished and a slow replica's p99 looked like a healthy one's."""
    from prometheus_client import REGISTRY

    def sample(name, replica):
        return REGISTRY.get_sample_value(name, {"shard": "7", "replica": replica}) or 0.0

    slow, fast = Replica("slow-7", "slow"), Replica("fast-7")
    rs = ReplicaSet(7, [slow, fast], FAST_HEDGE)
    rs._rr = iter(range(0, 10 ** 6, 2))  # the slow one first
    before = (sample("search_shard_abandoned_seconds_count", "slow-7"),
              sample("search_shard_seconds_count", "fast-7"))
    run(rs.search(Q, 5))
    assert sample("search_shard_abandoned_seconds_count", "slow-7") == before[0] + 1
    assert sample("search_shard_abandoned_seconds_sum", "slow-7") > 0
    assert sample("search_shard_seconds_count", "fast-7") == before[1] + 1


def test_without_hedge_budget_a_hung_replica_meets_the_deadline():
    slow, fast = Replica("slow", "slow"), Replica("fast")
    rs = ReplicaSet(0, [slow, fast], HedgePolicy(hedge_min_ms=1, hedge_max_ms=5, hedge_budget=0.0,
                                                 hedge_burst=0.0))
    rs._rr = iter(range(0, 10 ** 6, 2))
    with pytest.raises(DeadlineExceeded):
        run(rs.search(Q, 0.2))
    assert fast.calls == 0 and slow.cancelled == 1


def test_with_the_budget_spent_a_stalled_call_is_still_retried_on_another_replica():
    """No tokens and no other traffic to refill them: a call with no answer after `stall_ms` is
    stalled, and the second replica is tried anyway - it used to wait out its whole deadline."""
    slow, fast = Replica("slow", "slow"), Replica("fast")
    rs = ReplicaSet(0, [slow, fast], HedgePolicy(hedge_min_ms=1, hedge_max_ms=5, hedge_budget=0.0,
                                                 hedge_burst=0.0, stall_ms=50))
    rs._rr = iter(range(0, 10 ** 6, 2))
    assert run(rs.search(Q, 30))[0].corpus_version == "v1"
    assert (slow.calls, fast.calls) == (1, 1) and slow.cancelled == 1
    assert rs.stats["stall_retries"] == 1 and rs.stats["hedges_won"] == 1


def test_least_outstanding_replica_is_picked_first():
    a, b = Replica("a"), Replica("b")
    rs = ReplicaSet(0, [a, b], HedgePolicy(enabled=False))
    rs.outstanding = [3, 0]
    run(rs.search(Q, 5))  # (outstanding + 1) x latency: 4 x 1 against 1 x 1
    assert (a.calls, b.calls) == (0, 1)


def test_a_replica_slow_once_earns_back_its_share_as_the_evidence_fades():
    """Regression: the pick used a latency EWMA that moved only when a replica answered, so a
    replica slow once (one 100 ms stall) got no traffic until its sibling had ~30 calls
    outstanding: under moderate load one replica served everything."""
    a, b = Replica("a"), Replica("b")
    rs = ReplicaSet(0, [a, b], HedgePolicy(enabled=False, ewma_half_life_s=1.0))
    now = [100.0]
    rs._clock = lambda: now[0]
    rs._success(0, 100.0)          # a: one stall -> EWMA 30.7 ms
    rs._success(1, 1.0)            # b: 1 ms
    rs.outstanding = [0, 1]        # b is busy with one call: 2 x 1 ms against 1 x 30.7 ms
    run(rs.search(Q, 5))
    assert (a.calls, b.calls) == (0, 1)   # fresh evidence: still the fast replica
    now[0] += 10.0                 # ten half-lives without an answer from a: 2 x 1 against ~1 x 1
    rs.outstanding = [0, 1]
    run(rs.search(Q, 5))
    assert (a.calls, b.calls) == (1, 1)


def test_candidates_from_another_corpus_version_are_never_fused(small_collection, tiny_embedder):
    from conftest import make_core
    from server.core.registry import LoadedCollection
    from server.core.types import SearchQuery

    data, desc = small_collection

    class OtherVersion(Replica):
        def __init__(self, shard_no):
            super().__init__(f"r{shard_no}")
            self.shard_no = shard_no

        @property
        def cache_version(self):
            return None

        async def search(self, queries, timeout=None):
            return [ShardResult(self.shard_no, "another-version", [], [], 0.0, 0.0) for _ in queries]

    core = make_core(data, tiny_embedder)
    core.attach(LoadedCollection(desc, [OtherVersion(i) for i in range(desc.shards)]))

    async def go():
        return await core.search(SearchQuery("cran", text="flow", top_k=5, mode="lexical"), "default")

    with pytest.raises(CorpusVersionMismatch, match="another-version"):
        run(go())


def test_answers_name_their_replica_and_a_pinned_round_asks_that_replica_first():
    """A feedback round pinned to the replica that answered the first round goes to it, not to
    the replica the policy would pick; under the usual policy otherwise: a pinned replica that
    stalls is hedged to another one, whose answer the pipeline then checks."""
    from dataclasses import replace

    a, b = Replica("a"), Replica("b")
    rs = ReplicaSet(0, [a, b], FAST_HEDGE)
    rs._rr = iter(range(0, 10 ** 6, 2))  # the policy prefers replica 0 ("a")
    assert [r.replica for r in run(rs.search(Q, 5))] == ["a"]
    pinned = [replace(q, replica="b") for q in Q]
    assert [r.replica for r in run(rs.search(pinned, 5))] == ["b"]
    assert (a.calls, b.calls) == (1, 1) and rs.stats["hedges"] == 0
    b.behaviour = "slow"
    assert [r.replica for r in run(rs.search(pinned, 30))] == ["a"]  # hedged, not waited out
    assert (a.calls, b.calls, b.cancelled) == (2, 2, 1) and rs.stats["hedges"] == 1


def test_a_pinned_round_on_a_lone_slow_replica_gets_the_whole_deadline():
    class Slowish(Replica):
        async def search(self, queries, timeout=None):
            await asyncio.sleep(0.05)  # slower than hedge_max_ms (5 ms): a slow round, not a stall
            return await super().search(queries, timeout)

    from dataclasses import replace

    only = Slowish("only")
    rs = ReplicaSet(0, [only], FAST_HEDGE)
    assert [r.replica for r in run(rs.search([replace(q, replica="only") for q in Q], 5))] == ["only"]


def test_a_feedback_round_is_pinned_per_shard_to_the_first_rounds_replica():
    """The pipeline pins each shard of a follow-up round to the replica that answered all of the
    group's first-round queries there; a shard answered by two replicas (or by a shard with no
    replicas) is left to the policy."""
    from server.config import PipelineConfig
    from server.core.pipeline import QueryPipeline, _Query

    class Shard:
        def __init__(self, no):
            self.shard_no, self.got = no, []

        async def search(self, queries, timeout=None):
            self.got.append([q.replica for q in queries])
            return [ShardResult(self.shard_no, "v1", [], [], 0.0, 0.0) for _ in queries]

    class Coll:
        shards = [Shard(0), Shard(1), Shard(2)]

    group = [_Query(None), _Query(None)]
    group[0].shard_results = [ShardResult(0, "v1", [], [], replica="r0b"),
                              ShardResult(1, "v1", [], [], replica="r1a"),
                              ShardResult(2, "v1", [], [])]
    group[1].shard_results = [ShardResult(0, "v1", [], [], replica="r0b"),
                              ShardResult(1, "v1", [], [], replica="r1b"),
                              ShardResult(2, "v1", [], [])]
    pipeline = QueryPipeline(None, None, PipelineConfig(), 0, None)
    run(pipeline._fan_out(Coll(), group, None, feedback=[Q[0], Q[0]]))
    assert [s.got for s in Coll.shards] == [[["r0b", "r0b"]], [["", ""]], [["", ""]]]


def test_a_second_round_is_used_only_when_it_saw_the_first_rounds_data():
    """Same replica: the same index version (no write between the rounds); another replica: the
    same write-log position. Otherwise mixing the rounds could mix two versions of a document."""
    from server.core.pipeline import QueryPipeline, _Query

    st = _Query(None)
    st.shard_results = [ShardResult(0, "v1", [], [], index_version=7, applied_seq=90, replica="a")]

    def second(index_version, applied_seq, replica):
        return [ShardResult(0, "v1", [], [], index_version=index_version, applied_seq=applied_seq,
                            replica=replica)]

    assert QueryPipeline._same_data(st, second(7, 90, "a"))
    assert not QueryPipeline._same_data(st, second(8, 91, "a"))   # a write landed in between
    assert QueryPipeline._same_data(st, second(3, 90, "b"))       # another replica, same position
    assert not QueryPipeline._same_data(st, second(7, 88, "b"))   # a replica that lags


def test_a_second_round_from_other_data_is_not_mixed_in():
    """The pipeline's follow-up round: answers from a replica at another write-log position are
    left out (the first round's answer stands, with a note); answers from the same data are used."""
    from server.config import PipelineConfig
    from server.core.pipeline import QueryPipeline, _Query

    class Shard:
        shard_no = 0

        def __init__(self, applied_seq):
            self.applied_seq = applied_seq

        async def search(self, queries, timeout=None):
            return [ShardResult(0, "v1", [], [], applied_seq=self.applied_seq, replica="b")
                    for _ in queries]

    class Coll:
        name = "c"

    settled = []
    for seq in (90, 88):
        Coll.shards = [Shard(seq)]
        st = _Query(None)
        st.coll = Coll
        st.shard_results = [ShardResult(0, "v1", [], [], applied_seq=90, replica="a")]
        pipeline = QueryPipeline(None, None, PipelineConfig(), 0, None)
        run(pipeline._second_round([st], [Q[0]], None, "dense feedback",
                                   lambda st, ok: settled.append(ok[0].applied_seq)))
        if seq == 88:
            assert any("dense feedback skipped" in n for n in st.notes)
    assert settled == [90]


def test_a_fetch_asks_the_replica_that_ranked_its_rows_first():
    """Rows number one replica's chunk versions: texts and vectors are fetched from the replica
    whose answer ranked them, whatever the policy would pick."""
    from server.core.types import FetchRequest

    class Fetching(Replica):
        async def fetch(self, request, timeout=None):
            self.calls += 1
            return [self.address]

    a, b = Fetching("a"), Fetching("b")
    rs = ReplicaSet(0, [a, b], FAST_HEDGE)
    rs._rr = iter(range(0, 10 ** 6, 2))  # the policy prefers replica 0 ("a")
    req = FetchRequest("b1", "t", (), (1, 2))
    assert run(rs.fetch(req, 5)) == ["a"]
    from dataclasses import replace
    assert [run(rs.fetch(replace(req, replica="b"), 5)) for _ in range(3)] == [["b"]] * 3
    assert (a.calls, b.calls) == (1, 3)


def test_a_fetched_row_holding_another_chunk_is_dropped_never_served(small_collection,
                                                                     tiny_embedder):
    """A replica whose rows disagree with the one that ranked them (outside QA: a replica that
    crashed inside a write numbered its later rows one higher) must not put another document's
    text under a ranked hit: the fetched row's chunk id and fingerprint are checked, a mismatch
    is dropped and counted."""
    from conftest import DelegatingShard, make_core
    from server.core import metrics
    from server.core.types import SearchQuery

    data, desc = small_collection

    class ShiftedRows(DelegatingShard):
        """Shard 0 as a replica one row ahead would answer a fetch: row r holds r+1's chunk."""

        async def fetch(self, request, timeout=None):
            from dataclasses import replace
            got = await self.inner.fetch(replace(request, rows=tuple(r + 1 for r in request.rows)),
                                         timeout)
            for c in got:
                c.record.row -= 1
            return got

    def answers(core, top_k):
        async def go():
            await core.start()
            try:
                out = []
                for text in ("flow over a flat plate", "heat transfer in boundary layers",
                             "supersonic wing pressure"):
                    r = await core.search(SearchQuery("cran", text=text, top_k=top_k,
                                                      mode="lexical"), "default")
                    out.append([(h.candidate.record.doc_id, h.candidate.record.text) for h in r.hits])
                return out
            finally:
                await core.close()
        return run(go())

    sections = dict(pipeline={"text_top_n": 1, "retrieval_cache_size": 0})
    honest_core = make_core(data, tiny_embedder, **sections)
    honest_core.load()
    honest = answers(honest_core, 40)
    core = make_core(data, tiny_embedder, **sections)
    core.load()
    coll = core.registry.get("cran")
    coll.shards[0] = ShiftedRows(coll.shards[0])
    counter = metrics.FETCH_MISMATCHES.labels("cran", "0")
    before = counter._value.get()
    shifted = answers(core, 10)
    assert counter._value.get() > before  # the shifted rows were fetched, and caught
    for ranked, got in zip(honest, shifted):
        assert len(ranked) == 40 and got
        # every hit served is a hit the honest ranking has, with its own text, in its order;
        # shard 0's fetched hits dropped out
        assert got == [h for h in ranked if h in got] and got != ranked[:10]


def test_a_router_reaches_a_replica_again_within_a_second_of_its_return():
    """Outside QA re-probe: the router's channel to a replica kept gRPC's default reconnect
    backoff, which grows to 120 s: a shard whose replicas had been down ~45 s stayed unreachable
    ~18 s after both were back and SERVING. Channels to replicas now retry at least once a
    second. Here a replica is away 20 s (the default backoff then waits ~4-9 s more)."""
    import time

    import grpc

    from harness.processes import free_port
    from server.transport.shard_rpc import RemoteShard

    async def main():
        port = free_port()
        remote = RemoteShard(f"127.0.0.1:{port}", 0)
        remote.channel.get_state(try_to_connect=True)
        await asyncio.sleep(20)  # the outage itself: nothing listens, the channel keeps trying
        server = grpc.aio.server()
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        back = time.monotonic()
        try:
            await asyncio.wait_for(remote.channel.channel_ready(), 10)
            return time.monotonic() - back
        finally:
            await remote.channel.close()
            await server.stop(None)

    assert asyncio.run(main()) < 2.0
