#!/bin/sh
# shellcheck disable=SC3045  # busybox sh has ulimit -l
# One of the two guests of `tests/rig/run --two-guests` (run by guest/init for rig.role=a or b).
# Two kernels, one rxe device each, joined by a virtio-net NIC on a qemu socket network (one TCP
# connection on the host's 127.0.0.1):
#   guest A: eth0 192.168.79.1/24 fd00:79::1/64 + rxe0 (the SDP servers)
#   guest B: eth0 192.168.79.2/24 fd00:79::2/64 + rxe0 (the SDP clients)
# With RIG_TWO_SIW=1 (tests/rig/run --two-siw) also a second NIC each, for soft-iWARP (its own netdev:
# rdma_cm picks the device by the address's netdev, so rxe and siw cannot share one):
#   guest A: eth1 192.168.80.1/24 fd00:80::1/64 + siw0      guest B: eth1 192.168.80.2/24 fd00:80::2/64 + siw0
# Coordination, over kernel TCP on eth0, one check at a time (rxe then siw; IPv4, then IPv6): A starts
# the server of a check, waits until it listens, then opens the check's beacon (a one-shot TCP listener
# on the SDP port - 1000); B waits for the beacon (at most 120 s), then runs the client.  At the end B
# tells A it is done (TCP 7398), and only then does A power off.  Each side checks its own process and
# its own packet counters (rxe0's; for siw, which has none, eth1's, which carries only siw's TCP), and
# prints its own RIG-CHECK lines and RIG-RESULT; tests/rig/run requires both guests to pass.
# Usage: two.sh a|b [MTU]
. /rig/config
. /rig/lib.sh
ulimit -l unlimited
ip() { /usr/sbin/ip "$@"; }
ROLE=$1 MTU=${2:-9000}
SDP=/rig/bin/sdp-rigtest
NC=/bin/nc.openbsd
A4=192.168.79.1 B4=192.168.79.2 A6=fd00:79::1 B6=fd00:79::2
CHECKS=${RIG_TWO_CHECKS:-bcopy zcopy zsend halfclose abort garbage-hello junk-after-hello kill refused sock-auto sock-registered sock-bcopy linkdel}
PEER=/rig/bin/sdp-peer
SOCK_BYTES=8388608
FAMILIES=${RIG_TWO_FAMILIES:-4 6}
FABRICS=rxe
[ "${RIG_TWO_SIW:-0}" = 1 ] && FABRICS="rxe siw"
case $ROLE in
  a) ME4=$A4 ME6=$A6 ;;
  b) ME4=$B4 ME6=$B6 ;;
  *) echo "two.sh: role a or b"; exit 2 ;;
esac

# --- this guest's counters: its rxe device, or for siw eth1's packets ---------------------------------
FAB=rxe
nstat() { cat "/sys/class/net/$1/statistics/$2" 2>/dev/null || echo 0; }
snap() {
  if [ "$FAB" = siw ]; then echo "$(nstat eth1 tx_packets) $(nstat eth1 rx_packets)"; return; fi
  echo "$(hc rxe0 sent_pkts) $(hc rxe0 rcvd_pkts)"
}
deltas() {   # deltas "$SNAP_BEFORE": sets D0S D0R
  # shellcheck disable=SC2086
  set -- $1 $(snap)
  D0S=$(($3 - $1)); D0R=$(($4 - $2))
}
pkts() { if [ "$FAB" = siw ]; then echo "eth1 tx+$D0S rx+$D0R"; else echo "rxe0 sent+$D0S rcvd+$D0R"; fi; }
crossed() { [ "$D0S" -gt 0 ] && [ "$D0R" -gt 0 ]; }

# --- network ---------------------------------------------------------------------------------------
section "two guests: guest $ROLE ($ME4, $ME6)"
ip link set eth0 mtu "$MTU" || echo "RIG: eth0 mtu $MTU refused"
ip link set eth0 up
ip addr add "$ME4/24" dev eth0
ip -6 addr add "$ME6/64" dev eth0 nodad
rdma link add rxe0 type rxe netdev eth0 || echo "RIG: rdma link add rxe0 failed"
if [ "${RIG_TWO_SIW:-0}" = 1 ]; then
  if [ "$ROLE" = a ]; then n=1; else n=2; fi
  ip link set eth1 mtu "$MTU" || echo "RIG: eth1 mtu $MTU refused"
  ip link set eth1 up
  ip addr add "192.168.80.$n/24" dev eth1
  ip -6 addr add "fd00:80::$n/64" dev eth1 nodad
  rdma link add siw0 type siw netdev eth1 || echo "RIG: rdma link add siw0 failed"
