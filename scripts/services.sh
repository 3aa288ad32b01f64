#!/usr/bin/env bash
# Start the local PostgreSQL and Redis if they are not answering (the machine's own services;
# see README "Services"). Safe to run when they are already up.
set -euo pipefail

pg_up() { pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; }
redis_up() { redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; }

if ! pg_up; then
  echo "services: starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
fi
if ! redis_up; then
  echo "services: starting Redis"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
fi
for _ in $(seq 1 60); do
  if pg_up && redis_up; then
    # The ledger must never lose keys to eviction (anchors: use noeviction).
    redis-cli -h 127.0.0.1 -p 6379 config set maxmemory-policy noeviction >/dev/null
    exit 0
  fi
  sleep 1
done
echo "services: PostgreSQL or Redis did not come up on 127.0.0.1:5432 / :6379" >&2
exit 1
