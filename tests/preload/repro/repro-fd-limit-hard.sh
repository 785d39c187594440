#!/bin/bash
# A server under `ulimit -n 1024` (soft = hard) holding 700 connections of a client process.
# Over kernel TCP it accepts all 700. Under the shim, each SDP connection holds up to 3 more fds
# of the shim's, which cannot go above a hard limit, so accept() fails with EMFILE at ~515
# (the shim's own fallback to TCP once out of fds does not give the room back).
# Usage: repro-fd-limit-hard.sh  (PASS) ; SHIM=$(dirname "$0")/../../../target/release/libsdp_preload.so repro-fd-limit-hard.sh (DIFF)
PRE=env; [ -n "$SHIM" ] && PRE="env LD_PRELOAD=$SHIM"
P=$((27000 + RANDOM % 1000)); T=$(mktemp -d)
(ulimit -n 1024; exec timeout 60 $PRE python3 -c "
import socket
l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); l.bind(('127.0.0.1', $P)); l.listen(1024)
print('listening', flush=True)
cs = []; err = None
while len(cs) < 700:
    try: a, _ = l.accept(); cs.append(a)
    except OSError as e: err = e; break
print('accepted', len(cs), 'err', err, flush=True)
for a in cs: a.sendall(b'k')
" > $T/srv 2>&1) &
SP=$!
for i in $(seq 50); do grep -q listening $T/srv 2>/dev/null && break; sleep 0.1; done
(ulimit -n 8192; timeout 30 $PRE python3 -c "
import socket
cs = []
try:
    for i in range(700): cs.append(socket.create_connection(('127.0.0.1', $P), timeout=20))
except OSError as e: print('client connect', i, e)
ok = 0
for c in cs:
    try: ok += c.recv(1) == b'k'
    except OSError: pass
print('client got', ok, 'of 700')
" 2>&1)
wait $SP; grep accepted $T/srv
grep -q "accepted 700 err None" $T/srv && { echo PASS; rm -r $T; exit 0; }
echo DIFF; rm -r $T; exit 1
