#!/usr/bin/env bash
# Speed of unmodified programs under the LD_PRELOAD shim against kernel TCP loopback, measured
# in the same run (interleaved, medians of RUNS): iperf3 (128 KiB writes), sockperf ping-pong
# p50, redis-benchmark GET/SET with -P 1 and -P 16 (GET -P 16 also with a BGSAVE, a fork, early in
# a longer run: the clients' connections are inherited by the child, which ignores them), nginx + wrk requests/s (1 KiB and 1 MiB, and
# 1 KiB with one request per connection: as the shim chooses, which after a run of short
# connections is kernel TCP (sdp-core socket/history.rs), and with SDP kept, SDP_SHORT_CONNS=0);
# and the shim's cost on fds it does not own (tests/preload/passthrough.c: read/write on a pipe,
# a file and an AF_UNIX pair, fcntl, in ns per call, with and without the shim).
# Prints one row per measurement with the ratio shim / TCP (or shim / none). A benchmark, not a test.
#
#   tests/preload/bench.sh [RUNS]        (default 3; LOAD=N adds N CPU-bound processes)
set -uo pipefail
cd "$(dirname "$0")/../.."
RUNS=${1:-3}
tests/preload/programs.sh nc >/dev/null 2>&1 || true   # installs the packages if missing
cargo build -q --release -p sdp-preload || exit 1
SO=$PWD/target/release/libsdp_preload.so
WORK=$(mktemp -d /tmp/sdp-bench-programs.XXXXXX)
LOADPIDS=()
trap 'kill "${LOADPIDS[@]}" 2>/dev/null; jobs -p | xargs -r kill 2>/dev/null; rm -rf "$WORK"' EXIT
for _ in $(seq "${LOAD:-0}"); do (while :; do :; done) & LOADPIDS+=($!); done
# A fresh port per server, below the ephemeral range (32768-), kept in a file: the
# measurements run in subshells (a variable's increment would be lost, and every server would
# get the same port, some of them failing to bind it while it is in TIME_WAIT).
echo $((20000 + RANDOM % 10000)) >"$WORK/port"
next_port() {
    PORT=$(($(cat "$WORK/port") + 1))
    echo "$PORT" >"$WORK/port"
}

. "$(dirname "$0")/lib.sh"
pre() { if [ "$1" = sdp ]; then echo "env LD_PRELOAD=$SO"; else echo "env -u LD_PRELOAD"; fi; }

iperf3_gbps() {
    next_port
    $(pre "$1") iperf3 -s -1 -p $PORT >/dev/null 2>&1 &
    wait_port $PORT
    $(pre "$1") iperf3 -c 127.0.0.1 -p $PORT -t 2 -l 128K --json 2>/dev/null |
        python3 -c 'import json,sys; print("%.2f" % (json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e9))'
    wait
}
sockperf_p50() {
    next_port
    $(pre "$1") sockperf server --tcp -i 127.0.0.1 -p $PORT >/dev/null 2>&1 &
    local s=$!
    wait_port $PORT
    $(pre "$1") sockperf ping-pong --tcp -i 127.0.0.1 -p $PORT -t 2 2>/dev/null |
        awk '/percentile 50.000/ { print $NF }'
    kill $s; wait $s 2>/dev/null
}
redis_rps() { # MODE TEST PIPELINE [bgsave: a BGSAVE (fork) 0.2 s into a longer run]
    next_port
    $(pre "$1") redis-server --port $PORT --bind 127.0.0.1 --save '' --appendonly no \
        --dir "$WORK" --dbfilename "dump-$PORT.rdb" >/dev/null 2>&1 &
    local s=$! n=100000 b=
    wait_port $PORT
    if [ "${4:-}" = bgsave ]; then
        n=2000000
        redis-cli -p $PORT debug populate 100000 >/dev/null
        (sleep 0.2; redis-cli -p $PORT bgsave >/dev/null) &
        b=$!
    fi
    $(pre "$1") redis-benchmark -p $PORT -t "$2" -n $n -P "$3" -q 2>/dev/null |
        tr '\r' '\n' | awk '/requests per second/ { print $2 }' | tail -1
    [ -n "$b" ] && wait $b
    kill $s; wait $s 2>/dev/null
}
nginx_rps() { # MODE FILE [close | close-sdp: one request per connection (close-sdp: SDP kept)]
    next_port
    mkdir -p "$WORK/www" "$WORK/ng"
    [ -f "$WORK/www/1k" ] || head -c 1024 /dev/urandom >"$WORK/www/1k"
    [ -f "$WORK/www/1m" ] || head -c 1048576 /dev/urandom >"$WORK/www/1m"
    cat >"$WORK/ng/nginx.conf" <<EOF
daemon off; master_process on; worker_processes 2; pid $WORK/ng/pid; error_log $WORK/ng/err;
user $(id -un) $(id -gn);
events { worker_connections 256; }
http { access_log off; sendfile on; client_body_temp_path $WORK/ng/b; proxy_temp_path $WORK/ng/p;
  fastcgi_temp_path $WORK/ng/f; uwsgi_temp_path $WORK/ng/u; scgi_temp_path $WORK/ng/s;
  server { listen 127.0.0.1:$PORT; root $WORK/www; } }
EOF
    $(pre "$1") nginx -c "$WORK/ng/nginx.conf" >/dev/null 2>&1 &
    local s=$!
    wait_port $PORT
    local hdr=() keep=()
    [ -n "${3:-}" ] && hdr=(-H "Connection: close")
    [ "${3:-}" = close-sdp ] && keep=(env SDP_SHORT_CONNS=0)
    "${keep[@]}" $(pre "$1") wrk -t1 -c8 -d2 "${hdr[@]}" http://127.0.0.1:$PORT/"$2" 2>/dev/null | awk '/Requests\/sec/ { print $2 }'
    kill $s; wait $s 2>/dev/null
}

