#!/usr/bin/env bash
# Where a short connection's time and CPU go, kernel TCP against the shim over shm in the same
# run (SDP kept for every connection; then the shim's own choice, which moves these to TCP) (tests/preload/conn-phases.c: connect, 100 bytes each way, close, N times in turn).
# Prints, per transport, the medians of each phase (stamps of both processes on one clock) and
# the CPU each process (and the shim's progress thread) used per connection. A benchmark, not
# a test: the figures and their dates go to docs/benchmarks.md.
#
#   tests/preload/conn-phases.sh [N]     (default 3000; LOAD=K adds K CPU-bound processes;
#                                         SDP_SO=PATH measures another build of the shim)
set -uo pipefail
cd "$(dirname "$0")/../.."
N=${1:-3000}
cargo build -q --release -p sdp-preload || exit 1
SO=${SDP_SO:-$PWD/target/release/libsdp_preload.so}
WORK=$(mktemp -d /tmp/sdp-conn-phases.XXXXXX)
LOADPIDS=()
trap 'kill "${LOADPIDS[@]}" 2>/dev/null; jobs -p | xargs -r kill 2>/dev/null; rm -rf "$WORK"' EXIT
for _ in $(seq "${LOAD:-0}"); do (while :; do :; done) & LOADPIDS+=($!); done
gcc -O2 -Wall -Werror -o "$WORK/cp" tests/preload/conn-phases.c || exit 1
command -v gawk >/dev/null || { echo "needs gawk" >&2; exit 1; }

run() { # run NAME PRELOAD(0/1) [ENV...]
    local pre=(env -u LD_PRELOAD) port=$((20000 + RANDOM % 10000))
    [ "$2" = 1 ] && pre=(env LD_PRELOAD="$SO" "${@:3}")
    "${pre[@]}" "$WORK/cp" s $port $((N + 200)) 200 "$WORK/s" & local s=$!
    for _ in $(seq 100); do ss -ltn | grep -q ":$port " && break; sleep 0.05; done
    sleep 0.3
    "${pre[@]}" "$WORK/cp" c $port 200 0 "$WORK/warm" || { echo "$1: warm-up failed"; return; }
    "${pre[@]}" "$WORK/cp" c $port "$N" 0 "$WORK/c" || { echo "$1: client failed"; return; }
    wait $s
    grep -v '^cpu' "$WORK/s" | tail -n "$N" >"$WORK/s2"
    grep -v '^cpu' "$WORK/c" | paste -d' ' - "$WORK/s2" | gawk -v name="$1" '
        function med(x,   n, k, t) { n = 0; for (k in x) t[++n] = x[k]; asort(t); return t[int(n / 2) + 1] }
        # client: c0 start, c1 connected, c2 written, c3 echo read; server: s0 accept called,
        # s1 accepted, s2 read, s3 written
        { conn[NR] = $2 - $1; acc[NR] = $6 - $1; req[NR] = $7 - $2; echo[NR] = $4 - $8; all[NR] = $4 - $1 }
        END { printf "%-5s p50 us: connect %4.0f, accept returns %4.0f after connect began, request read %4.0f after connect returned, echo read %4.0f after written; whole %4.0f\n",
              name, med(conn), med(acc), med(req), med(echo), med(all) }'
    awk '/^cpu/ { printf "      server CPU per connection: main thread %6.1f us, other threads %6.1f us\n", $2, $3 }' "$WORK/s"
    awk '/^cpu/ { printf "      client CPU per connection: main thread %6.1f us, other threads %6.1f us\n", $2, $3 }' "$WORK/c"
}
echo "conn-phases: $N connections in turn, ${LOAD:-0} CPU-bound processes beside"
run tcp 0
# SDP kept for every connection (by default, after a run of short connections the shim's
# connects to this server go by kernel TCP: that row is the last).
run shim 1 SDP_SHORT_CONNS=0
run auto 1
