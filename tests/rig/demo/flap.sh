#!/bin/sh
# A 3 s link flap under transfers (tests/rig/run --quick --siw-only --extra tests/rig/demo --guest-test /extra/flap.sh):
# perftest ib_write_bw, then SDP bcopy; prints rxe hw counters. Over rxe (6.1) perftest hangs after the flap
# (killed at 40 s); SDP ends in ETIMEDOUT about 60 s after it (Config::send_stall_timeout; TODO.md).
A=192.168.77.1 B=192.168.77.2 P=/rig/bin/sdp-peer
up() { cut -d' ' -f1 /proc/uptime; }
hc() { for d in rxe0 rxe1; do for f in /sys/class/infiniband/$d/ports/1/hw_counters/*; do v=$(cat $f); [ "$v" != 0 ] && printf '%s:%s=%s ' $d ${f##*/} $v; done; done; echo; }
echo "== perftest ib_write_bw under a 3 s flap"
timeout 40 ib_write_bw -R -d rxe1 -s 65536 -n 20000 -F >/tmp/pt.srv 2>&1 &
s=$!; sleep 2
timeout 40 env LD_PRELOAD=/rig/lib/cm_src_preload.so RIG_CM_SRC=$A ib_write_bw -R -d rxe0 -s 65536 -n 20000 -F $B >/tmp/pt.cli 2>&1 &
c=$!; sleep 3
hc
ip link set veth1 down; sleep 3; ip link set veth1 up; echo "link up at $(up)"
wait $c; echo "perftest client rc $? at $(up)"; wait $s; echo "server rc $?"
tail -4 /tmp/pt.cli
hc
echo "== SDP bcopy under a 3 s flap"
timeout 120 env SDP_PROVIDERS=rdma $P serve $B:7702 bcopy 11 22 67108864 >/tmp/f.srv 2>&1 &
s=$!
i=0; while [ $i -lt 100 ] && ! grep -q '^listening' /tmp/f.srv; do sleep 0.1; i=$((i+1)); done
timeout 120 env SDP_PROVIDERS=rdma SDP_PEER_SRC=$A SDP_PEER_SHOW=1 $P duplex $B:7702 bcopy 22 11 67108864 >/tmp/f.cli 2>&1 &
c=$!
i=0; while [ $i -lt 300 ] && ! grep -q '^transport' /tmp/f.cli; do sleep 0.1; i=$((i+1)); done
sleep 0.5; hc
ip link set veth1 down; sleep 3; ip link set veth1 up; echo "link up at $(up)"
sleep 10; echo "10 s later:"; hc
wait $c; echo "client rc $? at $(up)"; wait $s; echo "server rc $? at $(up)"
cat /tmp/f.cli /tmp/f.srv; hc
exit 0
