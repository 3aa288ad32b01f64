"""Postgres past one server: the fleet's tables at size, partitioning by deadline, churn (``python
-m bench.pg_scale``)."""
