# Benchmarks (sourced by tests.sh when tests/rig/run --bench).  Each measurement prints one line
#   RIG-BENCH: {"tool":..,"size_bytes":..,"run":..,"bytes_per_sec":..,...}
# which the host collects (--json FILE) and summarises as medians.  Tools and sizes are interleaved
# (run 1: all tools at all sizes, then run 2, ...), so a slow phase of the emulator hits every tool.
# Everything is emulated (TCG): absolute figures mean little; compare tools within one boot.
BENCH_BYTES=$((64 * 1048576))    # data per measurement and direction
[ "${RIG_QUICK:-0}" = 1 ] && BENCH_BYTES=$((16 * 1048576))
BENCH_SIZES=${RIG_BENCH_SIZES:-65536 1048576}
BENCH_TOOLS=${RIG_BENCH_TOOLS:-ib_write_bw rstream sdp-bcopy sdp-zcopy}
if [ -z "${RIG_BENCH_TOOLS:-}" ] && [ -d /sys/class/infiniband/siw0 ]; then
  BENCH_TOOLS="$BENCH_TOOLS ib_write_bw-siw rstream-siw sdp-bcopy-siw sdp-zcopy-siw"
fi
want_tool() { case " $BENCH_TOOLS " in *" $1 "*) return 0 ;; esac; return 1; }

# Guest CPU use during a measurement, from /proc/stat: busy (non-idle) percent of each vCPU, and
# how the busy time splits into user / system / softirq (percent of all vCPUs' time).
cpu_snap() { awk '/^cpu / {print $2+$3, $4, $7, $8, $5+$6}' /proc/stat; }
cpu_delta() {   # cpu_delta "$SNAP_BEFORE": sets CPU_JSON and CPU_TXT
  # shellcheck disable=SC2086,SC2046
  set -- $1 $(cpu_snap)
  CPU_TXT=$(awk -v u="$(($6 - $1))" -v s="$(($7 - $2))" -v i="$(($8 - $3))" -v q="$(($9 - $4))" -v d="$((${10} - $5))" \
    'BEGIN { t = u + s + i + q + d; if (t <= 0) t = 1
             printf "user %.0f%% sys %.0f%% irq %.0f%% softirq %.0f%% idle %.0f%%", 100*u/t, 100*s/t, 100*i/t, 100*q/t, 100*d/t }')
  CPU_JSON=$(echo "$CPU_TXT" | awk '{ gsub("%", ""); printf "\"guest_cpu_pct\":{\"user\":%s,\"sys\":%s,\"irq\":%s,\"softirq\":%s,\"idle\":%s}", $2, $4, $6, $8, $10 }')
}

bench_row() {   # bench_row TOOL SIZE RUN BYTES_PER_SEC [EXTRA JSON FIELDS]
  echo "RIG-BENCH: {\"tool\":\"$1\",\"size_bytes\":$2,\"run\":$3,\"bytes_per_sec\":$4,\"mtu\":$RIG_MTU,\"pair_secs\":$PAIR_T${5:+,$5},$CPU_JSON}"
  echo "  guest CPU during $1 $2: $CPU_TXT (over ${PAIR_T}s, both vCPUs)"
}

# Every rxe hw counter of both devices, as "dev:name=value" words (retries, sequence errors, RNR NAKs...).
hw_snap() {
  for d in rxe0 rxe1; do
    for f in /sys/class/infiniband/$d/ports/1/hw_counters/*; do echo "$d:${f##*/}=$(cat "$f" 2>/dev/null || echo 0)"; done
  done
}
hw_delta() {   # hw_delta "$SNAP_BEFORE": the counters that moved, other than the packet counts
  echo "$1" >/tmp/hw0; hw_snap >/tmp/hw1
  awk -F= 'NR == FNR {a[$1] = $2; next} $2 != a[$1] && $1 !~ /(sent|rcvd)_pkts$/ {printf " %s+%d", $1, $2 - a[$1]}' /tmp/hw0 /tmp/hw1
}

