# shellcheck shell=sh disable=SC2034,SC2046,SC2183,SC3045
# Helpers for the guest's checks (sourced by tests.sh and bench.sh; busybox sh).
#
#   rdma_pair NAME "SERVER CMD" "CLIENT CMD"  server in the background, client in the foreground; passes
#                                             if both exit 0 AND both rxe devices sent and received
#                                             packets (so the traffic really crossed the veth pair)
#   run_check NAME CMD [ARGS...]              one command (or shell function), passes if it exits 0
#   run_suite NAME CMD [ARGS...]              like run_check, but a closing line "N passed, M failed" in
#                                             its output is added to our counts (for project binaries)
#   finish                                    prints RIG-RESULT and the closing line; the host reads them
#
# Server and client commands are simple command lines run as `sh -c "exec CMD"` under a timeout (use
# `env VAR=x prog` for environment variables).  Their output is kept in /tmp/rig-logs/NAME.{srv,cli}.
A=192.168.77.1      # veth0 / rxe0: the client side
B=192.168.77.2      # veth1 / rxe1: the server side
# perftest 4.5-0.17 cannot set its rdma_cm source address (its --source_ip is shadowed by the raw
# Ethernet option of the same name), so its clients get it from this LD_PRELOAD shim instead:
CM_SRC_A="env LD_PRELOAD=/rig/lib/cm_src_preload.so RIG_CM_SRC=$A"
CLIENT_TIMEOUT=${CLIENT_TIMEOUT:-60}
SERVER_TIMEOUT=${SERVER_TIMEOUT:-90}
TEST_TIMEOUT=${TEST_TIMEOUT:-600}
LOGD=/tmp/rig-logs
mkdir -p $LOGD
RIG_PASS=${RIG_PASS:-0}
RIG_FAIL=${RIG_FAIL:-0}

now() { cut -d' ' -f1 /proc/uptime; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }
section() { echo; echo "==== $* (uptime $(now)s)"; }
show() { sed 's/^/  | /' "$@"; }   # indented, so no tool's line is read as one of ours

# --- packet counters ------------------------------------------------------------------------------
# FABRIC=siw (guest/siw.sh): soft-iWARP has no hw counters and runs over kernel TCP, which between two
# local addresses goes through lo; there the counters are the kernel's TCP segments out and in
# (/proc/net/snmp), so a check still proves that traffic moved, by siw's transport, not the veth.
FABRIC=rxe
hc() { cat "/sys/class/infiniband/$1/ports/1/hw_counters/$2" 2>/dev/null || echo 0; }
tcp_segs() { awk '$1 == "Tcp:" && $2 ~ /^[0-9-]+$/ {print $12, $11}' /proc/net/snmp; }
snap() {
  if [ "$FABRIC" = siw ]; then echo "$(tcp_segs) $(tcp_segs)"; return; fi
  echo "$(hc rxe0 sent_pkts) $(hc rxe0 rcvd_pkts) $(hc rxe1 sent_pkts) $(hc rxe1 rcvd_pkts)"
}
deltas() {   # deltas "$SNAP_BEFORE": sets D0S D0R D1S D1R
  # shellcheck disable=SC2086
  set -- $1 $(snap)
  D0S=$(($5 - $1)); D0R=$(($6 - $2)); D1S=$(($7 - $3)); D1R=$(($8 - $4))
}
pkts() {
  if [ "$FABRIC" = siw ]; then echo "kernel TCP segments out+$D0S in+$D0R"; return; fi
  echo "rxe0 sent+$D0S rcvd+$D0R, rxe1 sent+$D1S rcvd+$D1R"
}
crossed() { [ "$D0S" -gt 0 ] && [ "$D0R" -gt 0 ] && [ "$D1S" -gt 0 ] && [ "$D1R" -gt 0 ]; }

