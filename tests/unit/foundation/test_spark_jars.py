"""The runtime's lookup of the Spark Kafka connector jars (``microbatch.spark_jars``) and
the local stack's resolver (``microbatch.localstack.spark_kafka``) agree on the marker."""

from __future__ import annotations

from microbatch.localstack.spark_kafka import _stamp
from microbatch.spark_jars import COMPLETE, jar_dir, pyspark_version, spark_kafka_jars


def test_lookup_uses_a_complete_resolution_for_the_installed_pyspark_only(tmp_path):
    libs = jar_dir(tmp_path)
    libs.mkdir(parents=True)
    (libs / "spark-sql-kafka-0-10_2.13-x.jar").touch()
    assert spark_kafka_jars(tmp_path) == []  # jars without the marker: still resolving

    (libs / COMPLETE).write_text("3.5.0 0123456789abcdef")
    assert spark_kafka_jars(tmp_path) == []  # another Spark's resolution

    (libs / COMPLETE).write_text(_stamp(pyspark_version()))
    assert spark_kafka_jars(tmp_path) == [libs / "spark-sql-kafka-0-10_2.13-x.jar"]


def test_the_resolvers_stamp_starts_with_the_version_the_lookup_checks():
    assert _stamp("4.2.0").split(" ")[0] == "4.2.0"