median() { sort -g | awk '{ a[NR] = $1 } END { if (NR) print a[int((NR + 1) / 2)]; else print "nan" }'; }

measure() { # NAME UNIT HIGHER_IS_BETTER CMD...
    local name=$1 unit=$2 hib=$3; shift 3
    local t=() s=()
    for _ in $(seq "$RUNS"); do
        t+=("$("$@" tcp)"); s+=("$("$@" sdp)")
    done
    local mt ms
    mt=$(printf '%s\n' "${t[@]}" | median); ms=$(printf '%s\n' "${s[@]}" | median)
    printf '%-28s %10s %10s %-8s %6s\n' "$name" "$mt" "$ms" "$unit" \
        "$(awk -v a="$ms" -v b="$mt" 'BEGIN { if (b > 0) printf "%.2fx", a / b; else print "-" }')"
}

echo "load: ${LOAD:-0} CPU-bound processes; medians of $RUNS interleaved runs; ratio = shim / TCP"
printf '%-28s %10s %10s %-8s %6s\n' measurement tcp shim unit ratio
measure "iperf3 128 KiB" Gbit/s 1 iperf3_gbps
measure "sockperf ping-pong p50" us 0 sockperf_p50
measure "redis SET -P 1" req/s 1 eval 'f() { redis_rps "$1" set 1; }; f'
measure "redis GET -P 1" req/s 1 eval 'f() { redis_rps "$1" get 1; }; f'
measure "redis SET -P 16" req/s 1 eval 'f() { redis_rps "$1" set 16; }; f'
measure "redis GET -P 16" req/s 1 eval 'f() { redis_rps "$1" get 16; }; f'
measure "  the same, with a BGSAVE" req/s 1 eval 'f() { redis_rps "$1" get 16 bgsave; }; f'
measure "nginx+wrk 1 KiB" req/s 1 eval 'f() { nginx_rps "$1" 1k; }; f'
measure "nginx+wrk 1 MiB" req/s 1 eval 'f() { nginx_rps "$1" 1m; }; f'
measure "nginx+wrk 1 KiB conn close" req/s 1 eval 'f() { nginx_rps "$1" 1k close; }; f'
measure "  the same, SDP kept" req/s 1 eval 'f() { nginx_rps "$1" 1k close-sdp; }; f'

# Calls on fds the shim does not own (target: within 2% of no shim).
gcc -O2 -Wall -Werror -o "$WORK/passthrough" tests/preload/passthrough.c || exit 1
for _ in $(seq "$RUNS"); do
    env -u LD_PRELOAD "$WORK/passthrough" 100000 >>"$WORK/pt.none"
    env LD_PRELOAD="$SO" "$WORK/passthrough" 100000 >>"$WORK/pt.shim"
done
printf '%-28s %10s %10s %-8s %6s\n' "not the shim's fds" none shim unit ratio
for k in pipe file unix fcntl; do
    mn=$(awk -v k=$k '$1 == k { print $2 }' "$WORK/pt.none" | median)
    ms=$(awk -v k=$k '$1 == k { print $2 }' "$WORK/pt.shim" | median)
    printf '%-28s %10s %10s %-8s %6s\n' "$k per call" "$mn" "$ms" ns \
        "$(awk -v a="$ms" -v b="$mn" 'BEGIN { if (b > 0) printf "%.3fx", a / b; else print "-" }')"
done
