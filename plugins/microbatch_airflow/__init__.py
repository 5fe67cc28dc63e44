"""The Airflow side of microbatch: a thin adapter over the library.

``connections`` turns Airflow connections into :class:`microbatch.Settings`;
``operators`` submits one Spark job per task and returns its result as XCom.
"""