# Per-vCPU busy time, softirq counts and ksoftirqd CPU time (jiffies / counts), as "name=value" words.
diag_snap() {
  awk '/^cpu[0-9]/ {print $1 "_busy=" $2+$3+$4+$7+$8; print $1 "_softirq=" $8}' /proc/stat
  awk '$1 ~ /^(NET_RX|TASKLET|TIMER|SCHED):$/ {for (i = 2; i <= NF; i++) print $1 "cpu" i-2 "=" $i}' /proc/softirqs
  for p in /proc/[0-9]*; do
    read -r c <"$p/comm" 2>/dev/null || continue
    case $c in ksoftirqd/*) awk -v n="$c" '{print n "=" $14+$15}' "$p/stat" ;; esac
  done
}

bench_pair() {   # run_pair, and the traffic must have crossed the veth pair (both devices sent/received)
  bs0=$(snap); cs0=$(cpu_snap); hs0=$(hw_snap); ds0=$(diag_snap)
  run_pair "$@" || return 1
  cpu_delta "$cs0"
  echo "  rxe counters that moved:$(hw_delta "$hs0")"
  echo "$ds0" >/tmp/d0; diag_snap >/tmp/d1
  echo "  diag:$(awk -F= 'NR == FNR {a[$1] = $2; next} $2 != a[$1] {printf " %s+%d", $1, $2 - a[$1]}' /tmp/d0 /tmp/d1)"
  deltas "$bs0"
  [ "${BENCH_NOCROSS:-0}" = 1 ] || crossed || { PAIR_WHY="packet counters did not all increase ($(pkts))"; return 1; }
}

# ib_write_bw over the RDMA CM (-R): one-sided RDMA writes, $BENCH_BYTES in one direction.
# perftest's "BW average[MB/sec]" uses MB = 2^20 bytes.  perftest converts TSC cycles with a CPU clock it
# calibrates at start-up by busy-waiting; on a loaded host that calibration can fail ("Correlation
# coefficient r^2 < 0.9"), and the result is printed as 0.00: such a measurement is repeated (3 tries).
bench_ib_write_bw() { bench_perftest ib_write_bw "$@"; }
# ib_send_bw (two-sided SENDs into posted receives, like SDP's Data messages): not in the default set,
# it shows what rxe's SEND path costs against its RDMA Write path in the same boot.
bench_ib_send_bw() { bench_perftest ib_send_bw "$@"; }
# ib_write_bw-lo: the same on rxe1 alone (client and server on $B: Soft-RoCE loopback, no veth), the
# path the shim's connections take in this rig (--bench-preload compares iperf3-sdp with both).
bench_ib_write_bw_lo() { PT_LO=1 bench_perftest ib_write_bw "$@"; PT_LO=0; }
bench_perftest() {   # TOOL SIZE RUN
  t=$1; shift
  n=$((BENCH_BYTES / $1)); tn=$t$SFX; name=bench-$tn-$1-$2; try=1
  cli="$CM_SRC_A $t -R -d $D0 -s $1 -n $n -F $B"
  if [ "${PT_LO:-0}" = 1 ]; then tn=$t-lo; name=bench-$tn-$1-$2; cli="$t -R -d rxe1 -s $1 -n $n -F $B"; BENCH_NOCROSS=1; fi
  while [ $try -le 3 ]; do
    if bench_pair "$name" "$t -R -d $D1 -s $1 -n $n -F" "$cli"; then
      bw=$(awk '/#bytes/ {getline; print $4; exit}' "$LOGD/$name.cli")
      bps=""   # a finite positive number only (perftest prints "inf" when its clock calibration failed)
      if echo "$bw" | grep -Eq '^[0-9]+(\.[0-9]+)?$'; then bps=$(awk -v m="$bw" 'BEGIN{ if (m + 0 > 0) printf "%.0f", m * 1048576 }'); fi
      if [ -n "$bps" ]; then
        BENCH_NOCROSS=0
        bench_row "$tn" "$1" "$2" "$bps" "\"iters\":$n,\"tries\":$try"; pass "$name" "${bw} MiB/s; $(pkts)"; return
      fi
      PAIR_WHY="BW average '${bw}' (clock calibration: $(grep -h -m1 -i 'correlation\|conflicting' "$LOGD/$name.cli" "$LOGD/$name.srv"))"
    fi
    echo "  $name try $try: $PAIR_WHY"
    try=$((try + 1))
  done
  BENCH_NOCROSS=0
  pair_logs "$name" "$t" "$t"; fail "$name" "$PAIR_WHY"
}

# rstream (rsockets): the client sends COUNT messages, then the server sends COUNT back; rstream's own
# figure counts both directions over the whole time, i.e. the one-way streaming rate.
bench_rstream() {   # SIZE RUN
  # (rs_xfers: bench_pair's helpers use $c for their own loops)
  rs_xfers=$((BENCH_BYTES / $1)); name=bench-rstream$SFX-$1-$2
  if bench_pair "$name" "rstream -b $B -S $1 -C $rs_xfers" "rstream -b $A -s $B -S $1 -C $rs_xfers"; then
    # columns: name bytes xfers iters total time Gb/sec usec/xfer
    usx=$(awk 'NF == 8 && $8 + 0 > 0 {v = $8} END {print v}' "$LOGD/$name.cli")
    bps=$(awk -v s="$1" -v u="$usx" 'BEGIN{ if (u + 0 > 0) printf "%.0f", s * 1e6 / u }')
    if [ -n "$bps" ]; then bench_row "rstream$SFX" "$1" "$2" "$bps" "\"xfers\":$rs_xfers"; pass "$name" "$usx usec/xfer"; return; fi
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
# tests/rig/run --sdp-variant NAME=ENV: the same SDP rows again with ENV in the environment of both
# ends, as tools sdp-MODE+NAME (one line "NAME=ENV" each in /rig/sdp-variants).
bench_sdp() {   # SIZE RUN
  [ -x $SDP ] || return 0
  for mode in bcopy zcopy; do
    want_tool "sdp-$mode$SFX" || continue
    bench_sdp1 "$1" "$2" "$mode" "sdp-$mode$SFX" ""
    if [ -s /rig/sdp-variants ]; then
      while IFS= read -r v; do
        [ -n "$v" ] || continue
        bench_sdp1 "$1" "$2" "$mode" "sdp-$mode$SFX+${v%%=*}" "env ${v#*=} "
      done </rig/sdp-variants
    fi
  done
}
bench_sdp1() {   # SIZE RUN MODE TOOL ENVPREFIX
  name=bench-$4-$1-$2
  if bench_pair "$name" "$5$SDP bench-server $B:7490 $3 $1 $BENCH_BYTES" \
                        "$5$SDP bench-client $B:7490 $A $3 $1 $BENCH_BYTES"; then
    bps=$(sed -n 's/^BENCH-CLIENT .*bytes_per_sec=\([0-9]*\).*/\1/p' "$LOGD/$name.cli")
    cc=$(sed -n 's/^BENCH-CLIENT .*cpu_s_per_gib=\([0-9.]*\).*/\1/p' "$LOGD/$name.cli")
    sc=$(sed -n 's/^BENCH-SERVER .*cpu_s_per_gib=\([0-9.]*\).*/\1/p' "$LOGD/$name.srv")
    if [ -n "$bps" ] && [ -n "$cc" ] && [ -n "$sc" ]; then
      show "$LOGD/$name.cli" "$LOGD/$name.srv" | grep -E 'BENCH-(CLIENT|SERVER)|loop:'
      bench_row "$4" "$1" "$2" "$bps" "\"cpu_s_per_gib_client\":$cc,\"cpu_s_per_gib_server\":$sc"
      pass "$name" "$(awk -v b="$bps" 'BEGIN{printf "%.1f MB/s", b/1e6}'), CPU s/GiB client $cc server $sc"
      return
    fi
    PAIR_WHY="no BENCH-CLIENT/BENCH-SERVER figures in the output"
  fi
  pair_logs "$name" sdp-rigtest sdp-rigtest; fail "$name" "$PAIR_WHY"
}

