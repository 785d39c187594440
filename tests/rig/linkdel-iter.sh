#!/bin/sh
# tests/rig/linkdel-iter.sh: one run of the rig's sdp-soak-linkdel check (as guest/sdp.sh runs it), for
# repeating it many times in one boot. The deletion's timings go to /tmp/ld.times.N; on a failure the
# soak's log and a timeline (its trace and the command's times) go to the serial console, and a run still
# going after 180 s is dumped (thread states, kernel stacks, and the threads' stacks by gdb when /extra/gdb
# is there, with a Python standard library in /extra/py/lib/python3.11) and killed. From the host:
#
#   mkdir -p /tmp/ld && cp tests/rig/linkdel-iter.sh /tmp/ld/iter.sh   # (optionally /usr/bin/gdb and py/)
#   args=; for i in $(seq 1 40); do args="$args --guest-test '/extra/iter.sh $i'"; done
#   eval tests/rig/run --guest-test-only --no-siw --no-lat --timeout 1800 --extra /tmp/ld $args
#
# Usage in the guest: iter.sh N [SOAK ARGS...]
n=$1; shift
B=192.168.77.2 A=192.168.77.1 DEV1=rxe1 NET1=veth1
T=/tmp/ld.times.$n L=/tmp/ld.log.$n
: >$T
env SDP_PROVIDERS=rdma /rig/bin/sdp-soak --transport sdp --listen "$B:7601" \
    --source-ip "$A" --seconds 20 --gib 1 --workers 2 --faults cmd,kill --fault-interval 3 "$@" \
    --fault-cmd "echo \$(cut -d' ' -f1 /proc/uptime) CMD delete-start >>$T; timeout 30 rdma link delete $DEV1; echo \$(cut -d' ' -f1 /proc/uptime) CMD delete-done rc=\$? >>$T; rdma link add $DEV1 type rxe netdev $NET1; echo \$(cut -d' ' -f1 /proc/uptime) CMD add-done rc=\$? >>$T; sleep 2" >$L 2>&1 &
spid=$!
k=0
while kill -0 $spid 2>/dev/null && [ $k -lt 1800 ]; do sleep 0.1; k=$((k + 1)); done
if kill -0 $spid 2>/dev/null; then
  {
    echo "==== ITER $n STUCK after 180 s: states"
    for p in /proc/[0-9]*; do
      c=$(cat $p/comm 2>/dev/null); case $c in sdp-soak|rdma|sh|sleep|timeout) ;; *) continue ;; esac
      echo "ITER$n PROC ${p#/proc/} $c $(awk '{print $3}' $p/stat 2>/dev/null) wchan=$(cat $p/wchan 2>/dev/null) args=$(tr '\0' ' ' <$p/cmdline 2>/dev/null | cut -c1-120)"
      [ "$c" = sdp-soak ] || [ "$c" = rdma ] && for t in $p/task/*; do echo "ITER$n   task ${t##*/} $(cat $t/comm) $(awk '{print $3}' $t/stat) wchan=$(cat $t/wchan 2>/dev/null)"; cat $t/stack 2>/dev/null | head -8 | sed "s/^/ITER$n     /"; done
    done
    [ -x /extra/gdb ] && PYTHONHOME=/extra/py /extra/gdb -batch -nx -p $spid -ex 'set pagination off' -ex 'thread apply all bt 40' 2>&1 | grep -vE '^\[(New LWP|Thread debugging)' | cut -c1-220 | head -150 | sed "s/^/ITER$n GDB /"
    rdma link show | sed "s/^/ITER$n LINK /"
    rdma res show qp 2>/dev/null | head -20 | sed "s/^/ITER$n QP /"
    dmesg | tail -30 | sed "s/^/ITER$n DMESG /"
    sed "s/^/ITER$n LOG | /" $L | tail -60
    sed "s/^/ITER$n T /" $T
  } >/dev/ttyS0 2>&1
  kill -ABRT $spid; sleep 1; kill -9 $spid 2>/dev/null
  for p in $(pidof sdp-soak); do kill -9 $p; done
  wait $spid; rc=99
else
  wait $spid; rc=$?
fi
i=0
while [ $i -lt 100 ] && ! grep -q ACTIVE /sys/class/infiniband/$DEV1/ports/1/state 2>/dev/null; do
  [ $i = 0 ] && rdma link add "$DEV1" type rxe netdev "$NET1" 2>/dev/null
  sleep 0.1; i=$((i + 1))
done
grep -E '^sdp-soak: (PASS|FAIL)|FAIL:|sessions [0-9]|faults injected' $L | cut -c1-600
if [ $rc != 0 ]; then
  {
    echo "==== ITER $n FAILED (rc $rc): full log and timeline"
    grep -v '^  trace ' $L | sed 's/^/ITER'$n' | /'
    { grep '^  trace ' $L | sed 's/^  trace //'; cat $T; } | sort -n | sed 's/^/ITER'$n' T /'
    echo "==== ITER $n end"
  } >/dev/ttyS0 2>&1
fi
exit $rc
