# The Backfill image: API, worker and beat all run from it (see docker-compose.yml). devkit/
# (backfill dev, the dev engine, embedded services) stays out: no production process loads it.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY backfill ./backfill
COPY backfill_cli ./backfill_cli
COPY backfill_analysis ./backfill_analysis
COPY queue_api ./queue_api
COPY worker ./worker
COPY migrations ./migrations
RUN pip install --no-cache-dir .
ENTRYPOINT ["backfill"]
