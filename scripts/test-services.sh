#!/usr/bin/env bash
# Prints `export` lines for HAI_TEST_DATABASE_URL and HAI_TEST_REDIS_URL:
# the variables as already set, else the local defaults when reachable, else throwaway servers
# started here (PostgreSQL via initdb as the postgres user, Redis on a spare port).
set -euo pipefail
RUN_DIR="${HAI_TEST_SERVICES_DIR:-/tmp/hai-test-services}"
mkdir -p "$RUN_DIR"

pg_up() { pg_isready -q -h "$1" -p "$2" >/dev/null 2>&1; }

if [ -z "${HAI_TEST_DATABASE_URL:-}" ]; then
  if command -v pg_isready >/dev/null && pg_up 127.0.0.1 5432 \
     && psql -h 127.0.0.1 -U postgres -d test -Atc 'select 1' >/dev/null 2>&1; then
    HAI_TEST_DATABASE_URL="postgresql+psycopg://postgres@127.0.0.1:5432/test"
  else
    PGBIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)
    [ -n "$PGBIN" ] || { echo "PostgreSQL is not installed (apt-get install postgresql)" >&2; exit 1; }
    PGDATA="$RUN_DIR/pg"; PGPORT=55432
    if ! pg_up 127.0.0.1 $PGPORT; then
      rm -rf "$PGDATA"; mkdir -p "$PGDATA"; chown postgres "$PGDATA" "$RUN_DIR" 2>/dev/null || true
      as_pg() { if [ "$(id -u)" = 0 ]; then su postgres -s /bin/sh -c "$*"; else sh -c "$*"; fi; }
      as_pg "$PGBIN/initdb -D $PGDATA -A trust -U postgres" >"$RUN_DIR/initdb.log" 2>&1
      as_pg "$PGBIN/pg_ctl -D $PGDATA -o '-p $PGPORT -k $RUN_DIR -c listen_addresses=127.0.0.1' -l $RUN_DIR/pg.log -w start" >/dev/null
      psql -h 127.0.0.1 -p $PGPORT -U postgres -c 'create database test' >/dev/null
    fi
    HAI_TEST_DATABASE_URL="postgresql+psycopg://postgres@127.0.0.1:$PGPORT/test"
  fi
fi

if [ -z "${HAI_TEST_REDIS_URL:-}" ]; then
  if command -v redis-cli >/dev/null && [ "$(redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null)" = PONG ]; then
    HAI_TEST_REDIS_URL="redis://127.0.0.1:6379/0"
  else
    command -v redis-server >/dev/null || { echo "Redis is not installed (apt-get install redis-server)" >&2; exit 1; }
    if [ "$(redis-cli -h 127.0.0.1 -p 56379 ping 2>/dev/null)" != PONG ]; then
      redis-server --port 56379 --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
        --dir "$RUN_DIR" --logfile "$RUN_DIR/redis.log" >/dev/null
      for _ in $(seq 50); do [ "$(redis-cli -p 56379 ping 2>/dev/null)" = PONG ] && break; sleep 0.1; done
    fi
    HAI_TEST_REDIS_URL="redis://127.0.0.1:56379/0"
  fi
fi

echo "export HAI_TEST_DATABASE_URL=$HAI_TEST_DATABASE_URL"
echo "export HAI_TEST_REDIS_URL=$HAI_TEST_REDIS_URL"
