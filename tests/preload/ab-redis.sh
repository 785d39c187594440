#!/usr/bin/env bash
# A/B of two builds of the shim on redis-benchmark GET (requests/s), interleaved with kernel TCP in
# each round: `tests/preload/ab-redis.sh SO_A SO_B [CLIENTS] [ROUNDS]`, e.g. a build of the previous
# commit against this one with 300 clients. Needs redis-server and redis-benchmark
# (tests/preload/programs.sh installs them). A benchmark, not a test; loopback only.
set -uo pipefail
A=$1 B=$2 C=${3:-50} R=${4:-3}
PORT=$((21000 + RANDOM % 5000))
one() { # SO, or "" for kernel TCP; prints requests/s
    PORT=$((PORT + 1))
    local e
    if [ -n "$1" ]; then e="env LD_PRELOAD=$1"; else e="env -u LD_PRELOAD"; fi
    $e redis-server --port $PORT --bind 127.0.0.1 --maxclients 10000 --save '' --appendonly no >/dev/null 2>&1 &
    local s=$!
    for _ in $(seq 50); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.1; done
    $e redis-benchmark -p $PORT -t get -n 100000 -c "$C" -q 2>/dev/null |
        tr '\r' '\n' | awk '/requests per second/ {print $2}' | tail -1
    kill $s
    wait $s 2>/dev/null
}
for i in $(seq "$R"); do echo "round $i, $C clients: tcp $(one '') A $(one "$A") B $(one "$B")"; done
