# shellcheck shell=sh
# SDP over the project's real `rdma` provider (sourced by tests.sh when /rig/bin/sdp-rigtest exists;
# tests/rig/run builds it with `cargo build --release -p sdp-tests --features rdma`).
# Every scenario is a server on rxe1 ($B) and a client on rxe0 ($A), one RIG-CHECK line each; see the
# header of tests/src/bin/sdp-rigtest.rs for what each side asserts.
SDP=/rig/bin/sdp-rigtest
# guest/siw.sh sources this again with PFX=siw- (check names), DEV1=siw1 NET1=veth3 DEVTYPE=siw (the
# server's device, which sdp-linkdel deletes and adds back) and A/B set to the siw addresses.
PFX=${PFX:-} DEV1=${DEV1:-rxe1} NET1=${NET1:-veth1} DEVTYPE=${DEVTYPE:-rxe}

# sdp_survivor NAME SCENARIO PORT: server and client stream both ways; once the client is connected and
# data flows, ACTION breaks the connection (kill -9 of the client, or deleting rxe1).  The surviving
# side(s) must report an error, in time, and exit 0.
sdp_survivor() {
  name=$1 action=$2 port=$3
  rm -f "$LOGD/$name.srv" "$LOGD/$name.cli"
  s0=$(snap); t0=$(now); base=$(listeners); why=""
  timeout 120 $SDP server "$action" "$B:$port" >"$LOGD/$name.srv" 2>&1 &
  spid=$!
  wait_listen "$base" "$spid" || why="server not listening; "
  timeout 120 $SDP client "$action" "$B:$port" "$A" >"$LOGD/$name.cli" 2>&1 &
  cpid=$!
  i=0
  while [ $i -lt 150 ] && ! grep -q '^connected' "$LOGD/$name.cli"; do sleep 0.1; i=$((i + 1)); done
  sleep 2   # data in flight
  # the counters before the action (rxe1 is deleted and made anew by linkdel, which resets its own)
  deltas "$s0"
  crossed || why="${why}packet counters did not all increase; "
  P=$(pkts)
  tk=$(now)
  case $action in
    kill)
      kill -9 "$cpid"; wait "$cpid" 2>/dev/null
      wait "$spid"; src=$?; crc=0
      took=$(since "$tk")
      [ $src = 0 ] || why="${why}server exit $src; " ;;
    linkdel)
      timeout 60 rdma link delete "$DEV1"; lrc=$?
      [ $lrc = 0 ] || why="${why}rdma link delete $DEV1: exit $lrc; "
      wait "$spid"; src=$?; wait "$cpid"; crc=$?
      took=$(since "$tk")
      [ $src = 0 ] || why="${why}server exit $src; "
      [ $crc = 0 ] || why="${why}client exit $crc; "
      # bring the device back, so later checks and benchmarks still have it
      rdma link add "$DEV1" type "$DEVTYPE" netdev "$NET1" || why="${why}rdma link add $DEV1 failed; "
      i=0
      while [ $i -lt 100 ] && ! grep -q ACTIVE /sys/class/infiniband/$DEV1/ports/1/state 2>/dev/null; do sleep 0.1; i=$((i + 1)); done
      grep -q ACTIVE /sys/class/infiniband/$DEV1/ports/1/state 2>/dev/null || why="${why}$DEV1 not ACTIVE again; " ;;
  esac
  if [ -z "$why" ]; then
    show "$LOGD/$name.srv" | grep -E 'moved|closed' | tail -2
    [ "$action" = linkdel ] && show "$LOGD/$name.cli" | grep -E 'moved' | tail -1
    pass "$PFX$name" "all sides done ${took}s after the $action; before it: $P"
  else
    echo "  server:"; show "$LOGD/$name.srv" | tail -10
    echo "  client:"; show "$LOGD/$name.cli" | tail -10
    fail "$PFX$name" "${why%; } ($(since "$t0")s; before the $action: $P)"
  fi
}

