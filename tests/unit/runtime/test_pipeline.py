"""Pipeline definitions are validated when built, with messages that say what to fix."""

from __future__ import annotations

import pytest

from microbatch.errors import ConfigError
from microbatch.runtime import (
    DeadLetterSink,
    EventTime,
    KafkaSource,
    KeyedProcessFunction,
    ParquetSink,
    Pipeline,
)


class Noop(KeyedProcessFunction):
    def process(self, key, records, ctx) -> None:
        pass


def make(**kw) -> Pipeline:
    base = dict(
        name="p",
        source=KafkaSource(topics=("t",)),
        key_by="user",
        process=Noop(),
        checkpoints="/tmp/ckpt",
        max_parallelism=8,
    )
    return Pipeline(**{**base, **kw})


def test_a_valid_pipeline_lists_its_sinks_with_dead_letters_last() -> None:
    p = make(sinks=[ParquetSink("out", "/tmp/out")], dead_letters=DeadLetterSink(topic="dlq"))
    assert [s.name for s in p.all_sinks()] == ["out", "dead_letters"]
    assert p.key_of({"user": "a"}) == "a"
    assert p.fingerprint() == make().fingerprint()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"parallelism": 9}, "parallelism must be 1..max_parallelism \\(8\\), got 9"),
        ({"parallelism": 0}, "parallelism must be 1..max_parallelism"),
        ({"key_by": None}, "key_by is missing"),
        ({"name": "has space"}, "pipeline name 'has space'"),
        ({"on_process_error": "ignore"}, "on_process_error must be"),
        ({"on_process_error": "dead_letter"}, "needs dead_letters="),
        ({"process": object()}, "must be a KeyedProcessFunction"),
        ({"sinks": [ParquetSink("a", "/x"), ParquetSink("a", "/y")]}, "sink names must be unique"),
        ({"max_parallelism": 0}, "max_parallelism"),
    ],
)
def test_bad_definitions_are_refused_with_a_clear_message(kw, message) -> None:
    with pytest.raises(ConfigError, match=message):
        make(**kw)


def test_bad_source_sink_and_event_time_options_are_refused() -> None:
    with pytest.raises(ConfigError, match="starting must be"):
        KafkaSource(topics=("t",), starting="yesterday")
    with pytest.raises(ConfigError, match="at least one topic"):
        KafkaSource(topics=())
    with pytest.raises(ConfigError, match="on_out_of_range"):
        KafkaSource(topics=("t",), on_out_of_range="skip")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="exactly one of topic= or path="):
        DeadLetterSink()
    with pytest.raises(ConfigError, match="allowed_lateness_s"):
        EventTime(field="ts", allowed_lateness_s=-1)
    assert KafkaSource(topics="single").topics == ("single",)


def test_a_cluster_master_refuses_local_checkpoints_and_parquet_sinks() -> None:
    from microbatch.runtime.execute import check_storage_for_master

    local = make(sinks=[ParquetSink("out", "/tmp/out")])
    check_storage_for_master(local, "local[2]")
    with pytest.raises(ConfigError, match=r"checkpoints = '/tmp/ckpt'.*sink 'out' = '/tmp/out'"):
        check_storage_for_master(local, "spark://127.0.0.1:7077")
    on_s3 = make(checkpoints="s3://b/ckpt", sinks=[ParquetSink("out", "s3://b/out")])
    check_storage_for_master(on_s3, "spark://127.0.0.1:7077")
    check_storage_for_master(on_s3, "sc://127.0.0.1:15002")
