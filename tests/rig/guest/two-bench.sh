# shellcheck shell=sh
# Benchmark and latency rows between two guests (sourced by two.sh on both guests when tests/rig/run
# --two-guests --bench): A runs each tool's server, B its client, one at a time, in the same order on
# both sides (the same beacon handshake as the checks: A opens a one-shot TCP listener on the tool's
# port - 1000 once its server listens; B waits for it). B prints the RIG-BENCH rows (guest/bench.sh's
# and guest/lat.sh's formats), which tests/rig/run turns into tables of medians. IPv4 only; rxe, and
# siw too with --two-siw (tools TOOL-siw). Each measurement is a check on B (its client did its job and
# printed its figure) and on A (its server exited 0).
#   ib_write_bw       perftest over the RDMA CM (-R), one-sided writes, $TB_BYTES one way
#   rstream           rsockets: COUNT messages each way (rstream's figure: both directions)
#   sdp-bcopy/zcopy   sdp-rigtest bench-server/bench-client (the engine over the rdma provider)
#   ib_send_lat, rstream-lat, sdp-lat (sdp-rigtest pp-*), sdp-sock-lat (sdp-peer pp-serve/pp: the socket
#                     API): ping-pong, one-way usec = round trip / 2
TB_BYTES=$((64 * 1048576))
[ "${RIG_QUICK:-0}" = 1 ] && TB_BYTES=$((16 * 1048576))
TB_SIZES=${RIG_BENCH_SIZES:-65536 1048576}
TB_RUNS=${RIG_RUNS:-3}
TB_LAT_IT=1000

# tb_items: one line per measurement, "TOOL FABRIC SIZE RUN", the same list on both guests
tb_items() {
  r=1
  while [ $r -le "$TB_RUNS" ]; do
    for fab in $FABRICS; do
      for sz in $TB_SIZES; do
        for t in ib_write_bw rstream sdp-bcopy sdp-zcopy; do echo "$t $fab $sz $r"; done
      done
      for t in ib_send_lat rstream-lat sdp-lat sdp-sock-lat; do echo "$t $fab 64 $r"; done
    done
    r=$((r + 1))
  done
}

# tb_cmd ROLE TOOL SIZE PORT: the server (a) or client (b) command of one measurement
tb_cmd() {
  n=$((TB_BYTES / $3))
  case $1$2 in
    aib_write_bw) echo "ib_write_bw -R -d $dev -s $3 -n $n -F -p $4" ;;
    bib_write_bw) echo "ib_write_bw -R -d $dev -s $3 -n $n -F -p $4 $ip_a" ;;
    arstream) echo "rstream -b $ip_a -p $4 -S $3 -C $n" ;;
    brstream) echo "rstream -b $ip_b -s $ip_a -p $4 -S $3 -C $n" ;;
    asdp-bcopy | asdp-zcopy) echo "$SDP bench-server $ip_a:$4 ${2#sdp-} $3 $TB_BYTES" ;;
    bsdp-bcopy | bsdp-zcopy) echo "$SDP bench-client $ip_a:$4 $ip_b ${2#sdp-} $3 $TB_BYTES" ;;
    aib_send_lat) echo "ib_send_lat -R -d $dev -s $3 -n $TB_LAT_IT -F -p $4" ;;
    bib_send_lat) echo "ib_send_lat -R -d $dev -s $3 -n $TB_LAT_IT -F -p $4 $ip_a" ;;
    arstream-lat) echo "rstream -b $ip_a -p $4 -S $3 -C 1 -I $TB_LAT_IT" ;;
    brstream-lat) echo "rstream -b $ip_b -s $ip_a -p $4 -S $3 -C 1 -I $TB_LAT_IT" ;;
    asdp-lat) echo "$SDP pp-server $ip_a:$4 $3 $TB_LAT_IT" ;;
    bsdp-lat) echo "$SDP pp-client $ip_a:$4 $ip_b $3 $TB_LAT_IT" ;;
    asdp-sock-lat) echo "env SDP_PROVIDERS=rdma SDP_PEER_LISTEN=sdp $PEER pp-serve $ip_a:$4 $3" ;;
    bsdp-sock-lat) echo "env SDP_PROVIDERS=rdma SDP_PEER_SRC=$ip_b $PEER pp $ip_a:$4 sdp $3 $TB_LAT_IT" ;;
  esac
}

