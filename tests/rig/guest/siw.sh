# shellcheck shell=sh
# soft-iWARP (sourced by tests.sh when tests/rig/run built siw.ko, RIG_SIW=1): siw0 on veth2
# (192.168.78.1, client side) and siw1 on veth3 (192.168.78.2, server side), made by net-setup.sh.
# The smoke checks that have an rdma_cm mode, then the SDP checks of guest/sdp.sh with the siw
# addresses (check names prefixed siw-).  siw has no hw counters and runs over kernel TCP, which goes
# through lo between two local addresses: a check's counters are TCP segments (lib.sh, FABRIC=siw).
# Not run over iWARP: ibv_rc_pingpong (connects QPs by GID without the CM; iWARP QPs need the CM).
SA=192.168.78.1 SB=192.168.78.2
section "siw: soft-iWARP between siw0 ($SA) and siw1 ($SB)"
siw_topology() {
  for d in siw0 siw1; do
    [ -d /sys/class/infiniband/$d ] || { echo "no $d (siw module: $(cat /sys/module/siw/initstate 2>/dev/null || echo 'not loaded'))"; return 1; }
    grep -q ACTIVE /sys/class/infiniband/$d/ports/1/state || { echo "$d port not ACTIVE"; return 1; }
    t=$(ibv_devinfo -d $d | awk '/transport:/ {print $2; exit}')
    echo "$d: transport $t, node_type $(cat /sys/class/infiniband/$d/node_type)"
    [ "$t" = iWARP ] || { echo "$d: transport '$t', not iWARP"; return 1; }
  done
  rdma link show | grep siw
}
run_check siw-topology siw_topology
if [ -d /sys/class/infiniband/siw0 ] && [ -d /sys/class/infiniband/siw1 ]; then
  FABRIC=siw
  OA=$A OB=$B OCM=$CM_SRC_A
  A=$SA B=$SB CM_SRC_A="env LD_PRELOAD=/rig/lib/cm_src_preload.so RIG_CM_SRC=$SA"
  #          name                server command                                   client command
  rdma_pair  siw-rping           "rping -s -a $B -C $N_PING -S 64 -V"             "rping -c -I $A -a $B -C $N_PING -S 64 -V"
  rdma_pair  siw-rstream         "rstream -b $B -S 65536 -C $N_RS -T v"           "rstream -b $A -s $B -S 65536 -C $N_RS -T v"
  # perftest's rdma_cm connect over siw was once refused right after the previous tool's run on the
  # same port (then perftest crashed, 1 boot of many, 2026-11-26): tried once more, reported FLAKY
  rdma_pair_flaky siw-ib_write_bw_cm  "ib_write_bw -R -d siw1 -s 65536 -n $N_BW -F"    "$CM_SRC_A ib_write_bw -R -d siw0 -s 65536 -n $N_BW -F $B"
  rdma_pair_flaky siw-ib_read_bw_cm   "ib_read_bw -R -d siw1 -s 65536 -n $N_BW -F"     "$CM_SRC_A ib_read_bw -R -d siw0 -s 65536 -n $N_BW -F $B"
  rdma_pair_flaky siw-ib_send_lat_cm  "ib_send_lat -R -d siw1 -s 64 -n $N_PP -F"       "$CM_SRC_A ib_send_lat -R -d siw0 -s 64 -n $N_PP -F $B"
  if [ -x /rig/bin/sdp-rigtest ]; then
    PFX=siw- DEV1=siw1 NET1=veth3 DEVTYPE=siw
    . /rig/sdp.sh
    PFX="" DEV1=rxe1 NET1=veth1 DEVTYPE=rxe
  fi
  FABRIC=rxe
  A=$OA B=$OB CM_SRC_A=$OCM
fi