fi
i=0
while [ $i -lt 50 ] && ! grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null; do sleep 0.1; i=$((i + 1)); done
echo "RIG: network ready at $(now)s"
rdma link show
ip -br addr
ip -6 route show
topology() {
  grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state || { echo "rxe0 not ACTIVE"; return 1; }
  ibv_devinfo -d rxe0 | grep -E 'state|active_mtu'
  # the GIDs rxe made from eth0's addresses: the IPv4-mapped one and fd00:79::x (RoCE v2 both)
  want4="0000:0000:0000:0000:0000:ffff:$(printf '%02x%02x:%02x%02x' $(echo "$ME4" | tr . ' '))"
  want6="fd00:0079:0000:0000:0000:0000:0000:000${ME6##*:}"
  ok4=0 ok6=0
  for g in /sys/class/infiniband/rxe0/ports/1/gids/*; do
    v=$(cat "$g" 2>/dev/null) || continue
    case $v in 0000:0000:0000:0000:0000:0000:0000:0000) continue ;; esac
    t=$(cat "/sys/class/infiniband/rxe0/ports/1/gid_attrs/types/${g##*/}" 2>/dev/null)
    echo "gid[${g##*/}] $v $t"
    [ "$v" = "$want4" ] && ok4=1
    [ "$v" = "$want6" ] && ok6=1
  done
  [ $ok4 = 1 ] || { echo "no GID $want4"; return 1; }
  [ $ok6 = 1 ] || { echo "no GID $want6"; return 1; }
  if [ "${RIG_TWO_SIW:-0}" = 1 ]; then
    grep -q ACTIVE /sys/class/infiniband/siw0/ports/1/state || { echo "siw0 not ACTIVE"; return 1; }
    ibv_devinfo -d siw0 | grep -E 'transport|state'
  fi
  ls /sys/class/net
}
run_check "$ROLE:topology" topology
# the peer answers (kernel IPv4 and IPv6 over the qemu network): B waits for A, A for B
if [ "$ROLE" = a ]; then P4=$B4 P6=$B6; else P4=$A4 P6=$A6; fi
peer_up() {
  i=0
  while [ $i -lt 120 ]; do
    ping -c 1 -W 1 "$P4" >/dev/null 2>&1 && ping6 -c 1 -W 1 "$P6" >/dev/null 2>&1 && break
    i=$((i + 1))
  done
  ping -c 2 "$P4" && ping6 -c 2 "$P6"
}
run_check "$ROLE:peer-ping" peer_up
ip neigh show
# the route to the peer's address leaves by eth0 (in one kernel, the peer's address is local and the
# same lookup gives "local ... dev lo", which is why IPv6 fails in the one-guest rig: README.md)
ip -6 route get "$P6" from "$ME6" oif eth0
ip route get "$P4" from "$ME4" oif eth0

port() {   # port FABRIC FAMILY SCENARIO: rxe 74xx (IPv4), 75xx (IPv6); siw 76xx, 77xx
  n=0
  for c in bcopy zcopy zsend halfclose abort garbage-hello junk-after-hello kill refused \
           sock-auto sock-registered sock-bcopy linkdel; do
    [ "$c" = "$3" ] && break
    n=$((n + 1))
  done
  [ "$1" = siw ] && n=$((n + 200))
  if [ "$2" = 4 ]; then echo $((7471 + n)); else echo $((7571 + n)); fi
}
# fab_addrs FABRIC FAMILY: sets ip_a ip_b (A's and B's addresses) and dev
fab_addrs() {
  case $1$2 in
    rxe4) ip_a=$A4 ip_b=$B4 dev=rxe0 nic=eth0 ;;
    rxe6) ip_a=$A6 ip_b=$B6 dev=rxe0 nic=eth0 ;;
    siw4) ip_a=192.168.80.1 ip_b=192.168.80.2 dev=siw0 nic=eth1 ;;
    siw6) ip_a=fd00:80::1 ip_b=fd00:80::2 dev=siw0 nic=eth1 ;;
  esac
  FAB=$1
  if [ "$1" = rxe ]; then pfx=""; else pfx="$1-"; fi
}
# addr FAMILY HOST-IP PORT: host:port as sdp-rigtest parses it
addr() { if [ "$1" = 4 ]; then echo "$2:$3"; else echo "[$2]:$3"; fi; }
# The socket API's checks (sock-*: SdpListener/SdpStream of sdp-peer, a checksummed 8 MiB duplex
# exchange). sock_env CHECK: sets senv and cenv (server's and client's environment), mode (sdp-peer's),
# wl (the transports the server must list as listening) and want (what both streams must be over):
# automatic (every provider, the connector picks), or rdma only with registered buffers (zero copy) or
# plain copies. Over iWARP, whose connections use TCP's ports, automatic mode keeps to kernel TCP (an
# automatic listener cannot listen over iWARP beside its TCP socket, and an automatic connect would write
# an MPA request into the port's TCP server): sock-auto must go over tcp there, and the rdma-only checks
# listen SDP-only (SDP_PEER_LISTEN=sdp).
sock_env() {
  if [ "$FAB" = siw ]; then sl="SDP_PEER_LISTEN=sdp" aw=tcp awl=shm; else sl="" aw=rdma awl=shm,rdma; fi
  case $1 in
    sock-auto) senv="SDP_X=1" cenv="SDP_X=1" mode=auto wl=$awl want=$aw ;;
    sock-registered) senv="SDP_PROVIDERS=rdma $sl" cenv="SDP_PROVIDERS=rdma" mode=zcopy wl=rdma want=rdma ;;
    sock-bcopy) senv="SDP_PROVIDERS=rdma $sl" cenv="SDP_X=1" mode=bcopy wl=rdma want=rdma ;;
  esac
}

