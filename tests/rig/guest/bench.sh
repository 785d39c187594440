# Benchmarks (sourced by tests.sh when tests/rig/run --bench).  Each measurement prints one line
#   RIG-BENCH: {"tool":..,"size_bytes":..,"run":..,"bytes_per_sec":..,...}
# which the host collects (--json FILE) and summarises as medians.  Tools and sizes are interleaved
# (run 1: all tools at all sizes, then run 2, ...), so a slow phase of the emulator hits every tool.
# Everything is emulated (TCG): absolute figures mean little; compare tools within one boot.
BENCH_BYTES=$((64 * 1048576))    # data per measurement and direction
[ "${RIG_QUICK:-0}" = 1 ] && BENCH_BYTES=$((16 * 1048576))
BENCH_SIZES="65536 1048576"

bench_row() {   # bench_row TOOL SIZE RUN BYTES_PER_SEC [EXTRA JSON FIELDS]
  echo "RIG-BENCH: {\"tool\":\"$1\",\"size_bytes\":$2,\"run\":$3,\"bytes_per_sec\":$4,\"mtu\":$RIG_MTU,\"pair_secs\":$PAIR_T${5:+,$5}}"
}

bench_pair() {   # run_pair, and the traffic must have crossed the veth pair (both devices sent/received)
  bs0=$(snap)
  run_pair "$@" || return 1
  deltas "$bs0"
  crossed || { PAIR_WHY="packet counters did not all increase ($(pkts))"; return 1; }
}

# ib_write_bw over the RDMA CM (-R): one-sided RDMA writes, $BENCH_BYTES in one direction.
# perftest's "BW average[MB/sec]" uses MB = 2^20 bytes.  perftest converts TSC cycles with a CPU clock it
# calibrates at start-up by busy-waiting; on a loaded host that calibration can fail ("Correlation
# coefficient r^2 < 0.9"), and the result is printed as 0.00: such a measurement is repeated (3 tries).
bench_ib_write_bw() {   # SIZE RUN
  n=$((BENCH_BYTES / $1)); name=bench-ib_write_bw-$1-$2; try=1
  while [ $try -le 3 ]; do
    if bench_pair "$name" "ib_write_bw -R -d rxe1 -s $1 -n $n -F" \
                          "$CM_SRC_A ib_write_bw -R -d rxe0 -s $1 -n $n -F $B"; then
      bw=$(awk '/#bytes/ {getline; print $4; exit}' "$LOGD/$name.cli")
      bps=$(awk -v m="$bw" 'BEGIN{ if (m + 0 > 0) printf "%.0f", m * 1048576 }')
      if [ -n "$bps" ]; then
        bench_row ib_write_bw "$1" "$2" "$bps" "\"iters\":$n,\"tries\":$try"; pass "$name" "${bw} MiB/s"; return
      fi
      PAIR_WHY="BW average '${bw}' (clock calibration: $(grep -h -m1 -i 'correlation\|conflicting' "$LOGD/$name.cli" "$LOGD/$name.srv"))"
    fi
    echo "  $name try $try: $PAIR_WHY"
    try=$((try + 1))
  done
  pair_logs "$name" ib_write_bw ib_write_bw; fail "$name" "$PAIR_WHY"
}

# rstream (rsockets): the client sends COUNT messages, then the server sends COUNT back; rstream's own
# figure counts both directions over the whole time, i.e. the one-way streaming rate.
bench_rstream() {   # SIZE RUN
  c=$((BENCH_BYTES / $1)); name=bench-rstream-$1-$2
  if bench_pair "$name" "rstream -b $B -S $1 -C $c" "rstream -b $A -s $B -S $1 -C $c"; then
    # columns: name bytes xfers iters total time Gb/sec usec/xfer
    usx=$(awk 'NF == 8 && $8 + 0 > 0 {v = $8} END {print v}' "$LOGD/$name.cli")
    bps=$(awk -v s="$1" -v u="$usx" 'BEGIN{ if (u + 0 > 0) printf "%.0f", s * 1e6 / u }')
    if [ -n "$bps" ]; then bench_row rstream "$1" "$2" "$bps" "\"xfers\":$c"; pass "$name" "$usx usec/xfer"; return; fi
    PAIR_WHY="no usec/xfer in the output"
  fi
  pair_logs "$name" rstream rstream; fail "$name" "$PAIR_WHY"
}

# SDP over the project's rdma provider (tests/src/bin/sdp-rigtest): the client streams $BENCH_BYTES in
# SIZE-byte messages to the server, which answers with the byte count after EOF; bytes_per_sec is the
# client's figure from connected to the answer.  bcopy: write()/read() through the engine's buffers;
# zcopy: write_zcopy from registered sources (SrcAvail, the server RDMA-Reads them) and read_zcopy
# into a registered sink.  Each side reports its CPU seconds (getrusage) per GiB moved.
SDP=/rig/bin/sdp-rigtest
bench_sdp() {   # SIZE RUN
  [ -x $SDP ] || return 0
  for mode in bcopy zcopy; do
    name=bench-sdp-$mode-$1-$2
    if bench_pair "$name" "$SDP bench-server $B:7490 $mode $1 $BENCH_BYTES" \
                          "$SDP bench-client $B:7490 $A $mode $1 $BENCH_BYTES"; then
      bps=$(sed -n 's/^BENCH-CLIENT .*bytes_per_sec=\([0-9]*\).*/\1/p' "$LOGD/$name.cli")
      cc=$(sed -n 's/^BENCH-CLIENT .*cpu_s_per_gib=\([0-9.]*\).*/\1/p' "$LOGD/$name.cli")
      sc=$(sed -n 's/^BENCH-SERVER .*cpu_s_per_gib=\([0-9.]*\).*/\1/p' "$LOGD/$name.srv")
      if [ -n "$bps" ] && [ -n "$cc" ] && [ -n "$sc" ]; then
        show "$LOGD/$name.cli" "$LOGD/$name.srv" | grep -E 'BENCH-(CLIENT|SERVER)|loop:'
        bench_row "sdp-$mode" "$1" "$2" "$bps" "\"cpu_s_per_gib_client\":$cc,\"cpu_s_per_gib_server\":$sc"
        pass "$name" "$(awk -v b="$bps" 'BEGIN{printf "%.1f MB/s", b/1e6}'), CPU s/GiB client $cc server $sc"
        continue
      fi
      PAIR_WHY="no BENCH-CLIENT/BENCH-SERVER figures in the output"
    fi
    pair_logs "$name" sdp-rigtest sdp-rigtest; fail "$name" "$PAIR_WHY"
  done
}

section "benchmarks: $RIG_RUNS runs, sizes $BENCH_SIZES, $((BENCH_BYTES / 1048576)) MiB each"
run=1
while [ $run -le "$RIG_RUNS" ]; do
  for size in $BENCH_SIZES; do
    bench_ib_write_bw "$size" "$run"
    bench_rstream "$size" "$run"
    bench_sdp "$size" "$run"
  done
  run=$((run + 1))
done
