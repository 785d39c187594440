#!/bin/bash
# Soft RLIMIT_NOFILE 1024 below a higher hard limit (systemd's default LimitNOFILE=1024:524288).
# Over kernel TCP a program gets EMFILE once its fds reach 1024, so every fd it gets is < 1024
# (what select()'s FD_SETSIZE needs). Under the shim the kernel soft limit is raised to the hard
# one at start, and the program's own open()/socket()/accept() go past 1023, up to the hard limit.
# Usage: repro-fd-limit-soft.sh            (kernel TCP: PASS)
#        SHIM=$(dirname "$0")/../../../target/release/libsdp_preload.so repro-fd-limit-soft.sh   (DIFF)
PRE=env; [ -n "$SHIM" ] && PRE="env LD_PRELOAD=$SHIM"
out=$(ulimit -Sn 1024; ulimit -Hn 4096; timeout 30 $PRE python3 -c '
import socket, resource, select
l = socket.socket(); l.bind(("127.0.0.1", 0)); l.listen(8)
c = socket.create_connection(l.getsockname()); a, _ = l.accept()
c.sendall(b"x"); assert a.recv(1) == b"x"
soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
fs = []
try:
    while True: fs.append(open("/dev/null"))
except OSError as e: err = e.errno
mx = max(f.fileno() for f in fs)
try:
    select.select([fs[-1]], [], [], 0); sel = "select ok"
except ValueError as e: sel = "select: %s" % e
print("soft", soft, "opened", len(fs), "max fd", mx, sel)
' 2>&1)
echo "$out"
mx=$(echo "$out" | sed -n 's/.*max fd \([0-9]*\).*/\1/p')
if [ -n "$mx" ] && [ "$mx" -lt 1024 ]; then echo PASS; else echo DIFF; exit 1; fi
