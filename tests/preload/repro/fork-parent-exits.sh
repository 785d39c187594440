#!/usr/bin/env bash
# A client connects, forks, and the parent exits at once (daemon(3), `ssh -f`, double-fork
# daemons); the child then uses the connection. Plain: the child's request is answered. Shim
# (both ends over shm): answered too (daemon: the connection moves to the child; _exit: the
# parent's exit hands it to a keeper that pumps it for the child). Before 2026-11-27 the child's
# bytes never reached the server (then: EPIPE at once).
# Usage: repro-fork-parent-exits.sh [plain|shim] [daemon|_exit]
SO=$(cd "$(dirname "$0")/../../.." && pwd)/target/release/libsdp_preload.so
MODE=${1:-shim}; HOW=${2:-daemon}; P=$((29000 + RANDOM % 1000))
if [ "$MODE" = shim ]; then E=(env LD_PRELOAD=$SO SDP_LOG=${SDP_LOG:-}); else E=(env -u LD_PRELOAD); fi
"${E[@]}" timeout 30 python3 -c '
import socket, sys
l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind(("127.0.0.1", int(sys.argv[1]))); l.listen(4)
c, _ = l.accept(); d = c.recv(100); print("server got", d, flush=True); c.sendall(b"reply:" + d); c.close()
' $P & S=$!
for _ in $(seq 100); do ss -ltn | grep -q "127.0.0.1:$P " && break; sleep 0.05; done
OUT=$(mktemp /tmp/sdp-repro-fork.XXXXXX); 
"${E[@]}" timeout 30 python3 -c '
import ctypes, os, socket, struct, sys, time
port, how, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
s = socket.create_connection(("127.0.0.1", port))
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 10, 0))
if how == "daemon":
    ctypes.CDLL(None).daemon(1, 1)   # glibc daemon(): fork, the parent _exit()s, setsid
elif os.fork():
    os._exit(0)
time.sleep(0.2)                       # the parent is gone
s.sendall(b"hello")
try:
    r = s.recv(100)
except OSError as e:
    r = repr(e).encode()
open(out, "w").write("child got %r\n" % r)
' $P $HOW $OUT
echo "client (parent) exit $?"
for _ in $(seq 150); do [ -s $OUT ] && break; sleep 0.1; done
cat $OUT 2>/dev/null || echo "no answer from the child within 15 s"
kill $S 2>/dev/null; wait $S 2>/dev/null