# sdp_other_device NAME PORT: a process that lost a device and looked at librdmacm's device list again
# (which opens every device there: librdmacm keeps them open) must not hold up the removal of another
# device later. A listener on $DEV1 (sdp-peer, automatic mode) loses $DEV1, $DEV1 comes back, then
# rxe0, on which the process has no id at all, is deleted: that must finish in 15 s (with no watcher
# of the device list it waited until the process exited).
sdp_other_device() {
  name=$1 port=$2
  t0=$(now); base=$(listeners); why=""
  env SDP_PROVIDERS=rdma timeout 120 $PEER serve "$B:$port" auto 1 2 1024 >"$LOGD/$name.srv" 2>&1 &
  spid=$!
  wait_listen "$base" "$spid" || why="server not listening; "
  timeout 30 rdma link delete "$DEV1" || why="${why}rdma link delete $DEV1 failed; "
  rdma link add "$DEV1" type "$DEVTYPE" netdev "$NET1" || why="${why}rdma link add $DEV1 failed; "
  i=0
  while [ $i -lt 100 ] && ! grep -q ACTIVE /sys/class/infiniband/$DEV1/ports/1/state 2>/dev/null; do sleep 0.1; i=$((i + 1)); done
  sleep 2   # the listener listens again on the device come back
  tk=$(now)
  rdma link delete rxe0 & dpid=$!
  i=0
  while [ $i -lt 150 ] && kill -0 $dpid 2>/dev/null; do sleep 0.1; i=$((i + 1)); done
  if kill -0 $dpid 2>/dev/null; then
    why="${why}rdma link delete rxe0 still waiting after 15 s (on: $(for p in /proc/[0-9]*; do ls -l $p/fd 2>/dev/null | grep -q uverbs && cat $p/comm; done | sort -u | tr '\n' ' ')); "
    kill -9 $spid
  fi
  wait $dpid || why="${why}rdma link delete rxe0 failed; "
  took=$(since "$tk")
  kill $spid 2>/dev/null; wait $spid 2>/dev/null
  rdma link add rxe0 type "$DEVTYPE" netdev veth0 || why="${why}rdma link add rxe0 failed; "
  i=0
  while [ $i -lt 100 ] && ! grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null; do sleep 0.1; i=$((i + 1)); done
  grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null || why="${why}rxe0 not ACTIVE again; "
  if [ -z "$why" ]; then
    pass "$name" "rxe0 deleted in ${took}s beside a process that had lost $DEV1"
  else
    echo "  server:"; show "$LOGD/$name.srv" | tail -10
    fail "$name" "${why%; } ($(since "$t0")s)"
  fi
}

# sock_pair NAME SERVER_ENV MODE CLIENT_ENV WANT_LISTEN WANT: the socket API (SdpListener/SdpStream in
# sdp-peer, automatic mode) between rxe1 ($B, server) and rxe0 ($A, client source address): a checksummed
# duplex exchange; the server must listen on WANT_LISTEN and both ends must report transport WANT.
PEER=/rig/bin/sdp-peer
SOCK_BYTES=8388608
sock_pair() {
  name=$1 senv=$2 mode=$3 cenv=$4 wl=$5 want=$6 port=$7
  rdma_pair "$PFX$name" "env $senv $PEER serve $B:$port $mode 11 22 $SOCK_BYTES" \
    "env $cenv SDP_PEER_SRC=$A SDP_PEER_SHOW=1 $PEER duplex $B:$port $mode 22 11 $SOCK_BYTES"
  why=""
  name=$PFX$name
  grep -q "^listening $wl " "$LOGD/$name.srv" || why="server not listening on $wl; "
  grep -q "^accepted $want\$" "$LOGD/$name.srv" || why="${why}server stream not $want; "
  grep -q "^transport $want\$" "$LOGD/$name.cli" || why="${why}client stream not $want; "
  if [ -n "$why" ]; then
    show "$LOGD/$name.srv" | head -5; show "$LOGD/$name.cli" | head -5
    fail "$name-transport" "${why%; }"
  else
    pass "$name-transport" "listening $wl, both ends $want"
  fi
}

# skip_check NAME: true (and says so, with the reason) if NAME is in $SDP_SKIP (for a check known
# not to work over a fabric yet, with a TODO.md line; none now).  Not a pass: no RIG-CHECK.
skip_check() {
  case " ${SDP_SKIP:-} " in *" $1 "*) echo "  $PFX$1: NOT RUN over $DEVTYPE: $SDP_SKIP_WHY"; return 0 ;; esac
  return 1
}

