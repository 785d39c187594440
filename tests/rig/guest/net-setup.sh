#!/bin/sh
# Guest topology: a veth pair in the root namespace, one Soft-RoCE device on each end.
#   veth0 192.168.77.1/24 + rxe0   <->   veth1 192.168.77.2/24 + rxe1
# Usage: net-setup.sh [MTU]   (9000 gives rxe active_mtu 4096; 1500 gives 1024)
# Both addresses are local to one namespace, so a packet arriving on veth0 from 192.168.77.2 would be
# dropped as a martian without accept_local=1 / rp_filter=0; arp_ignore=1 keeps each veth answering
# ARP only for its own address.  rxe sends its UDP with the oif of its own netdev, so rxe0 -> .2 leaves
# through veth0 and arrives on veth1 (rxe1), as long as the rdma_cm client binds its source address.
# (Moving veth1/rxe1 into another netns does not work on this kernel: rxe sends from the root netns.)
ip() { /usr/sbin/ip "$@"; }   # iproute2; busybox sh would otherwise run its own ip applet
MTU=${1:-9000}
A=192.168.77.1 B=192.168.77.2
conf() { echo "$3" >"/proc/sys/net/ipv4/conf/$1/$2"; }
ip link add veth0 type veth peer name veth1
ip link set veth0 mtu "$MTU"
ip link set veth1 mtu "$MTU"
conf all rp_filter 0
conf default rp_filter 0
for i in veth0 veth1; do conf $i accept_local 1; conf $i rp_filter 0; conf $i arp_ignore 1; done
ip addr add $A/24 dev veth0
ip addr add $B/24 dev veth1
ip link set veth0 up
ip link set veth1 up
rdma link add rxe0 type rxe netdev veth0 || echo "RIG: rdma link add rxe0 failed"
rdma link add rxe1 type rxe netdev veth1 || echo "RIG: rdma link add rxe1 failed"
# soft-iWARP (tests/rig/run builds siw.ko; RIG_SIW=1): its own veth pair and subnet, so an address
# names one fabric (rdma_cm picks the device by the address's netdev):
#   veth2 192.168.78.1/24 + siw0   <->   veth3 192.168.78.2/24 + siw1
# siw carries iWARP over kernel TCP sockets; between two local addresses that TCP goes through lo.
if [ "${RIG_SIW:-0}" = 1 ]; then
  ip link add veth2 type veth peer name veth3
  for i in veth2 veth3; do ip link set $i mtu "$MTU"; conf $i accept_local 1; conf $i rp_filter 0; conf $i arp_ignore 1; done
  ip addr add 192.168.78.1/24 dev veth2
  ip addr add 192.168.78.2/24 dev veth3
  ip link set veth2 up
  ip link set veth3 up
  if [ -d /sys/module/siw ]; then
    rdma link add siw0 type siw netdev veth2 || echo "RIG: rdma link add siw0 failed"
    rdma link add siw1 type siw netdev veth3 || echo "RIG: rdma link add siw1 failed"
  else
    echo "RIG: siw module not loaded"
  fi
fi
# wait (bounded) for both ports to become ACTIVE
i=0
while [ $i -lt 50 ]; do
  s0=$(cat /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null)
  s1=$(cat /sys/class/infiniband/rxe1/ports/1/state 2>/dev/null)
  case "$s0 $s1" in *ACTIVE*ACTIVE*) break ;; esac
  sleep 0.1; i=$((i + 1))
done
rdma link show
ip -br addr