# --- results --------------------------------------------------------------------------------------
pass() { RIG_PASS=$((RIG_PASS + 1)); echo "RIG-CHECK: PASS $1${2:+ ($2)}"; }
fail() { RIG_FAIL=$((RIG_FAIL + 1)); echo "RIG-CHECK: ${FAIL_WORD:-FAIL} $1${2:+: $2}"; }
finish() {
  n=$((RIG_PASS + RIG_FAIL))
  echo
  if [ $RIG_FAIL = 0 ] && [ $n -gt 0 ]; then r=PASS; else r=FAIL; fi
  echo "RIG-RESULT: $r n=$n fail=$RIG_FAIL"
  echo "$RIG_PASS passed, $RIG_FAIL failed"
}

# --- servers and clients --------------------------------------------------------------------------
listeners() {   # listening TCP sockets + rdma_cm ids in LISTEN state
  t=$(awk 'FNR > 1 && $4 == "0A"' /proc/net/tcp /proc/net/tcp6 2>/dev/null | wc -l)
  r=$(rdma res show cm_id 2>/dev/null | grep -c 'state LISTEN')
  echo $((t + r))
}
wait_listen() {   # wait_listen BASE PID: until a new listener shows up (max 15 s) or PID is gone
  i=0
  while [ $i -lt 150 ]; do
    [ "$(listeners)" -gt "$1" ] && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.1; i=$((i + 1))
  done
  return 1
}
# run_pair NAME SERVER CLIENT: sets SRC CRC (exit codes), PAIR_T (seconds), PAIR_WHY (on failure)
run_pair() {
  rm -f "$LOGD/$1.srv" "$LOGD/$1.cli"
  base=$(listeners); t0=$(now); PAIR_WHY=""
  timeout "$SERVER_TIMEOUT" sh -c "exec $2" >"$LOGD/$1.srv" 2>&1 &
  spid=$!
  wait_listen "$base" "$spid" || PAIR_WHY="server not listening after 15 s; "
  timeout "$CLIENT_TIMEOUT" sh -c "exec $3" >"$LOGD/$1.cli" 2>&1
  CRC=$?
  if [ $CRC != 0 ]; then sleep 1; kill "$spid" 2>/dev/null; fi   # don't let a failed pair wait 90 s
  wait "$spid"
  SRC=$?
  PAIR_T=$(since "$t0")
  [ $CRC = 0 ] || PAIR_WHY="${PAIR_WHY}client exit $CRC; "
  [ $SRC = 0 ] || PAIR_WHY="${PAIR_WHY}server exit $SRC; "
  [ $CRC = 0 ] && [ $SRC = 0 ]
}
pair_logs() {
  echo "  server: $2"; show "$LOGD/$1.srv" | tail -15
  echo "  client: $3"; show "$LOGD/$1.cli" | tail -15
}

rdma_pair() {   # rdma_pair NAME SERVER CLIENT
  s0=$(snap)
  if run_pair "$1" "$2" "$3"; then ok=1; else ok=0; fi
  deltas "$s0"
  if [ $ok = 1 ] && crossed; then
    show "$LOGD/$1.cli" | tail -2
    pass "$1" "${PAIR_T}s; $(pkts)"
  else
    crossed || PAIR_WHY="${PAIR_WHY}packet counters did not all increase; "
    pair_logs "$1" "$2" "$3"
    fail "$1" "${PAIR_WHY%; } (${PAIR_T}s; $(pkts))"
  fi
}

# rdma_pair_flaky NAME SERVER CLIENT: rdma_pair for a check known to fail now and then (each has a
# TODO.md line): a failure is shown (RIG-CHECK: FLAKY-TRY) and the check runs once more, which must
# pass; a pass then is reported as FLAKY, never silently.
rdma_pair_flaky() {
  f0=$RIG_FAIL
  FAIL_WORD=FLAKY-TRY
  rdma_pair "$@"
  FAIL_WORD=
  if [ "$RIG_FAIL" -gt "$f0" ]; then
    RIG_FAIL=$f0
    echo "RIG-CHECK: FLAKY? $1 failed on its first try (a known intermittent failure, TODO.md): once more"
    rdma_pair "$@"
    [ "$RIG_FAIL" = "$f0" ] && echo "RIG-CHECK: FLAKY $1 (passed on the second try)"
  fi
  return 0
}

