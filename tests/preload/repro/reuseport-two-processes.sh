#!/bin/bash
# Two processes each listening on one port with SO_REUSEPORT, the first started first: under
# the shim the first serves SDP, the second kernel TCP only; the first's doorbells (loopback
# connections announcing SDP clients) can land in the second's queue, whose program takes
# them for TCP clients: those SDP clients wait for ever (here: a client's recv times out).
# Over TCP every client is served. Exits 0 when shim == TCP, 1 when they differ.
SHIM=${SHIM:-$(cd "$(dirname "$0")/../../.." && pwd)/target/release/libsdp_preload.so}; PORT=${PORT:-8196}
D=$(mktemp -d); trap 'rm -rf $D' EXIT
cat > $D/srv.py <<'PY'
import socket, sys
l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
l.bind(("127.0.0.1", int(sys.argv[1]))); l.listen(64); l.settimeout(8)
try:
    while True:
        c, _ = l.accept(); c.sendall(c.recv(100).upper()); c.close()
except socket.timeout:
    pass
PY
cat > $D/cli.py <<'PY'
import socket, sys
ok = 0
for i in range(20):
    try:
        s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=3)
        s.sendall(b"ping"); ok += s.recv(100) == b"PING"; s.close()
    except OSError:
        pass
print("served %d of 20" % ok)
PY
run() {
  env ${1:+LD_PRELOAD=$1} ${1:+SDP_SHORT_CONNS=0} python3 $D/srv.py $PORT & local a=$!; sleep 0.3
  env ${1:+LD_PRELOAD=$1} ${1:+SDP_SHORT_CONNS=0} python3 $D/srv.py $PORT & local b=$!; sleep 0.3
  env ${1:+LD_PRELOAD=$1} ${1:+SDP_SHORT_CONNS=0} timeout 70 python3 $D/cli.py $PORT
  kill $a $b 2>/dev/null; wait $a $b 2>/dev/null
}
T=$(run ""); S=$(run "$SHIM")
echo "tcp:  $T"; echo "shim: $S"
[ "$T" = "$S" ] && { echo SAME; exit 0; } || { echo DIFFERS; exit 1; }
