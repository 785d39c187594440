#!/bin/sh
# IPv6 within one kernel (the one-guest rig), the demonstration in tests/rig/README.md ("Two guests"):
#   tests/rig/run --shell --extra tests/rig/demo    then in the guest:  sh /extra/v6-one-kernel.sh
# (non-interactively: { sleep 25; echo "sh /extra/v6-one-kernel.sh 2>&1; poweroff -f"; sleep 100; } |
#  timeout 160 tests/rig/run --shell --extra tests/rig/demo)
# one kernel: rxe0 on veth0 (fd77::1), rxe1 on veth1 (fd77::2); as tests/rig/guest/net-setup.sh for IPv4
IP=/usr/sbin/ip
set -x
$IP -6 addr add fd77::1/64 dev veth0 nodad
$IP -6 addr add fd77::2/64 dev veth1 nodad
sleep 1
$IP -6 -br addr
set +x   # the GIDs rxe made for the addresses (without the thousand paths of the glob)
grep -l fd77 /sys/class/infiniband/rxe*/ports/1/gids/* | while read -r g; do echo "$g $(cat "$g")"; done
set -x
# rdma_cm's check of an incoming request on veth1 (validate_ipv6_net_dev): a route lookup for the
# requester's address fd77::1, which is local to this kernel
$IP -6 route get fd77::1 from fd77::2 oif veth1
$IP -6 route get fd77::1
$IP -6 route show table local | grep fd77
# and IPv4, for comparison (validate_ipv4_net_dev: fib_lookup with iif veth1, accept_local=1)
$IP route get 192.168.77.1 from 192.168.77.2 iif veth1
/rig/bin/sdp-rigtest server bcopy '[fd77::2]:7471' > /tmp/srv.log 2>&1 &
sleep 2
timeout 20 /rig/bin/sdp-rigtest client bcopy '[fd77::2]:7471' fd77::1
echo "client exit $?"
kill %1 2>/dev/null; sleep 1; cat /tmp/srv.log
timeout 20 rping -s -a fd77::2 -C 1 -S 64 > /tmp/rping-s.log 2>&1 &
sleep 2
timeout 20 rping -c -d -I fd77::1 -a fd77::2 -C 1 -S 64
echo "rping client exit $?"
kill %1 2>/dev/null
cat /tmp/rping-s.log
echo V6DEMO-DONE
