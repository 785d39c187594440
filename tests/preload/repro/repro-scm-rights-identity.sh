#!/bin/sh
# PASS over kernel TCP, DIFF under the shim. Usage: repro-scm-rights-identity.sh [shim.so]
SO=${1:-/tmp/probe4/shim.so}; D=$(dirname "$0")
t=$(timeout 20 python3 $D/repro-scm-rights-identity.py); echo "tcp:  $t"
s=$(LD_PRELOAD=$SO timeout 20 python3 $D/repro-scm-rights-identity.py); echo "shim: $s"
[ -n "$t" ] && [ "$t" = "$s" ] && { echo PASS; exit 0; }; echo DIFF; exit 1
