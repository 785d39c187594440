#!/bin/bash
# A client connects over SDP, writes 100 bytes and resets (SO_LINGER {1,0}) and exits before the
# server accepts (the server sleeps 300 ms first). Kernel TCP: accept() returns the connection,
# getsockname() answers, read() gives the 100 bytes, then ECONNRESET. Under the shim, in ~10%
# of runs the connection never reaches the accept queue: accept() waits for ever (the 100 bytes
# are lost). Found by a helper probing programs (2026-11-28; Java's ServerSocket.accept() also
# threw "Transport endpoint is not connected" from getsockname, fixed since).
# Exit 0 when shim == TCP in every run, 1 when they differ.
SHIM=${SHIM:-$(cd "$(dirname "$0")/../../.." && pwd)/target/release/libsdp_preload.so}; N=${N:-20}
D=$(cd "$(dirname "$0")" && pwd); B=$(mktemp -d); trap 'rm -rf $B' EXIT
gcc -O1 -include stdlib.h -o $B/accept_reset $D/reset-before-accept.c || exit 2
tcp=$(timeout 5 $B/accept_reset)
same=0; hang=0; other=0
for _ in $(seq $N); do
  shim=$(LD_PRELOAD=$SHIM timeout 5 $B/accept_reset 2>/dev/null); rc=$?
  if [ $rc = 124 ]; then hang=$((hang+1)); elif [ "$shim" = "$tcp" ]; then same=$((same+1)); else other=$((other+1)); fi
done
echo "kernel TCP:"; echo "$tcp"
echo "shim, $N runs: same=$same accept-hang=$hang other=$other"
[ $same = $N ]
