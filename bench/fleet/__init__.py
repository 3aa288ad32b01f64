"""A fleet's control plane: N simulated GPU nodes on real Postgres and Redis, Backfill's calls
against the bare SQL and Redis commands of the same shape (``python -m bench.fleet``)."""
