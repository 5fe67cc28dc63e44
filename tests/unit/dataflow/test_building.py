"""Writing a dataflow: what it builds, and what is refused when built, naming the step."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from microbatch import windows
from microbatch.dataflow import Dataflow, MissingUidWarning
from microbatch.errors import ConfigError
from microbatch.runtime import EventTime, KafkaSource, KeyedProcessFunction, ParquetSink
from microbatch.runtime.steps import Tap


class Echo(KeyedProcessFunction):
    def process(self, key: Any, records: Any, ctx: Any) -> None:
        for r in records:
            ctx.emit(r)


def flow(**kw: Any) -> Dataflow:
    return Dataflow("pay", checkpoints="/tmp/cp", **kw)


def sink(name: str) -> ParquetSink:
    return ParquetSink(name, f"/tmp/{name}")


def test_a_chain_of_steps_builds_one_pipeline_with_its_spine() -> None:
    f = flow()
    first = (
        f.source(KafkaSource(topics=("payments",)))
        .filter(lambda r: r["amount"] > 0, name="positive")
        .key_by("card")
        .process(Echo(), uid="spend", outputs=[sink("alerts")])
    )
    first.map(lambda r: r, name="project").to(sink("charges"))
    first.key_by("merchant").process(Echo(), uid="merchant").to(sink("merchants"))
    pipe = f.build()
    assert pipe.uid == "spend" and pipe.key_by == "card"
    assert [s.name for s in pipe.prefix] == ["positive"]
    assert pipe.taps == (Tap("alerts", (), side=True), Tap("charges", pipe.taps[1].chain))
    assert [s.name for s in pipe.taps[1].chain] == ["project"]
    assert [(s.uid, s.key_by) for s in pipe.steps] == [("merchant", "merchant")]
    assert pipe.steps[0].taps == (Tap("merchants"),)
    assert [s.name for s in pipe.sinks] == ["alerts", "charges", "merchants"]
    assert pipe.keyed_uids == ("spend", "merchant")


def test_a_step_without_uid_is_named_after_its_position_with_a_warning() -> None:
    f = flow()
    with pytest.warns(MissingUidWarning, match="echo-1"):
        f.source(KafkaSource(topics=("t",))).key_by("k").process(Echo()).to(sink("out"))
    assert f.build().uid == "echo-1"


def test_a_uid_given_twice_is_refused() -> None:
    f = flow()
    s = f.source(KafkaSource(topics=("t",))).key_by("k").process(Echo(), uid="a")
    with pytest.raises(ConfigError, match="two keyed steps have the uid 'a'"):
        s.key_by("k").process(Echo(), uid="a")


def test_a_sink_name_used_twice_is_refused() -> None:
    f = flow()
    s = f.source(KafkaSource(topics=("t",))).key_by("k").process(Echo(), uid="a")
    s.to(sink("out"))
    with pytest.raises(ConfigError, match="sink name 'out' is used twice"):
        s.map(lambda r: r).to(sink("out"))


def test_a_window_without_event_time_is_refused_naming_the_step() -> None:
    f = flow()
    s = f.source(KafkaSource(topics=("t",))).key_by("k").process(Echo(), uid="a")
    s.key_by("k").window(windows.tumbling("1m").count().final(), uid="per-minute").to(sink("o"))
    with pytest.raises(ConfigError, match="step 'per-minute' is a window"):
        f.build()


def test_window_takes_only_a_windowed_aggregation() -> None:
    keyed = flow().source(KafkaSource(topics=("t",))).key_by("k")
    with pytest.raises(ConfigError, match="window\\(\\) takes a windowed aggregation"):
        keyed.window(Echo(), uid="w")


def test_two_keyed_steps_reading_one_stream_build_a_graph_of_edges() -> None:
    f = flow()
    s = f.source(KafkaSource(topics=("t",))).key_by("k").process(Echo(), uid="a")
    s.key_by("x").process(Echo(), uid="b").to(sink("b"))
    s.filter(bool, name="kept").key_by("y").process(Echo(), uid="c").to(sink("c"))
    pipe = f.build()
    assert pipe.keyed_uids == ("a", "b", "c")
    assert [(e.origin, e.target, e.key_by, [c.name for c in e.chain]) for e in pipe.edges] == [
        (0, "a", "k", []),
        ("a", "b", "x", []),
        ("a", "c", "y", ["kept"]),
    ]


def test_steps_run_by_depth_so_a_branch_off_the_source_rides_through_fewer_exchanges() -> None:
    f = flow()
    payments = f.source(KafkaSource(topics=("t",)))
    spend = payments.key_by("card").process(Echo(), uid="spend")
    spend.key_by("card").process(Echo(), uid="alerts").to(sink("alerts"))
    payments.key_by("merchant").process(Echo(), uid="merchants").to(sink("merchants"))
    pipe = f.build()
    assert pipe.keyed_uids == ("spend", "merchants", "alerts")  # written: spend, alerts, ...
    assert [(e.origin, e.target) for e in pipe.edges] == [
        (0, "spend"),
        (0, "merchants"),
        ("spend", "alerts"),
    ]


def test_a_source_feeding_a_later_step_and_a_union_after_keyed_steps_build_edges() -> None:
    f = flow()
    orders = f.source(KafkaSource(topics=("orders",)))
    refunds = f.source(KafkaSource(topics=("refunds",)))
    totals = orders.key_by("card").process(Echo(), uid="totals")
    merged = totals.union(refunds.map(dict, name="copy")).key_by("card")
    merged.process(Echo(), uid="ledger").to(sink("ledger"))
    pipe = f.build()
    assert [(e.origin, e.target, e.side) for e in pipe.edges] == [
        (0, "totals", 0),
        ("totals", "ledger", 0),
        (1, "ledger", 0),
    ]
    assert pipe.source.topics == ("orders", "refunds")


def test_a_join_reads_two_keyed_streams_on_sides_0_and_1() -> None:
    f = flow()
    bids = f.source(KafkaSource(topics=("bids",))).key_by("auction")
    auctions = f.source(KafkaSource(topics=("auctions",))).key_by("id")
    bids.join(auctions, Echo(), uid="joined").to(sink("out"))
    pipe = f.build()
    assert [(e.origin, e.target, e.key_by, e.side) for e in pipe.edges] == [
        (0, "joined", "auction", 0),
        (1, "joined", "id", 1),
    ]
    with pytest.raises(ConfigError, match=r"join\(\) of a stream with itself"):
        bids.join(bids, Echo(), uid="self")


def test_a_sink_fed_by_a_union_and_a_window_join_are_refused_naming_them() -> None:
    f = flow(event_time=EventTime(field="ts"))
    a = f.source(KafkaSource(topics=("a",)))
    b = f.source(KafkaSource(topics=("b",)))
    with pytest.raises(ConfigError, match="sink 'both' takes the records of one step"):
        a.union(b).to(sink("both"))
    per_minute = windows.tumbling("1m").count().final()
    a.key_by("k").join(b.key_by("k"), per_minute, uid="w").to(sink("w"))
    with pytest.raises(ConfigError, match="window step 'w' takes one input"):
        f.build()


def test_a_sink_before_the_first_keyed_step_is_a_source_tap() -> None:
    f = flow()
    src = f.source(KafkaSource(topics=("t",)))
    src.map(lambda r: r, name="project").to(sink("raw"))
    src.key_by("k").process(Echo(), uid="a").to(sink("out"))
    pipe = f.build()
    assert [(t.sink, [s.name for s in t.chain]) for t in pipe.source_taps] == [("raw", ["project"])]


def test_a_sink_before_the_first_keyed_step_of_several_sources_takes_its_sources_records() -> None:
    f = flow()
    a = f.source(KafkaSource(topics=("a",)))
    b = f.source(KafkaSource(topics=("b",)))
    b.map(dict, name="copy").to(sink("raw-b"))
    a.union(b).key_by("k").process(Echo(), uid="n").to(sink("out"))
    pipe = f.build()
    assert [(t.sink, t.source, [s.name for s in t.chain]) for t in pipe.source_taps] == [
        ("raw-b", 1, ["copy"])
    ]


def test_a_sink_no_step_feeds_and_a_dataflow_without_keyed_step_are_refused() -> None:
    f = flow()
    f.source(KafkaSource(topics=("t",)))
    with pytest.raises(ConfigError, match="no keyed step"):
        f.build()
    with pytest.raises(ConfigError, match="no source"):
        flow().build()


def test_key_by_needs_a_field_or_a_function_and_process_a_process_function() -> None:
    src = flow().source(KafkaSource(topics=("t",)))
    with pytest.raises(ConfigError, match="key_by takes a field name or a function"):
        src.key_by("")
    with pytest.raises(ConfigError, match="process\\(\\) takes a KeyedProcessFunction"):
        src.key_by("k").process(lambda k, r, c: None, uid="a")  # type: ignore[arg-type]


def test_enrich_goes_right_after_the_source() -> None:
    from microbatch.runtime import Enrichment

    src = flow().source(KafkaSource(topics=("t",)))
    with pytest.raises(ConfigError, match="enrich\\(\\) goes right after source"):
        src.map(lambda r: r).enrich(Enrichment(lambda: None))


def test_a_single_keyed_step_with_event_time_builds_like_a_pipeline() -> None:
    f = flow(event_time=EventTime(field="ts"))
    agg = windows.tumbling("1m").count().final()
    f.source(KafkaSource(topics=("t",))).key_by("k").window(agg, uid="w").to(sink("o"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe = f.build()
    assert pipe.process is agg and pipe.steps == () and pipe.taps == (Tap("o"),)


def test_a_join_given_one_input_or_no_event_time_is_refused_when_built() -> None:
    from microbatch.joins import IntervalJoin

    join = IntervalJoin("ts", "ts", between=("-1m", "1m"))
    f = flow(event_time=EventTime(field="ts"))
    bids = f.source(KafkaSource(topics=("bids",))).key_by("auction")
    with pytest.raises(ConfigError, match=r"IntervalJoin takes 2 input\(s\), but process"):
        bids.process(join, uid="j")
    with pytest.raises(ConfigError, match=r"Echo takes 1 input"):
        Echo.inputs = 1  # type: ignore[attr-defined]
        try:
            bids.join(f.source(KafkaSource(topics=("a",))).key_by("id"), Echo(), uid="e")
        finally:
            del Echo.inputs  # type: ignore[attr-defined]
    g = flow()
    left = g.source(KafkaSource(topics=("bids",))).key_by("auction")
    right = g.source(KafkaSource(topics=("auctions",))).key_by("id")
    with pytest.raises(ConfigError, match="IntervalJoin needs event time"):
        left.join(right, join, uid="j")
