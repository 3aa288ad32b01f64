"""The store (Postgres) through the repository against raw SQL of the same rows: item ingest
(``bench.ingest``), claim and complete (``bench.claim``), the retention purge beside claims
(``bench.retention``)."""