# tb_figure TOOL SIZE LOG: sets TB_ROW (the RIG-BENCH JSON after tool/size/run) or leaves it empty
tb_figure() {
  TB_ROW=""
  case $1 in
    ib_write_bw)
      bw=$(awk '/#bytes/ {getline; print $4; exit}' "$3")
      bps=$(awk -v m="$bw" 'BEGIN{ if (m + 0 > 0) printf "%.0f", m * 1048576 }')
      [ -n "$bps" ] && TB_ROW="\"bytes_per_sec\":$bps" ;;
    rstream)
      usx=$(awk 'NF == 8 && $8 + 0 > 0 {v = $8} END {print v}' "$3")
      bps=$(awk -v s="$2" -v u="$usx" 'BEGIN{ if (u + 0 > 0) printf "%.0f", s * 1e6 / u }')
      [ -n "$bps" ] && TB_ROW="\"bytes_per_sec\":$bps" ;;
    sdp-bcopy | sdp-zcopy)
      bps=$(sed -n 's/^BENCH-CLIENT .*bytes_per_sec=\([0-9]*\).*/\1/p' "$3")
      cc=$(sed -n 's/^BENCH-CLIENT .*cpu_s_per_gib=\([0-9.]*\).*/\1/p' "$3")
      [ -n "$bps" ] && [ -n "$cc" ] && TB_ROW="\"bytes_per_sec\":$bps,\"cpu_s_per_gib_client\":$cc" ;;
    ib_send_lat)
      typ=$(awk '/#bytes/ {getline; print $5; exit}' "$3")
      awk -v v="$typ" 'BEGIN{exit !(v + 0 > 0)}' && TB_ROW="\"lat_usec\":$typ,\"stat\":\"p50\"" ;;
    rstream-lat)
      usx=$(awk 'NF == 8 && $8 + 0 > 0 {v = $8} END {print v}' "$3")
      [ -n "$usx" ] && TB_ROW="\"lat_usec\":$usx,\"stat\":\"avg\"" ;;
    sdp-lat | sdp-sock-lat)
      p50=$(sed -n 's/^PP-CLIENT .*rtt_p50_usec=\([0-9.]*\).*/\1/p' "$3")
      [ -n "$p50" ] && TB_ROW="\"lat_usec\":$(awk -v v="$p50" 'BEGIN{printf "%.2f", v / 2}'),\"stat\":\"p50\"" ;;
  esac
}

tb_run() {
  section "$ROLE: benchmark and latency rows, IPv4 ($TB_RUNS runs; sizes $TB_SIZES, $((TB_BYTES / 1048576)) MiB each; 64 B ping-pong)"
  k=0
  tb_items >/tmp/tb-items
  while read -r t fab sz r; do
    k=$((k + 1))
    fab_addrs "$fab" 4
    p=$((7800 + k)) tn=$t
    [ "$fab" = siw ] && tn=$t-siw
    name=bench-$tn-$sz-$r
    if [ "$ROLE" = a ]; then
      base=$(listeners); why=""
      # shellcheck disable=SC2046
      timeout 300 $(tb_cmd a "$t" "$sz" "$p") >"$LOGD/$name.srv" 2>&1 </dev/null &
      spid=$!
      wait_listen "$base" "$spid" || why="server not listening after 15 s; "
      $NC -l $((p - 1000)) >/dev/null 2>&1 </dev/null &
      bpid=$!
      wait "$spid"; rc=$?
      kill "$bpid" 2>/dev/null; wait "$bpid" 2>/dev/null
      [ $rc = 0 ] || why="${why}server exit $rc; "
      if [ -z "$why" ]; then pass "A:$name" "server done"; else show "$LOGD/$name.srv" | tail -6; fail "A:$name" "${why%; }"; fi
    else
      i=0
      while [ $i -lt 240 ] && ! $NC -z -w 1 $A4 $((p - 1000)) 2>/dev/null; do sleep 0.5; i=$((i + 1)); done
      t0=$(now)
      # shellcheck disable=SC2046
      timeout 300 $(tb_cmd b "$t" "$sz" "$p") >"$LOGD/$name.cli" 2>&1 </dev/null; rc=$?
      secs=$(since "$t0")
      tb_figure "$t" "$sz" "$LOGD/$name.cli"
      if [ $rc = 0 ] && [ -n "$TB_ROW" ]; then
        echo "RIG-BENCH: {\"tool\":\"$tn\",\"size_bytes\":$sz,\"run\":$r,$TB_ROW,\"mtu\":$MTU,\"pair_secs\":$secs,\"two_guests\":true}"
        pass "B:$name" "${TB_ROW} (${secs}s)"
      else
        show "$LOGD/$name.cli" | tail -6
        fail "B:$name" "client exit $rc$([ -n "$TB_ROW" ] || echo '; no figure in its output') (${secs}s)"
      fi
    fi
  done </tmp/tb-items
}
