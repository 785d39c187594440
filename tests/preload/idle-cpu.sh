#!/usr/bin/env bash
# What idle connections cost: a server (python3) accepts N connections from a client, then both
# hold them without a byte moving for SECS seconds, and each process's CPU time over that time
# is printed, over kernel TCP and with both under the shim (over shm), in the same run. An idle
# connection should cost no CPU, as TCP's does not. A benchmark, not a test: the figures and
# their dates go to docs/findings.md ("Idle connections").
#
#   tests/preload/idle-cpu.sh [N] [SECS]     (defaults 1000 and 10; SDP_SO=PATH measures another
#                                             build of the shim)
set -uo pipefail
cd "$(dirname "$0")/../.."
N=${1:-1000}
SECS=${2:-10}
cargo build -q --release -p sdp-preload || exit 1
SO=${SDP_SO:-$PWD/target/release/libsdp_preload.so}
WORK=$(mktemp -d /tmp/sdp-idle-cpu.XXXXXX)
trap 'jobs -p | xargs -r kill 2>/dev/null; rm -rf "$WORK"' EXIT
ulimit -n 8192 2>/dev/null || true

# Both sides: ROLE PORT N SECS; prints "ROLE cpu_s" (utime + stime over the idle SECS).
cat >"$WORK/idle.py" <<'EOF'
import os, socket, sys, time
role, port, n, secs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
def cpu():
    t = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    return (int(t[11]) + int(t[12])) / os.sysconf("SC_CLK_TCK")
if role == "server":
    l = socket.socket()
    l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    l.bind(("127.0.0.1", port))
    l.listen(1024)
    open(sys.argv[5], "w").close()
    conns = [l.accept()[0] for _ in range(n)]
else:
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
time.sleep(1)
a = cpu()
time.sleep(secs)
b = cpu()
print(f"{role} {b - a:.2f}")
time.sleep(1)
EOF

run() { # run NAME PRELOAD(0/1)
    local pre=(env -u LD_PRELOAD) port=$((20000 + RANDOM % 10000))
    [ "$2" = 1 ] && pre=(env LD_PRELOAD="$SO")
    rm -f "$WORK/ready"
    "${pre[@]}" python3 "$WORK/idle.py" server $port "$N" "$SECS" "$WORK/ready" >"$WORK/s" &
    local s=$!
    for _ in $(seq 100); do [ -e "$WORK/ready" ] && break; sleep 0.05; done
    "${pre[@]}" python3 "$WORK/idle.py" client $port "$N" "$SECS" >"$WORK/c" || {
        echo "$1: client failed"
        return
    }
    wait $s
    printf '%-4s %d idle connections, CPU seconds over %s s: server %s, client %s\n' "$1" "$N" \
        "$SECS" "$(awk '{print $2}' "$WORK/s")" "$(awk '{print $2}' "$WORK/c")"
}
run tcp 0
run sdp 1