section "${PFX}sdp: SDP over the rdma provider (client $A, server $DEV1 $B)"
#          name                   server                                   client
rdma_pair  ${PFX}sdp-bcopy              "$SDP server bcopy $B:7471"              "$SDP client bcopy $B:7471 $A"
# Over siw zcopy failed once in 9 boots (LocalProtection on the server after every byte was
# checked) and zsend once in about 12 (LocalProtection on the client; TODO.md): retried once there,
# reported as FLAKY if the second try passes.
if [ "$DEVTYPE" = siw ]; then zpair=rdma_pair_flaky; else zpair=rdma_pair; fi
$zpair     ${PFX}sdp-zcopy              "$SDP server zcopy $B:7472"              "$SDP client zcopy $B:7472 $A"
$zpair     ${PFX}sdp-zsend              "$SDP server zsend $B:7470"              "$SDP client zsend $B:7470 $A"
rdma_pair  ${PFX}sdp-halfclose          "$SDP server halfclose $B:7473"          "$SDP client halfclose $B:7473 $A"
rdma_pair  ${PFX}sdp-abort              "$SDP server abort $B:7474"              "$SDP client abort $B:7474 $A"
run_check  ${PFX}sdp-refused            $SDP refused $B:7479 $A
run_check  ${PFX}sdp-devices            $SDP devices $A $B
rdma_pair  ${PFX}sdp-garbage-hello      "$SDP server garbage-hello $B:7475"      "$SDP client garbage-hello $B:7475 $A"
if skip_check sdp-junk-after-hello; then :; else
rdma_pair  ${PFX}sdp-junk-after-hello   "$SDP server junk-after-hello $B:7476"   "$SDP client junk-after-hello $B:7476 $A"
show "$LOGD/${PFX}sdp-junk-after-hello.srv" | grep -E 'bad connection|failed during setup'
fi
if [ -x $PEER ] && [ "$DEVTYPE" = siw ]; then
  section "${PFX}sdp: the socket API over iWARP (SDP only when chosen: iWARP's connections use TCP's ports)"
  # iWARP's CM connects over kernel TCP to the application's own port: an automatic listener cannot
  # listen over iWARP beside its kernel TCP socket, and an automatic connect would write an MPA request
  # into whatever TCP server owns the port (it did: 56 bytes "MPA ID Req Frame..." reached nc, and
  # sdp-peer's TCP listener answered it with data, which oopsed 6.1's siw). So automatic mode keeps to
  # kernel TCP over iWARP, and SDP over iWARP is an explicit choice at both ends (SDP_PEER_LISTEN=sdp:
  # an SDP-only listener; modes zcopy and bcopy connect SDP-only).
  #         name              server env                                  mode   client env            listens  stream
  sock_pair sock-auto-tcp     "SDP_X=1"                                   auto   "SDP_PROVIDERS=rdma"  shm      tcp   7480
  sock_pair sock-registered   "SDP_PROVIDERS=rdma SDP_PEER_LISTEN=sdp"    zcopy  "SDP_PROVIDERS=rdma"  rdma     rdma  7481
  sock_pair sock-bcopy        "SDP_PROVIDERS=rdma SDP_PEER_LISTEN=sdp"    bcopy  "SDP_X=1"             rdma     rdma  7482
  # a kernel-TCP-only server: the automatic connector goes to TCP at once (no MPA request reaches it)
  sock_pair sock-tcp-fallback "SDP_PROVIDERS=none"                        auto   "SDP_PROVIDERS=rdma"  ""       tcp   7483
elif [ -x $PEER ]; then
  section "sdp: the socket API picks RDMA by itself (SdpListener/SdpStream, automatic mode)"
  #         name              server env             mode   client env            listens   stream
  sock_pair sock-auto-rdma    "SDP_X=1"              auto   "SDP_X=1"             shm,rdma  rdma  7480
  sock_pair sock-registered   "SDP_PROVIDERS=rdma"   zcopy  "SDP_PROVIDERS=rdma"  rdma      rdma  7481
  sock_pair sock-bcopy        "SDP_PROVIDERS=rdma"   bcopy  "SDP_X=1"             rdma      rdma  7482
  # a kernel-TCP-only server: the automatic connector falls back to TCP
  sock_pair sock-tcp-fallback "SDP_PROVIDERS=none"   auto   "SDP_PROVIDERS=rdma"  ""        tcp   7483
fi
sdp_survivor sdp-kill9    kill    7477
# The soak (issue 14, tests/soak) over rdma: checksummed random data both ways in random sizes, in
# every mode, with kill -9, SIGSTOP/SIGCONT and closes mid-transfer on a schedule; passes only with
# 0 bad bytes, 0 hangs, 0 leaks. rxe only (siw: its CM oopses on the socket API's connections, TODO.md).
if [ -z "$PFX" ] && [ -x /rig/bin/sdp-soak ]; then
  run_check sdp-soak env SDP_PROVIDERS=rdma /rig/bin/sdp-soak --transport sdp --listen "$B:7600" \
    --source-ip "$A" --seconds 20 --gib 1 --workers 2 --faults stop,pclose,preset,wclose,kill --fault-interval 1
  # The same with the server's device deleted and added back under it every ~3 s (and kill -9): the
  # server's stack fails its sockets with ENETDOWN and lets go of the device at once (else `rdma link
  # delete` waits for the process), its listener listens again when the device is back.
  run_check sdp-soak-linkdel env SDP_PROVIDERS=rdma /rig/bin/sdp-soak --transport sdp --listen "$B:7601" \
    --source-ip "$A" --seconds 20 --gib 1 --workers 2 --faults cmd,kill --fault-interval 3 \
    --fault-cmd "timeout 30 rdma link delete $DEV1; rdma link add $DEV1 type $DEVTYPE netdev $NET1; sleep 2"
  i=0
  while [ $i -lt 100 ] && ! grep -q ACTIVE /sys/class/infiniband/$DEV1/ports/1/state 2>/dev/null; do
    [ $i = 0 ] && rdma link add "$DEV1" type "$DEVTYPE" netdev "$NET1" 2>/dev/null
    sleep 0.1; i=$((i + 1))
  done
  [ -x $PEER ] && sdp_other_device sdp-other-dev 7602
fi
sdp_survivor sdp-linkdel  linkdel 7478   # last: it deletes rxe1 (and adds it back)
