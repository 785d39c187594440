#!/bin/bash
# A listener with TCP_DEFER_ACCEPT (apache2 sets it on every Listen: AcceptFilter http data,
# setsockopt(fd, SOL_TCP, TCP_DEFER_ACCEPT, [30])): under the shim each client connect stalls
# 1 s ("SDP shm: the listener is shared|... no process accepted us within 1 s") and then falls
# back to kernel TCP; the shim's wake-up ("doorbell") TCP connection carries no data, so the
# kernel never queues it for accept(). Over TCP: a few ms per connection.
# Exits 0 when shim == TCP (no connection takes >= 0.5 s), 1 when the shim stalls.
SHIM=${SHIM:-$(cd "$(dirname "$0")/../../.." && pwd)/target/release/libsdp_preload.so}; PORT=${PORT:-8194}; N=${N:-3}; FORK=${FORK:-0}
D=$(mktemp -d); trap 'rm -rf $D' EXIT
cat > $D/srv.py <<'PY'
import socket, os, sys, signal
l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 30)
l.bind(("127.0.0.1", int(sys.argv[1]))); l.listen(16)
def serve():
    while True:
        c, _ = l.accept(); c.sendall(c.recv(100).upper()); c.close()
if sys.argv[2] == "0": serve()
kid = os.fork()
if kid == 0: serve()
signal.signal(signal.SIGTERM, lambda *a: (os.kill(kid, 9), os._exit(0)))
while True: signal.pause()
PY
cat > $D/cli.py <<'PY'
import socket, sys, time
worst = 0; out = []
for i in range(int(sys.argv[2])):
    t = time.time()
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
    s.sendall(b"ping"); out.append(s.recv(100)); s.close()
    worst = max(worst, time.time() - t)
print("replies=%s slowest=%s" % (set(out), "STALL %.2fs" % worst if worst >= 0.5 else "<0.5s"))
PY
run() {
  env ${1:+LD_PRELOAD=$1} ${1:+SDP_LOG=${SDP_LOG:-0}} timeout 60 python3 $D/srv.py $PORT $FORK & local sp=$!
  for i in $(seq 50); do ss -ltn | grep -q ":$PORT " && break; sleep 0.1; done; sleep 0.3
  env ${1:+LD_PRELOAD=$1} ${1:+SDP_LOG=${SDP_LOG:-0}} timeout 30 python3 $D/cli.py $PORT $N
  kill $sp; wait $sp 2>/dev/null
  while ss -ltn | grep -q ":$PORT "; do sleep 0.1; done
}
T=$(run ""); S=$(run "$SHIM")
echo "tcp:  $T"; echo "shim: $S"
[ "$T" = "$S" ] && { echo SAME; exit 0; } || { echo DIFFERS; exit 1; }