# LD_PRELOAD rows (tests/rig/run --bench-preload; tools iperf3-MODE and sockperf-MODE, MODE sdp: the
# project's shim with SDP_PROVIDERS=rdma, rs: rsockets' librspreload, tcp: kernel TCP over the veth).
# The commands are those of guest/preload.sh.  The shim's connections do not take the client's bound
# source address (TODO.md), so they run rxe1 to rxe1 (Soft-RoCE loopback): these rows do not require
# the veth crossing; an sdp row requires the shim's report to say rdma for every socket instead.
PL_LIB_ONLY=1 . "${RIG_DIR:-/rig}/preload.sh"
PL_LIB_ONLY=0
bench_report_ok() {   # NAME MODE: for the shim, every socket in the report went over rdma
  [ "$2" = sdp ] || return 0
  PL_WHY=""; pl_report "$1" && return 0
  PAIR_WHY="$PL_WHY"; return 1
}
# iperf3 -l SIZE -n $BENCH_BYTES: bytes_per_sec is the receiver's figure (end.sum_received)
bench_iperf3() {   # MODE SIZE RUN
  name=bench-iperf3-$1-$2-$3; E=$(pl_env "$1" "$name"); rm -f "$PLD/$name.report"
  BENCH_NOCROSS=1
  if bench_pair "$name" "$E iperf3 -s -B $B -p 7510 -1" \
                        "$E iperf3 -c $B -B $A -p 7510 -l $2 -n $BENCH_BYTES --json" && bench_report_ok "$name" "$1"; then
    BENCH_NOCROSS=0
    bits=$(awk '/"sum_received"/ {f = 1} f && match($0, /"bits_per_second":[ \t]*[0-9.e+]+/) {s = substr($0, RSTART, RLENGTH); sub(/.*:[ \t]*/, "", s); printf "%.0f", s / 8; exit}' "$LOGD/$name.cli")
    if [ "${bits:-0}" -gt 0 ]; then
      bench_row "iperf3-$1" "$2" "$3" "$bits" "\"path\":\"$(if crossed; then echo veth; elif [ $((D1S + D0S)) -gt 0 ]; then echo loopback; else echo tcp; fi)\""
      pass "$name" "$(awk -v b="$bits" 'BEGIN{printf "%.1f MB/s", b/1e6}'); $(pkts)"; return
    fi
    PAIR_WHY="no sum_received bits_per_second in iperf3's --json"
  fi
  BENCH_NOCROSS=0
  pair_logs "$name" iperf3 iperf3; show "$PLD/$name.report" 2>/dev/null | cut -c1-200 | head -4
  bench_fail "$name" "iperf3-$1" "$2" "$3" "$PAIR_WHY"
}
# bench_fail NAME TOOL SIZE RUN WHY: under librspreload a failure is a finding (a row with "fails"),
# not a failed check; anything else fails the check
bench_fail() {
  w=$(echo "$5" | tr -d '"\\' | tr '\t' ' ' | cut -c1-160)
  echo "RIG-BENCH: {\"tool\":\"$2\",\"size_bytes\":$3,\"run\":$4,\"fails\":\"$w\"}"
  case $2 in *-rs) echo "  $1: librspreload fails (a finding, not a rig failure): $5" ;; *) fail "$1" "$5" ;; esac
}
# sockperf ping-pong (TCP, 14-byte messages, 5 s): percentiles 50 and 99 of the round trip, in usec
bench_sockperf() {   # MODE RUN
  name=bench-sockperf-$1-$2; E=$(pl_env "$1" "$name"); rm -f "$PLD/$name.report"
  PL_WHY="" PL_ST=90 PL_CT=60; t0b=$(now)
  if pl_srv "$name" "$E sockperf sr --tcp -i $B -p 7511"; then
    pl_cli "$name" "$E sockperf pp --tcp -i $B -p 7511 --client_ip $A -t ${BENCH_SOCKPERF_SECS:-5}"
    pl_stop INT
  fi
  PAIR_T=$(since "$t0b")
  [ "$1" != sdp ] || pl_report "$name"
  p50=$(awk '/percentile 50.000/ {print $NF; exit}' "$LOGD/$name.cli")
  p99=$(awk '/percentile 99.000/ {print $NF; exit}' "$LOGD/$name.cli")
  if [ -z "$PL_WHY" ] && [ -n "$p50" ]; then
    echo "RIG-BENCH: {\"tool\":\"sockperf-$1\",\"size_bytes\":14,\"run\":$2,\"p50_usec\":$p50,\"p99_usec\":${p99:-0},\"mtu\":$RIG_MTU,\"pair_secs\":$PAIR_T}"
    pass "$name" "p50 $p50 usec, p99 ${p99:-?} usec"; return
  fi
  [ -n "$p50" ] || PL_WHY="${PL_WHY}no percentile 50 line; "
  pair_logs "$name" sockperf sockperf; bench_fail "$name" "sockperf-$1" 14 "$2" "${PL_WHY%; }"
}

