# shellcheck shell=sh
# Latency rows (sourced by tests.sh; all modes but --no-lat): ping-pong between rxe0 ($A, client) and
# rxe1 ($B, server), tools and sizes interleaved over $RIG_LAT_RUNS runs, like guest/bench.sh.
#   ib_send_lat / ib_write_lat  perftest over the RDMA CM (-R), busy polling; t_typical (the median)
#   ib_send_lat-ev              (not in the default set) ib_send_lat -e: sleeps on CQ events, like SDP
#   rstream-lat                 rsockets: rstream -S SIZE -C 1 -I ITERS (one message each way per
#                               iteration); rstream prints only the mean (usec/xfer)
#   sdp-lat                     SDP BCopy over the rdma provider (sdp-rigtest pp-server/pp-client,
#                               TCP_NODELAY, event-driven waits: arm the CQ and sleep when idle)
#   sdp-sock-lat                SDP over rdma through the socket API, as an application gets it
#                               (sdp-peer pp-serve/pp: SdpListener/SdpStream, blocking read/write,
#                               TCP_NODELAY; the runtime polls a while before it sleeps, docs/waiting.md)
# Every figure is one-way latency in usec, i.e. round trip / 2, as perftest and rstream print it.
# One line per measurement: RIG-BENCH: {"tool":..,"size_bytes":..,"run":..,"lat_usec":..,...}; the host
# (tests/rig/run) prints the table of medians and the ratios to ib_send_lat and rstream-lat.
# --sdp-variant NAME=ENV adds rows sdp-lat+NAME and sdp-sock-lat+NAME (e.g. SDP_SPIN_US=50: poll that long
# before arming).
LAT_SIZES=${RIG_LAT_SIZES:-64}
LAT_TOOLS=${RIG_LAT_TOOLS:-ib_send_lat ib_write_lat rstream-lat sdp-lat sdp-sock-lat}
LAT_RUNS=${RIG_LAT_RUNS:-3}
lat_want() { case " $LAT_TOOLS " in *" $1 "*) return 0 ;; esac; return 1; }
lat_iters() { if [ "$1" -ge 65536 ]; then echo 200; else echo 1000; fi; }

lat_row() {   # TOOL SIZE RUN LAT_USEC STAT [EXTRA JSON]
  echo "RIG-BENCH: {\"tool\":\"$1\",\"size_bytes\":$2,\"run\":$3,\"lat_usec\":$4,\"stat\":\"$5\",\"mtu\":$RIG_MTU,\"pair_secs\":$PAIR_T${6:+,$6}}"
}
lat_pair() {   # NAME SERVER CLIENT: run_pair, and the packets must have crossed the veth pair
  s0=$(snap)
  run_pair "$@" || return 1
  deltas "$s0"
  crossed || { PAIR_WHY="packet counters did not all increase ($(pkts))"; return 1; }
}

lat_perftest() {   # TOOL SIZE RUN  (TOOL-ev: the same with -e, sleeping on CQ events instead of polling)
  t=${1%-ev}; ev=""; [ "$t" = "$1" ] || ev=" -e"
  it=$(lat_iters "$2"); name=lat-$1-$2-$3; try=1
  while [ $try -le 3 ]; do
    if lat_pair "$name" "$t -R -d rxe1 -s $2 -n $it -F$ev" "$CM_SRC_A $t -R -d rxe0 -s $2 -n $it -F$ev $B"; then
      # #bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%
      typ=$(awk '/#bytes/ {getline; print $5; exit}' "$LOGD/$name.cli")
      avg=$(awk '/#bytes/ {getline; print $6; exit}' "$LOGD/$name.cli")
      p99=$(awk '/#bytes/ {getline; print $8; exit}' "$LOGD/$name.cli")
      echo "$p99" | grep -Eq '^[0-9]+(\.[0-9]+)?$' || p99=0
      # a finite positive number (perftest prints "inf" when its clock calibration failed)
      if echo "$typ $avg" | grep -Eq '^[0-9]+(\.[0-9]+)? [0-9]+(\.[0-9]+)?$' && awk -v v="$typ" 'BEGIN{exit !(v + 0 > 0)}'; then
        lat_row "$1" "$2" "$3" "$typ" p50 "\"avg_usec\":$avg,\"p99_usec\":${p99:-0},\"iters\":$it,\"tries\":$try"
        pass "$name" "t_typical $typ usec, avg $avg; $(pkts)"; return
      fi
      PAIR_WHY="t_typical '$typ', t_avg '$avg' (clock calibration: $(grep -h -m1 -i 'correlation\|conflicting' "$LOGD/$name.cli" "$LOGD/$name.srv"))"
    fi
    echo "  $name try $try: $PAIR_WHY"
    try=$((try + 1))
  done
  pair_logs "$name" "$1" "$1"; fail "$name" "$PAIR_WHY"
}

