"""The Airflow side of microbatch: a thin adapter over the library (see docs/airflow.md).

======================  ====================================================================
module                  what
======================  ====================================================================
``connections``         Airflow connections → :class:`microbatch.Settings`
``dag_factory``         ``microbatch_dag(...)``: one DAG per pipeline, one batch per run
``params``              the trigger form (JSON schema): parallelism, max_records, dry_run
``operators``           run a Spark job; run one batch; skip a batch with nothing to do
``triggers``            ``NewDataTrigger``: the deferrable "anything new?" check
``freshness``           the rules of that check (pure) and its one I/O call
``assets``              the pipeline's asset and the ``extra`` of its events
``lineage``             the batch task's OpenLineage facets (topics in, sinks out, the batch)
``hooks``               the connection types ``microbatch_kafka``, ``microbatch_s3``, ...
``ui``                  the Microbatch page (FastAPI, login enforced; loads no job file)
``plugin``              the ``AirflowPlugin`` registering the page and its nav link
``get_provider_info``   what the ``microbatch-airflow`` provider declares to Airflow
======================  ====================================================================
"""
