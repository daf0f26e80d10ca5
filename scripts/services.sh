#!/usr/bin/env bash
# Make sure the services the test suite uses answer on 127.0.0.1, starting the ones that do not:
# PostgreSQL 5432, MariaDB 3306, Redis 6379, RabbitMQ 5672, and PgBouncer 6439 in transaction
# mode in front of PostgreSQL's `test` database (installed from Debian's package when missing).
# Then make sure the `test` databases exist. Prints one line per service (up / started / FAILED) and exits non-zero if any failed.
# Runs as root (CI and the dev box). Bounded: SERVICES_WAIT_SECONDS (default 60) for all starts.
set -uo pipefail

WAIT_SECONDS=${SERVICES_WAIT_SECONDS:-60}
SERVICES=(postgres pgbouncer mariadb redis rabbitmq)
PGBOUNCER_PORT=6439
PGBOUNCER_DIR=/var/lib/postgresql/celery-leases-pgbouncer

postgres_answers() { pg_isready -q -h 127.0.0.1 -p 5432 -t 2; }
pgbouncer_answers() { pg_isready -q -h 127.0.0.1 -p "$PGBOUNCER_PORT" -d test -U postgres -t 2; }
mariadb_answers() { mysqladmin -h127.0.0.1 -P3306 -uroot --connect-timeout=2 ping >/dev/null 2>&1; }
redis_answers() { [[ "$(timeout 3 redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null)" == PONG ]]; }
# AMQP handshake: send the 0-9-1 protocol header, expect a method frame (type 1, Connection.Start)
# back. Unlike `rabbitmq-diagnostics ping` this proves the AMQP listener itself accepts clients.
rabbitmq_answers() {
    timeout 5 bash -c 'exec 3<>/dev/tcp/127.0.0.1/5672 && printf "AMQP\x00\x00\x09\x01" >&3 \
        && head -c 1 <&3 | od -An -tx1' 2>/dev/null | grep -q 01
}

postgres_start() {
    # One cluster per machine here; `ls` picks its version directory.
    pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start
}
pgbouncer_start() {
    if ! command -v pgbouncer >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q pgbouncer || { apt-get update -q && apt-get install -y -q pgbouncer; }
    fi
    install -d -o postgres -g postgres "$PGBOUNCER_DIR"
    # Transaction mode: a client's transactions may each run on another server connection.
    printf '%s\n' \
        '[databases]' \
        'test = host=127.0.0.1 port=5432 dbname=test user=postgres' \
        '[pgbouncer]' \
        'listen_addr = 127.0.0.1' \
        "listen_port = $PGBOUNCER_PORT" \
        'unix_socket_dir =' \
        'auth_type = any' \
        'pool_mode = transaction' \
        'max_client_conn = 500' \
        'default_pool_size = 20' \
        'ignore_startup_parameters = extra_float_digits,options' \
        "logfile = $PGBOUNCER_DIR/pgbouncer.log" \
        "pidfile = $PGBOUNCER_DIR/pgbouncer.pid" >"$PGBOUNCER_DIR/pgbouncer.ini"
    chown postgres:postgres "$PGBOUNCER_DIR/pgbouncer.ini"
    pgbouncer -d -u postgres "$PGBOUNCER_DIR/pgbouncer.ini"
}
mariadb_start() {
    # /run is a tmpfs on a rebooted box: mariadbd needs its socket/pid directory.
    [[ -d /run/mysqld ]] || install -d -o mysql -g mysql -m 755 /run/mysqld
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
}
redis_start() {
    mkdir -p /var/lib/redis /var/log/redis
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
        --dir /var/lib/redis --logfile /var/log/redis/ci.log
}
rabbitmq_start() { rabbitmq-server -detached; }

postgres_log() { tail -n 20 /var/log/postgresql/postgresql-*-main.log; }
pgbouncer_log() { tail -n 20 "$PGBOUNCER_DIR/pgbouncer.log"; }
mariadb_log() { tail -n 20 /var/log/mysql/error.log; }
redis_log() { tail -n 20 /var/log/redis/ci.log; }
rabbitmq_log() { tail -n 20 /var/log/rabbitmq/startup_err /var/log/rabbitmq/rabbit@*.log; }

postgres_database() {
    local exists
    exists=$(psql -h 127.0.0.1 -U postgres -d postgres -Atqc \
        "SELECT 1 FROM pg_database WHERE datname = 'test'") || return 1
    [[ "$exists" == 1 ]] || psql -h 127.0.0.1 -U postgres -d postgres -qc 'CREATE DATABASE test'
}
mariadb_database() { mysql -h127.0.0.1 -P3306 -uroot -e 'CREATE DATABASE IF NOT EXISTS test'; }

start_output=$(mktemp)
trap 'rm -f "$start_output"' EXIT

declare -A state
for service in "${SERVICES[@]}"; do
    if "${service}_answers"; then
        state[$service]=up
    elif "${service}_start" >>"$start_output" 2>&1; then
        state[$service]=starting
    else
        state[$service]="FAILED (start command failed)"
    fi
done

deadline=$((SECONDS + WAIT_SECONDS))
for service in "${SERVICES[@]}"; do
    [[ "${state[$service]}" == starting ]] || continue
    until "${service}_answers"; do
        if ((SECONDS >= deadline)); then
            state[$service]="FAILED (not answering after ${WAIT_SECONDS}s)"
            break
        fi
        sleep 0.5
    done
    [[ "${state[$service]}" == starting ]] && state[$service]=started
done

for service in postgres mariadb; do
    case "${state[$service]}" in
    up | started)
        "${service}_database" >/dev/null 2>&1 || state[$service]="FAILED (cannot create database test)"
        ;;
    esac
done

failed=0
for service in "${SERVICES[@]}"; do
    printf '%-9s %s\n' "$service" "${state[$service]}"
    if [[ "${state[$service]}" == FAILED* ]]; then
        failed=1
        { echo "--- $service log tail:"; "${service}_log" 2>&1; } >&2
    fi
done
if ((failed)) && [[ -s "$start_output" ]]; then
    { echo "--- output of the start commands:"; cat "$start_output"; } >&2
fi
exit "$failed"
