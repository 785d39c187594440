#!/bin/sh
# shellcheck disable=SC3045  # busybox sh has ulimit -l
# The rig's guest test suite.  Every check prints a "RIG-CHECK: PASS|FAIL name" line; the end prints
# "RIG-RESULT: PASS|FAIL n=N fail=F" and "P passed, F failed", which tests/rig/run reads.
# Client side: rxe0 / veth0 / 192.168.77.1 ($A); server side: rxe1 / veth1 / 192.168.77.2 ($B).
# rdma_cm clients bind their source to $A, or the connection would loop back inside one device.
# Adding a check is one line: see the helpers in lib.sh (rdma_pair, run_check, run_suite).
. /rig/config
. /rig/lib.sh
ulimit -l unlimited

if [ "${RIG_QUICK:-0}" = 1 ]; then N_PING=5 N_PP=200 N_RS=100 N_BW=200; else N_PING=20 N_PP=1000 N_RS=400 N_BW=1000; fi
G0=$(gid_idx rxe0 $A)
G1=$(gid_idx rxe1 $B)

section "topology"
for d in rxe0 rxe1; do
  echo "  $d: $(ibv_devinfo -d $d 2>&1 | grep -E 'state|active_mtu' | tr -s '\t ' ' ' | tr '\n' ' ')"
done
echo "  rxe0 gid[$G0]=$(cat /sys/class/infiniband/rxe0/ports/1/gids/$G0 2>/dev/null)  rxe1 gid[$G1]=$(cat /sys/class/infiniband/rxe1/ports/1/gids/$G1 2>/dev/null)"
echo "  net devices: $(ls /sys/class/net | tr '\n' ' ')(only lo, veth0, veth1: no NIC towards the host)"
topology_ok() {
  for d in rxe0 rxe1; do
    grep -q ACTIVE /sys/class/infiniband/$d/ports/1/state || { echo "$d port not ACTIVE"; return 1; }
  done
  [ "$RIG_MTU" -lt 4200 ] || ibv_devinfo -d rxe0 | grep 'active_mtu:.*4096' >/dev/null || { echo "rxe0 active_mtu is not 4096"; return 1; }
  [ ! -e /sys/class/net/eth0 ] || { echo "unexpected NIC eth0"; return 1; }
  ibv_devices
}
run_check topology topology_ok

# commands given with tests/rig/run --guest-test CMD, one check each
extra_tests() {
  i=0
  while IFS= read -r cmd; do
    [ -n "$cmd" ] || continue
    i=$((i + 1))
    # shellcheck disable=SC2086
    run_check "guest-test-$i:$(basename "${cmd%% *}")" sh -c "$cmd"
  done </rig/extra-tests
}

if [ "${RIG_SIW_ONLY:-0}" = 1 ]; then
  section "rxe checks skipped (tests/rig/run --siw-only)"
  . /rig/siw.sh
  extra_tests
  finish
  exit 0
fi
if [ "${RIG_GT_ONLY:-0}" = 1 ]; then
  section "checks skipped (tests/rig/run --guest-test-only)"
  extra_tests
  finish
  exit 0
fi
if [ "${RIG_LAT_ONLY:-0}" = 1 ]; then
  section "checks skipped (tests/rig/run --lat-only)"
  . /rig/lat.sh
  finish
  exit 0
fi
if [ "${RIG_BENCH_ONLY:-0}" = 1 ]; then
  section "checks skipped (tests/rig/run --bench-only)"
  if [ "${RIG_LAT:-1}" = 1 ]; then . /rig/lat.sh; fi
  . /rig/bench.sh
  finish
  exit 0
fi

section "smoke: real RDMA between rxe0 and rxe1"
#          name             server command                                          client command
rdma_pair  rping            "rping -s -a $B -C $N_PING -S 64 -V"                    "rping -c -I $A -a $B -C $N_PING -S 64 -V"
rdma_pair  ibv_rc_pingpong  "ibv_rc_pingpong -d rxe1 -g $G1 -n $N_PP"               "ibv_rc_pingpong -d rxe0 -g $G0 -n $N_PP $B"
rdma_pair  rstream          "rstream -b $B -S 65536 -C $N_RS -T v"                  "rstream -b $A -s $B -S 65536 -C $N_RS -T v"
rdma_pair  ib_write_bw_cm   "ib_write_bw -R -d rxe1 -s 65536 -n $N_BW -F"            "$CM_SRC_A ib_write_bw -R -d rxe0 -s 65536 -n $N_BW -F $B"

# SDP over the project's rdma provider (the binary tests/rig/run builds and puts in /rig/bin)
if [ -x /rig/bin/sdp-rigtest ]; then . /rig/sdp.sh; else section "sdp"; echo "  (no /rig/bin/sdp-rigtest: tests/rig/run --no-sdp)"; fi

# unmodified programs under the project's LD_PRELOAD shim (SDP over rdma) and under rsockets' librspreload
if [ -f /rig/lib/libsdp_preload.so ]; then . /rig/preload.sh; else section "preload"; echo "  (no /rig/lib/libsdp_preload.so: tests/rig/run --no-sdp)"; fi

# soft-iWARP: smoke checks and the SDP checks again over siw0/siw1 (guest/siw.sh)
if [ "${RIG_SIW:-0}" = 1 ]; then . /rig/siw.sh; fi

section "project tests"
# the project's own guest test binary, when tests/rig/run --extra DIR brought one
if [ -x /extra/sdp-rig-tests ]; then run_suite sdp-rig-tests /extra/sdp-rig-tests; else echo "  (no /extra/sdp-rig-tests)"; fi
extra_tests

# ping-pong latency rows (guest/lat.sh; short in the default run: 64 B; --bench: 64 B, 4 KiB, 64 KiB)
if [ "${RIG_LAT:-1}" = 1 ]; then . /rig/lat.sh; fi
if [ "${RIG_BENCH:-0}" = 1 ]; then . /rig/bench.sh; fi
finish