# counters of rxe0 that are not zero, and eth0's drops (what a slow or lossy link shows)
counters() {
  for c in /sys/class/infiniband/rxe0/ports/1/hw_counters/*; do
    v=$(cat "$c" 2>/dev/null) && [ "$v" != 0 ] && printf '%s=%s ' "${c##*/}" "$v"
  done
  echo
  ip -s link show eth0 | sed 's/^/  /'
}

# --- guest A: the servers, one at a time -----------------------------------------------------------
# For each check: start the server, wait until it listens, open the check's beacon (a one-shot TCP
# listener on the SDP port - 1000); B probes the beacon, then runs its client; A waits for the server.
if [ "$ROLE" = a ]; then
  # B's last checks (refused: nobody listens, A's kernel answers) need A up: A powers off only when B
  # says it is done (it connects to this one-shot listener), or 120 s after A's own last check
  $NC -l 7398 >/dev/null 2>&1 </dev/null &
  done_pid=$!
  for fab in $FABRICS; do for f in $FAMILIES; do
    fab_addrs "$fab" "$f"
    section "A: SDP servers over IPv$f on $dev ($ip_a)"
    for c in $CHECKS; do
      [ "$c" = refused ] && continue   # nobody listens: B's client must get ECONNREFUSED
      name=${pfx}v$f-sdp-$c
      p=$(port "$fab" "$f" "$c")
      base=$(listeners); s0=$(snap); t0=$(now); why=""
      case $c in
        sock-*)
          sock_env "$c"
          # shellcheck disable=SC2086
          timeout 300 env $senv $PEER serve "$(addr "$f" "$ip_a" "$p")" $mode 11 22 $SOCK_BYTES >"$LOGD/$name.srv" 2>&1 &
          spid=$!
          # it listens on every transport before it says so (the kernel's listener comes first)
          i=0
          while [ $i -lt 150 ] && ! grep -q '^listening' "$LOGD/$name.srv" && kill -0 $spid 2>/dev/null; do sleep 0.1; i=$((i + 1)); done
          grep -q '^listening' "$LOGD/$name.srv" || why="server not listening after 15 s; " ;;
        *)
          timeout 300 $SDP server "$c" "$(addr "$f" "$ip_a" "$p")" >"$LOGD/$name.srv" 2>&1 &
          spid=$!
          wait_listen "$base" "$spid" || why="server not listening after 15 s; " ;;
      esac
      $NC -l $((p - 1000)) >/dev/null 2>&1 </dev/null &
      bpid=$!
      if [ "$c" = linkdel ]; then
        # A's device goes away under a transfer both ways: A's server fails with ENETDOWN, and B's
        # client, whose peer vanished without a word, must get an error too (within 20 s of the last
        # progress), never hang. The counters are read before (a new device starts from zero; pkts
        # below prints these).
        i=0
        while [ $i -lt 600 ] && ! grep -q '^accepted' "$LOGD/$name.srv" && kill -0 $spid 2>/dev/null; do sleep 0.1; i=$((i + 1)); done
        sleep 2
        deltas "$s0"
        crossed || why="${why}$(pkts | cut -d' ' -f1) counters did not both increase; "
        timeout 60 rdma link delete "$dev" || why="${why}rdma link delete $dev failed or waited 60 s; "
      fi
      wait "$spid"; rc=$?
      kill "$bpid" 2>/dev/null; wait "$bpid" 2>/dev/null
      [ $rc = 0 ] || why="${why}server exit $rc; "
      if [ "$c" = linkdel ]; then
        rdma link add "$dev" type "$fab" netdev "$nic" || why="${why}rdma link add $dev failed; "
        i=0
        while [ $i -lt 100 ] && ! grep -q ACTIVE /sys/class/infiniband/$dev/ports/1/state 2>/dev/null; do sleep 0.1; i=$((i + 1)); done
        grep -q ACTIVE /sys/class/infiniband/$dev/ports/1/state 2>/dev/null || why="${why}$dev not ACTIVE again; "
      else
        deltas "$s0"
        crossed || why="${why}$(pkts | cut -d' ' -f1) counters did not both increase; "
      fi
      case $c in sock-*)
        grep -q "^listening $wl " "$LOGD/$name.srv" || why="${why}not listening on $wl ($(grep '^listening' "$LOGD/$name.srv")); "
        grep -q "^accepted $want\$" "$LOGD/$name.srv" || why="${why}accepted stream not over $want; " ;;
      esac
      if [ -z "$why" ]; then
        show "$LOGD/$name.srv" | grep -E 'moved|closed|bad connection|failed during setup|ECONN|refused' | tail -2
        pass "A:$name" "$(since "$t0")s; $(pkts)"
      else
        show "$LOGD/$name.srv" | tail -8
        fail "A:$name" "${why%; } ($(since "$t0")s; $(pkts))"
      fi
    done
  done; done
  if [ "${RIG_BENCH:-0}" = 1 ]; then . /rig/two-bench.sh; tb_run; fi
  t0=$(now); i=0
  while [ $i -lt 1200 ] && kill -0 $done_pid 2>/dev/null; do sleep 0.1; i=$((i + 1)); done
  if kill -0 $done_pid 2>/dev/null; then
    kill $done_pid; echo "  B did not say it was done within 120 s"
  else
    echo "  B is done ($(since "$t0")s after A's last check)"
  fi
  echo "  A's rxe0: $(counters)"
  finish
  exit 0
