#!/usr/bin/env bash
# An accepted socket handed to an exec'd program (inetd style: sshd's re-exec, subprocess
# with pass_fds, posix_spawn) answers getpeername()/getsockname() with AF_UNIX under the shim,
# where over kernel TCP it is AF_INET 127.0.0.1. The bytes themselves do flow (the fd is
# pumped). Prints the handler's view; run: repro-exec-getpeername.sh [plain|shim]
SO=$(cd "$(dirname "$0")/../../.." && pwd)/target/release/libsdp_preload.so
MODE=${1:-shim}; P=$((26000 + RANDOM % 1000)); PY=$(mktemp /tmp/sdp-repro-inetd.XXXXXX.py)
if [ "$MODE" = shim ]; then E=(env LD_PRELOAD=$SO); else E=(env -u LD_PRELOAD); fi
cat >$PY <<'PY'
import socket, subprocess, sys
l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind(("127.0.0.1", int(sys.argv[1]))); l.listen(4)
c, _ = l.accept()
# the handler: a new program given the connection as its stdin/stdout, as inetd does
h = "import socket,os; s=socket.socket(fileno=0); print('handler sees family', s.family.name, 'peer', s.getpeername(), 'local', s.getsockname(), 'TCP_NODELAY settable:', end=' ', flush=True); \n" \
    "try:\n s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); print('yes')\nexcept OSError as e: print(e)\n" \
    "os.write(1, os.read(0, 100))"
subprocess.run([sys.executable, "-c", h], stdin=c, stdout=c)
c.close()
PY
"${E[@]}" timeout 20 python3 $PY $P & S=$!
for _ in $(seq 100); do ss -ltn | grep -q "127.0.0.1:$P " && break; sleep 0.05; done
echo "ping" | "${E[@]}" timeout 20 nc -N 127.0.0.1 $P
wait $S