SFX="" D0=rxe0 D1=rxe1 RXE_A=$A RXE_B=$B RXE_CM=$CM_SRC_A
section "benchmarks: $RIG_RUNS runs, sizes $BENCH_SIZES, tools $BENCH_TOOLS, $((BENCH_BYTES / 1048576)) MiB each"
[ ! -s /rig/sdp-variants ] || { echo "  SDP variants:"; sed 's/^/    /' /rig/sdp-variants; }
run=1
while [ $run -le "$RIG_RUNS" ]; do
  for size in $BENCH_SIZES; do
    if want_tool ib_write_bw; then bench_ib_write_bw "$size" "$run"; fi
    if want_tool ib_write_bw-lo; then bench_ib_write_bw_lo "$size" "$run"; fi
    if want_tool ib_send_bw; then bench_ib_send_bw "$size" "$run"; fi
    if want_tool rstream; then bench_rstream "$size" "$run"; fi
    bench_sdp "$size" "$run"
    # the same over soft-iWARP (tools TOOL-siw: siw0 192.168.78.1 -> siw1 192.168.78.2)
    if [ -d /sys/class/infiniband/siw0 ]; then
      FABRIC=siw SFX=-siw D0=siw0 D1=siw1 A=192.168.78.1 B=192.168.78.2 CM_SRC_A="env LD_PRELOAD=/rig/lib/cm_src_preload.so RIG_CM_SRC=192.168.78.1"
      if want_tool ib_write_bw-siw; then bench_ib_write_bw "$size" "$run"; fi
      if want_tool rstream-siw; then bench_rstream "$size" "$run"; fi
      bench_sdp "$size" "$run"
      FABRIC=rxe SFX="" D0=rxe0 D1=rxe1 A=$RXE_A B=$RXE_B CM_SRC_A=$RXE_CM
    fi
    for m in sdp rs tcp; do if want_tool "iperf3-$m"; then bench_iperf3 "$m" "$size" "$run"; fi; done
  done
  for m in sdp rs tcp; do if want_tool "sockperf-$m"; then bench_sockperf "$m" "$run"; fi; done
  run=$((run + 1))
done