fi

# --- guest B: the clients --------------------------------------------------------------------------
for fab in $FABRICS; do for f in $FAMILIES; do
  fab_addrs "$fab" "$f"
  section "B: SDP clients over IPv$f ($dev $ip_b -> A $ip_a)"
  for c in $CHECKS; do
    name=${pfx}v$f-sdp-$c
    p=$(port "$fab" "$f" "$c")
    dst=$(addr "$f" "$ip_a" "$p")
    if [ "$c" != refused ]; then   # wait for A's server (its beacon), at most 120 s
      i=0
      while [ $i -lt 240 ] && ! $NC -z -w 1 $A4 $((p - 1000)) 2>/dev/null; do sleep 0.5; i=$((i + 1)); done
    fi
    s0=$(snap); t0=$(now)
    case $c in
      refused)
        timeout 60 $SDP refused "$dst" "$ip_b" >"$LOGD/$name.cli" 2>&1; rc=$? ;;
      kill)
        timeout 120 $SDP client kill "$dst" "$ip_b" >"$LOGD/$name.cli" 2>&1 &
        cpid=$!
        i=0
        while [ $i -lt 300 ] && ! grep -q '^connected' "$LOGD/$name.cli" 2>/dev/null && kill -0 $cpid 2>/dev/null; do sleep 0.1; i=$((i + 1)); done
        if grep -q '^connected' "$LOGD/$name.cli"; then
          sleep 2   # data in flight both ways
          kill -9 $cpid; wait $cpid 2>/dev/null; rc=0
          echo "killed (SIGKILL) after $(since "$t0")s" >>"$LOGD/$name.cli"
        else
          kill $cpid 2>/dev/null; wait $cpid; rc=1
          echo "never connected" >>"$LOGD/$name.cli"
        fi ;;
      sock-*)
        sock_env "$c"
        # shellcheck disable=SC2086
        timeout 300 env $cenv SDP_PEER_SRC="$ip_b" SDP_PEER_SHOW=1 $PEER duplex "$dst" $mode 22 11 $SOCK_BYTES \
          >"$LOGD/$name.cli" 2>&1; rc=$?
        [ $rc = 0 ] && ! grep -q "^transport $want\$" "$LOGD/$name.cli" && rc=99 ;;
      *)
        timeout 300 $SDP client "$c" "$dst" "$ip_b" >"$LOGD/$name.cli" 2>&1; rc=$? ;;
    esac
    deltas "$s0"
    if [ $rc = 0 ] && { [ "$c" = refused ] || crossed; }; then
      show "$LOGD/$name.cli" | tail -2
      pass "B:$name" "$(since "$t0")s; $(pkts)"
    else
      show "$LOGD/$name.cli" | tail -10
      why="client exit $rc"
      [ $rc = 99 ] && why="the client's stream was not over $want ($(grep '^transport' "$LOGD/$name.cli"))"
      [ "$c" = refused ] || crossed || why="$why; $(pkts | cut -d' ' -f1) counters did not both increase"
      fail "B:$name" "$why ($(since "$t0")s; $(pkts))"
    fi
  done
done; done
if [ "${RIG_BENCH:-0}" = 1 ]; then . /rig/two-bench.sh; tb_run; fi
i=0   # tell A that B is done (A stays up until then)
while [ $i -lt 60 ] && ! $NC -z -w 1 $A4 7398 2>/dev/null; do sleep 1; i=$((i + 1)); done
echo "  B's rxe0: $(counters)"
finish