# A check still running TEST_TIMEOUT + 20 s after it started (its timeout did not end it: a process
# stuck in the kernel ignores signals): print what every process is doing, kernel stacks of the
# stuck ones and the kernel's log, so a wedged guest says why before the VM's own timeout kills it.
stuck_dump() {   # stuck_dump NAME
  echo "RIG: check $1 still running after $((TEST_TIMEOUT + 20)) s; processes (pid state wchan comm):"
  for d in /proc/[0-9]*; do
    st=$(sed -n 's/^State:[[:space:]]*//p' "$d/status" 2>/dev/null)
    [ -n "$st" ] || continue
    echo "  ${d#/proc/} $st $(cat "$d/wchan" 2>/dev/null) $(cat "$d/comm" 2>/dev/null)"
    case $st in D*) sed 's/^/      /' "$d/stack" 2>/dev/null ;; esac
  done
  dmesg | tail -40 | sed 's/^/  dmesg: /'
}

run_check() {   # run_check NAME CMD [ARGS...]
  name=$1; shift
  s0=$(snap); t0=$(now)
  ( sleep $((TEST_TIMEOUT + 20)); stuck_dump "$name" ) &
  wd=$!
  if type "$1" 2>/dev/null | grep -q function; then "$@" >"$LOGD/$name.log" 2>&1   # a shell function
  else timeout -k 10 "$TEST_TIMEOUT" "$@" >"$LOGD/$name.log" 2>&1; fi
  rc=$?
  kill "$wd" 2>/dev/null; wait "$wd" 2>/dev/null
  deltas "$s0"
  show "$LOGD/$name.log" | tail -40
  if [ $rc = 0 ]; then pass "$name" "$(since "$t0")s; $(pkts)"; else fail "$name" "exit $rc ($(since "$t0")s; $(pkts))"; fi
}

run_suite() {   # run_suite NAME CMD [ARGS...]: counts the command's own "N passed, M failed" line
  name=$1; shift
  s0=$(snap); t0=$(now)
  timeout "$TEST_TIMEOUT" "$@" >"$LOGD/$name.log" 2>&1
  rc=$?
  deltas "$s0"
  show "$LOGD/$name.log"
  line=$(grep -E '^([A-Za-z]+: )?[0-9]+ passed, [0-9]+ failed' "$LOGD/$name.log" | tail -1)
  if [ -n "$line" ]; then
    p=$(echo "$line" | sed -E 's/^([A-Za-z]+: )?([0-9]+) passed, ([0-9]+) failed.*/\2/')
    f=$(echo "$line" | sed -E 's/^([A-Za-z]+: )?([0-9]+) passed, ([0-9]+) failed.*/\3/')
    RIG_PASS=$((RIG_PASS + p)); RIG_FAIL=$((RIG_FAIL + f))
    echo "RIG-CHECK: SUITE $name: $p passed, $f failed, exit $rc ($(since "$t0")s; $(pkts))"
    if [ $rc != 0 ] && [ "$f" = 0 ]; then fail "$name" "exit $rc although it reported no failure"; fi
  elif [ $rc = 0 ]; then pass "$name" "$(since "$t0")s; $(pkts)"
  else fail "$name" "exit $rc ($(since "$t0")s; $(pkts))"; fi
}

gid_idx() {   # gid_idx DEV IPv4: index of the ::ffff:a.b.c.d (RoCE v2, IPv4-mapped) GID
  want="0000:0000:0000:0000:0000:ffff:$(printf '%02x%02x:%02x%02x' $(echo "$2" | tr . ' '))"
  for g in /sys/class/infiniband/$1/ports/1/gids/*; do
    [ "$(cat "$g" 2>/dev/null)" = "$want" ] && { basename "$g"; return 0; }
  done
  echo 1
}
