#!/bin/bash
# A process that holds one SDP stream under two fd numbers (dup) stalls ~0.2-0.3 s in every
# fork(). Shown two ways: c/dupfork (C: accept, dup, fork x3) and bash running 10 external
# commands while it holds a /dev/tcp connection dup'd to another fd.
# PASS over kernel TCP, DIFF under the shim. Usage: repro-dup-fork-stall.sh [shim.so]
SO=${1:-/tmp/probe4/shim.so}
cd "$(dirname "$0")"
[ -x c/dupfork ] || gcc -O2 -o c/dupfork c/dupfork.c
run() { # $1 = preload or empty
  LD_PRELOAD=$1 python3 -c '
import socket,threading
ls=socket.socket(); ls.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1); ls.bind(("127.0.0.1",18411)); ls.listen(4)
for _ in range(1):
    c,_=ls.accept(); c.recv(10); c.close()' &
srv=$!; sleep 0.5
  LD_PRELOAD=$1 timeout 20 bash -c '
    exec 3<>/dev/tcp/127.0.0.1/18411; exec 4>&3
    s=$(date +%s%N); for i in 1 2 3 4 5 6 7 8 9 10; do /bin/true; done; e=$(date +%s%N)
    echo hi >&4; exec 3>&- 4>&-
    echo "bash: 10 fork+exec with a dup'"'"'d socket: $(( (e-s)/1000000 )) ms"; [ $(( (e-s)/1000000 )) -lt 500 ]'; r=$?; kill $srv 2>/dev/null; wait $srv 2>/dev/null; return $r
}
echo "--- kernel TCP"; ./c/dupfork p; a=$?; run ""; a2=$?
echo "--- shim"; LD_PRELOAD=$SO ./c/dupfork p; b=$?; run "$SO"; b2=$?
[ $a$a2$b$b2 = 0000 ] && { echo PASS; exit 0; }; echo DIFF; exit 1