lat_rstream() {   # SIZE RUN
  it=$(lat_iters "$1"); name=lat-rstream-$1-$2
  if lat_pair "$name" "rstream -b $B -S $1 -C 1 -I $it" "rstream -b $A -s $B -S $1 -C 1 -I $it"; then
    # columns: name bytes xfers iters total time Gb/sec usec/xfer (= mean round trip / 2)
    usx=$(awk 'NF == 8 && $8 + 0 > 0 {v = $8} END {print v}' "$LOGD/$name.cli")
    if [ -n "$usx" ]; then lat_row rstream-lat "$1" "$2" "$usx" avg "\"iters\":$it"; pass "$name" "$usx usec/xfer; $(pkts)"; return; fi
    PAIR_WHY="no usec/xfer in the output"
  fi
  pair_logs "$name" rstream rstream; fail "$name" "$PAIR_WHY"
}

lat_sdp() {   # SIZE RUN TOOL ENVPREFIX
  it=$(lat_iters "$1"); name=lat-$3-$1-$2
  if [ "${3%%+*}" = sdp-sock-lat ]; then
    srv="${4}env SDP_PROVIDERS=rdma $PEER pp-serve $B:7496 $1"
    cli="${4}env SDP_PROVIDERS=rdma SDP_PEER_SRC=$A $PEER pp $B:7496 sdp $1 $it"
  else
    srv="$4$SDP pp-server $B:7495 $1 $it" cli="$4$SDP pp-client $B:7495 $A $1 $it"
  fi
  if lat_pair "$name" "$srv" "$cli"; then
    p50=$(sed -n 's/^PP-CLIENT .*rtt_p50_usec=\([0-9.]*\).*/\1/p' "$LOGD/$name.cli")
    p99=$(sed -n 's/^PP-CLIENT .*rtt_p99_usec=\([0-9.]*\).*/\1/p' "$LOGD/$name.cli")
    avg=$(sed -n 's/^PP-CLIENT .*rtt_avg_usec=\([0-9.]*\).*/\1/p' "$LOGD/$name.cli")
    if [ -n "$p50" ] && [ -n "$avg" ]; then
      show "$LOGD/$name.cli" "$LOGD/$name.srv" | grep -E 'loop|PP-SERVER|transport='
      h() { awk -v v="$1" 'BEGIN{printf "%.2f", v / 2}'; }
      lat_row "$3" "$1" "$2" "$(h "$p50")" p50 "\"avg_usec\":$(h "$avg"),\"p99_usec\":$(h "${p99:-0}"),\"iters\":$it"
      pass "$name" "round trip p50 $p50 usec, avg $avg; $(pkts)"; return
    fi
    PAIR_WHY="no PP-CLIENT figures in the output"
  fi
  pair_logs "$name" sdp-rigtest sdp-rigtest; fail "$name" "$PAIR_WHY"
}

section "latency: ping-pong, $LAT_RUNS runs, sizes $LAT_SIZES, tools $LAT_TOOLS (one-way usec = round trip / 2)"
SDP=/rig/bin/sdp-rigtest PEER=/rig/bin/sdp-peer
lrun=1
while [ $lrun -le "$LAT_RUNS" ]; do
  for lsize in $LAT_SIZES; do
    for t in ib_send_lat ib_write_lat ib_send_lat-ev; do if lat_want $t; then lat_perftest $t "$lsize" $lrun; fi; done
    if lat_want rstream-lat; then lat_rstream "$lsize" $lrun; fi
    if lat_want sdp-sock-lat && [ -x $PEER ]; then lat_sdp "$lsize" $lrun sdp-sock-lat ""; fi
    if lat_want sdp-lat && [ -x $SDP ]; then
      lat_sdp "$lsize" $lrun sdp-lat ""
      if [ -s /rig/sdp-variants ]; then
        while IFS= read -r v; do
          [ -n "$v" ] || continue
          lat_sdp "$lsize" $lrun "sdp-lat+${v%%=*}" "env ${v#*=} "
          if lat_want sdp-sock-lat && [ -x $PEER ]; then lat_sdp "$lsize" $lrun "sdp-sock-lat+${v%%=*}" "env ${v#*=} "; fi
        done </rig/sdp-variants
      fi
    fi
  done
  lrun=$((lrun + 1))
done
