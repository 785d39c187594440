# shellcheck shell=sh disable=SC2086
# Unmodified programs over SDP (sourced by tests.sh when /rig/lib/libsdp_preload.so exists; tests/rig/run
# builds it with `cargo build --release -p sdp-preload --features rdma`).
#
# Each program runs as a server on $B (rxe1) and a client towards it, given $A (rxe0) as its source
# where it has an option for that, first under the project's shim, then under rsockets' librspreload:
#   - under the shim (LD_PRELOAD=libsdp_preload.so SDP_PROVIDERS=rdma SDP_REPORT=...): one RIG-CHECK per
#     program; it passes only if the program did its job (checked below) AND the shim's report has a
#     line for both the client and the server side and every line says "transport":"rdma" (a silent
#     fallback to kernel TCP fails the check). SDP_PROVIDERS=rdma because both ends are in one guest:
#     without it the shim would pick shm for this host's own addresses.
#   - under librspreload (LD_PRELOAD=librspreload.so): the same commands; works/fails is recorded and
#     printed as a table, it never fails the rig (a failure of rsockets is a finding, not ours).
# The shim's connect leaves from the address a program bound (nc -s, iperf3 -B, sockperf --client_ip:
# $A, so rxe0 to rxe1 across the veth pair); a program that binds none is placed by the route to $B
# (rxe1 to rxe1, Soft-RoCE loopback). Each line shows which devices' packet counters moved.
# Quick by design (a few MiB per program); the heavier runs are in bench.sh (--bench-preload).
PRE=${PRE:-/rig/lib/libsdp_preload.so}
RSP=${RSP:-/usr/lib/x86_64-linux-gnu/rsocket/librspreload.so}
PLD=/tmp/preload
# netcat-openbsd by its full name: busybox sh (and busybox env) prefer their own nc applet to PATH
NC=${NC:-/bin/nc.openbsd}
mkdir -p $PLD
PL_WANT=${PL_WANT:-rdma}                    # the transport the shim's report must show
PL_SHIM_ENV=${PL_SHIM_ENV:-SDP_PROVIDERS=rdma}
PL_SRV_T=${PL_SRV_T:-90}                    # server and client limits (s) under the shim
PL_CLI_T=${PL_CLI_T:-60}
PL_RS_SRV_T=${PL_RS_SRV_T:-40}              # and under librspreload (which may hang)
PL_RS_CLI_T=${PL_RS_CLI_T:-15}
PL_NC_BYTES=${PL_NC_BYTES:-4194304}
PL_IPERF_BYTES=${PL_IPERF_BYTES:-8M}
PL_REDIS_N=${PL_REDIS_N:-1000}
PL_WRK_SECS=${PL_WRK_SECS:-2}
PL_HTTP_BYTES=${PL_HTTP_BYTES:-1048576}

# pl_env MODE NAME: the command prefix of MODE (sdp: the shim; rs: librspreload; tcp: neither)
pl_env() {
  case $1 in
    sdp) echo "env LD_PRELOAD=$PRE $PL_SHIM_ENV SDP_REPORT=$PLD/$2.report" ;;
    rs) echo "env LD_PRELOAD=$RSP" ;;
    *) echo "env" ;;
  esac
}

# pl_srv NAME CMD: CMD (a command line for sh -c, may redirect) in the background; waits until a new
# listener shows up.  Sets PL_SPID.  pl_cli NAME CMD: the client in the foreground, bounded.
pl_srv() {
  n=$1; shift; base=$(listeners)
  timeout "$PL_ST" sh -c "exec $*" >"$LOGD/$n.srv" 2>&1 </dev/null &
  PL_SPID=$!
  wait_listen "$base" "$PL_SPID" && return 0
  if kill -0 "$PL_SPID" 2>/dev/null; then PL_WHY="${PL_WHY}server not listening after 15 s; "; kill -9 "$PL_SPID" 2>/dev/null
  else wait "$PL_SPID"; PL_WHY="${PL_WHY}server exited ($?) before listening; "; fi
  wait "$PL_SPID" 2>/dev/null
  return 1
}
pl_cli() {
  n=$1; shift
  timeout "$PL_CT" sh -c "exec $*" >"$LOGD/$n.cli" 2>&1 </dev/null
  PL_CRC=$?
  [ $PL_CRC = 0 ] || PL_WHY="${PL_WHY}client exit $PL_CRC; "
  return $PL_CRC
}
# pl_stop SIG|none: the server exits by itself (none: within 10 s, else a failure) or on SIG; bounded
# (KILL after 10 s).  A server that had to be killed with KILL never wrote its report.
pl_stop() {
  [ "$1" = none ] || kill -"$1" "$PL_SPID" 2>/dev/null
  i=0
  while [ $i -lt 100 ] && kill -0 "$PL_SPID" 2>/dev/null; do sleep 0.1; i=$((i + 1)); done
  if kill -0 "$PL_SPID" 2>/dev/null; then
    kill -9 "$PL_SPID" 2>/dev/null
    if [ "$1" = none ]; then w="its client finished"; else w="SIG$1"; fi
    PL_WHY="${PL_WHY}server still running 10 s after $w (killed); "
  fi
  wait "$PL_SPID"; PL_SRC=$?
  case $1:$PL_SRC in none:0|INT:0|TERM:0|QUIT:0|TERM:143|INT:130) ;; *) PL_WHY="${PL_WHY}server exit $PL_SRC; " ;; esac
}

# --- the programs: pl_PROG MODE NAME; return 0 if the program did its job, else PL_WHY says why -------
pl_nc() {   # a checksummed one-way transfer; the client shuts its write half at EOF (-N)
  E=$(pl_env "$1" "$2")
  [ -s $PLD/nc.in ] || head -c "$PL_NC_BYTES" /dev/urandom >$PLD/nc.in
  rm -f $PLD/nc.out
  pl_srv "$2" "$E $NC -l $B 7500 >$PLD/nc.out" || return 1
  pl_cli "$2" "$E $NC -N -s $A $B 7500 <$PLD/nc.in"
  pl_stop none
  want=$(md5sum <$PLD/nc.in | cut -d' ' -f1); got=$(md5sum <$PLD/nc.out 2>/dev/null | cut -d' ' -f1)
  got_n=$(wc -c <$PLD/nc.out 2>/dev/null || echo 0)
  [ "$want" = "$got" ] || PL_WHY="${PL_WHY}received $got_n of $PL_NC_BYTES bytes, md5 $got != $want; "
  PL_INFO="$PL_NC_BYTES bytes, md5 ok"
  [ -z "$PL_WHY" ]
}

pl_iperf3() {   # iperf3 -n: the receiver's byte count (end.sum_received.bytes of the client's --json)
  E=$(pl_env "$1" "$2")
  pl_srv "$2" "$E iperf3 -s -B $B -p 7501 -1" || return 1
  pl_cli "$2" "$E iperf3 -c $B -B $A -p 7501 -n $PL_IPERF_BYTES --json"
  pl_stop none
  rb=$(awk '/"sum_received"/ {f = 1} f && match($0, /"bytes":[ \t]*[0-9]+/) {s = substr($0, RSTART, RLENGTH); gsub(/[^0-9]/, "", s); print s; exit}' "$LOGD/$2.cli")
  bps=$(awk '/"sum_received"/ {f = 1} f && match($0, /"bits_per_second":[ \t]*[0-9.e+]+/) {s = substr($0, RSTART, RLENGTH); sub(/.*:[ \t]*/, "", s); printf "%.0f", s; exit}' "$LOGD/$2.cli")
  [ "${rb:-0}" -gt 0 ] || PL_WHY="${PL_WHY}no bytes received in iperf3's --json ($(grep -m1 '"error"' "$LOGD/$2.cli")); "
  PL_INFO="received ${rb:-0} bytes, $(awk -v b="${bps:-0}" 'BEGIN{printf "%.1f Mbit/s", b/1e6}')"
  [ -z "$PL_WHY" ]
}

pl_redis() {   # redis-benchmark -t set,get: both must report requests per second
  E=$(pl_env "$1" "$2")
  pl_srv "$2" "$E redis-server --bind $B --port 7502 --save '' --appendonly no --protected-mode no --daemonize no --dir $PLD" || return 1
  pl_cli "$2" "$E redis-benchmark -h $B -p 7502 -t set,get -n $PL_REDIS_N -c 4 -q"
  pl_stop TERM
  tr '\r' '\n' <"$LOGD/$2.cli" | grep -E '^(SET|GET): [0-9.]+ requests per second' >$PLD/redis.res
  for op in SET GET; do grep -q "^$op:" $PLD/redis.res || PL_WHY="${PL_WHY}no $op result; "; done
  PL_INFO="$(tr '\n' ' ' <$PLD/redis.res | sed 's/requests per second/rps/g; s/ *$//')"
  [ -z "$PL_WHY" ]
}

pl_sockperf() {   # TCP ping-pong: a percentile-50 line
  E=$(pl_env "$1" "$2")
  pl_srv "$2" "$E sockperf sr --tcp -i $B -p 7503" || return 1
  pl_cli "$2" "$E sockperf pp --tcp -i $B -p 7503 --client_ip $A -t ${PL_SOCKPERF_SECS:-2}"
  pl_stop INT
  p50=$(awk '/percentile 50.000/ {print $NF; exit}' "$LOGD/$2.cli")
  [ -n "$p50" ] || PL_WHY="${PL_WHY}no percentile 50 line; "
  PL_INFO="p50 ${p50:-?} usec"
  [ -z "$PL_WHY" ]
}

pl_nginx_setup() {
  mkdir -p $PLD/ng/www $PLD/ng/tmp
  [ -s $PLD/ng/www/big.bin ] || head -c "$PL_HTTP_BYTES" /dev/urandom >$PLD/ng/www/big.bin
  echo "hello from the rig" >$PLD/ng/www/small.html
  printf 'GET /big.bin HTTP/1.0\r\nHost: rig\r\n\r\n' >$PLD/ng/get.req
  # master_process off: one process, so its listener stays SDP (docs/preload.md: a listener that a fork
  # shares, as with a master and workers, serves kernel TCP only)
  cat >$PLD/ng/nginx.conf <<EOF
daemon off;
master_process off;
user root;
worker_processes 1;
error_log stderr warn;
# nginx clears its environment at start; the shim reads these at exit
env SDP_REPORT;
env SDP_PROVIDERS;
env SDP_LOG;
pid $PLD/ng/nginx.pid;
events { worker_connections 256; }
http {
  access_log off;
  default_type application/octet-stream;
  sendfile on;
  keepalive_requests 100000;
  client_body_temp_path $PLD/ng/tmp/body;
  proxy_temp_path $PLD/ng/tmp/proxy;
  fastcgi_temp_path $PLD/ng/tmp/fastcgi;
  uwsgi_temp_path $PLD/ng/tmp/uwsgi;
  scgi_temp_path $PLD/ng/tmp/scgi;
  server { listen $B:7504; root $PLD/ng/www; }
}
EOF
}
pl_nginx() {   # wrk: requests completed without socket errors; then a checksummed download (nc GET)
  E=$(pl_env "$1" "$2")
  pl_nginx_setup
  rm -f $PLD/ng/resp
  pl_srv "$2" "$E nginx -p $PLD/ng/ -c $PLD/ng/nginx.conf -e stderr" || return 1
  # -c2, not more: wrk sizes its event loop for 10 + 3 x connections fds, and under the shim a program's
  # socket fds come out higher (the shim's own fds take low numbers, TODO.md): with -c4 the fourth
  # connection's fd is 22 = the loop's size, and wrk counts "Socket errors: connect 1"
  if pl_cli "$2" "$E wrk -t1 -c${PL_WRK_CONNS:-2} -d${PL_WRK_SECS}s http://$B:7504/small.html"; then
    reqs=$(awk '/requests in/ {print $1; exit}' "$LOGD/$2.cli")
    [ "${reqs:-0}" -gt 0 ] || PL_WHY="${PL_WHY}wrk completed no request; "
    ! grep -q 'Socket errors' "$LOGD/$2.cli" || PL_WHY="${PL_WHY}wrk: $(grep -m1 'Socket errors' "$LOGD/$2.cli" | sed 's/^ *//'); "
    ! grep -q 'Non-2xx' "$LOGD/$2.cli" || PL_WHY="${PL_WHY}wrk: $(grep -m1 'Non-2xx' "$LOGD/$2.cli" | sed 's/^ *//'); "
    rps=$(awk '/^Requests\/sec/ {print $2; exit}' "$LOGD/$2.cli")
    cp "$LOGD/$2.cli" "$LOGD/$2.wrk"
    pl_cli "$2" "$E $NC -N -s $A $B 7504 <$PLD/ng/get.req >$PLD/ng/resp"
    want=$(md5sum <$PLD/ng/www/big.bin | cut -d' ' -f1)
    got=$(tail -c "$PL_HTTP_BYTES" $PLD/ng/resp 2>/dev/null | md5sum | cut -d' ' -f1)
    head -1 $PLD/ng/resp 2>/dev/null | grep -q '^HTTP/1.1 200' || PL_WHY="${PL_WHY}GET /big.bin: no 200 ($(head -c 80 $PLD/ng/resp 2>/dev/null | head -1)); "
    [ "$want" = "$got" ] || PL_WHY="${PL_WHY}GET /big.bin: md5 $got != $want ($(wc -c <$PLD/ng/resp 2>/dev/null) bytes with the header); "
    cat "$LOGD/$2.wrk" "$LOGD/$2.cli" >"$LOGD/$2.cli.all" 2>/dev/null; mv "$LOGD/$2.cli.all" "$LOGD/$2.cli"
  fi
  pl_stop TERM
  PL_INFO="wrk ${reqs:-0} requests (${rps:-?}/s), GET $PL_HTTP_BYTES bytes md5 ok"
  [ -z "$PL_WHY" ]
}

# pl_report NAME: the shim's report has client and server lines, every one with transport $PL_WANT
pl_report() {
  r=$PLD/$1.report
  [ -s "$r" ] || { PL_WHY="${PL_WHY}no SDP_REPORT lines; "; return 1; }
  nc_=$(grep -c '"role":"client"' "$r"); ns_=$(grep -c '"role":"server"' "$r")
  bad=$(grep -vc "\"transport\":\"$PL_WANT\"" "$r")
  [ "$nc_" -gt 0 ] || PL_WHY="${PL_WHY}no client socket in the report; "
  [ "$ns_" -gt 0 ] || PL_WHY="${PL_WHY}no server socket in the report; "
  [ "$bad" = 0 ] || PL_WHY="${PL_WHY}$bad socket(s) not over $PL_WANT: $(grep -v "\"transport\":\"$PL_WANT\"" "$r" | head -2 | sed 's/"pid":[0-9]*,//' | tr '\n' ' '); "
  PL_REP="report: $nc_ client + $ns_ server sockets, all $PL_WANT"
  [ -z "$PL_WHY" ]
}

# pl_run MODE PROG: one program in one mode; sdp -> a RIG-CHECK, rs/tcp -> a table row
PL_TABLE=$PLD/table
pl_run() {
  mode=$1 prog=$2 name=preload-$2; [ "$1" = sdp ] || name=$1preload-$2
  PL_WHY="" PL_INFO="" PL_REP="" t0p=$(now); s0p=$(snap)
  rm -f "$PLD/$name.report" "$LOGD/$name.srv" "$LOGD/$name.cli"
  if [ "$mode" = sdp ]; then PL_ST=$PL_SRV_T PL_CT=$PL_CLI_T; else PL_ST=$PL_RS_SRV_T PL_CT=$PL_RS_CLI_T; fi
  pl_$prog "$mode" "$name"; ok=$?
  [ "$mode" != sdp ] || pl_report "$name" || ok=1
  deltas "$s0p"
  if crossed; then path="crossed the veth"; elif [ $((D0S + D0R + D1S + D1R)) -gt 0 ]; then path="one device (loopback)"; else path="no RDMA packets"; fi
  took=$(since "$t0p")
  if [ $ok = 0 ] && [ -z "$PL_WHY" ]; then res=works; else res=FAILS; fi
  # the programs' own first complaint, for the table
  if [ $res = FAILS ]; then
    h=$(cat "$LOGD/$name.srv" "$LOGD/$name.cli" 2>/dev/null | tr -d '\r\t"' |
        grep -m1 -iE 'error|fail|not supported|not permitted|non-socket|crashed|segmentation|refused|reset' | cut -c1-120)
    [ -z "$h" ] || PL_WHY="${PL_WHY}program: $h; "
  fi
  printf '%s %s %s %s|%s\n' "$prog" "$mode" "$res" "$took" "${PL_WHY:-$PL_INFO}" >>$PL_TABLE
  if [ "$mode" = sdp ]; then
    if [ $res = works ]; then
      tr '\r' '\n' <"$LOGD/$name.cli" | show | tail -3; show "$PLD/$name.report" | cut -c1-200 | head -4
      pass "$name" "${took}s; $PL_INFO; $PL_REP; $path: $(pkts)"
    else
      echo "  server:"; show "$LOGD/$name.srv" 2>/dev/null | tail -12
      echo "  client:"; show "$LOGD/$name.cli" 2>/dev/null | tail -12
      [ ! -s "$PLD/$name.report" ] || { echo "  report:"; show "$PLD/$name.report" | cut -c1-300; }
      fail "$name" "${PL_WHY%; } (${took}s; $path: $(pkts))"
    fi
  else
    echo "  $mode $prog: $res (${took}s; $path: $(pkts)): ${PL_WHY:-$PL_INFO}"
    [ $res = works ] || { show "$LOGD/$name.srv" 2>/dev/null | tail -6; show "$LOGD/$name.cli" 2>/dev/null | tail -6; }
  fi
}

# pl_relisten: the shim's listener listens over RDMA again once its device is back (issue 14). redis-server
# under the shim on $B; a redis-cli PING under the shim goes over rdma; rxe1 is deleted (the server lets
# go of it at once, else the delete waits) and added back; the next PING finds no SDP listener and falls
# back to kernel TCP, and that accept makes the server listen over RDMA again: the PING after it must go
# over rdma. Each client's transport is read from its own SDP_REPORT.
pl_relisten() {
  name=preload-relisten PL_WHY="" t0p=$(now) PL_ST=$PL_SRV_T PL_CT=$PL_CLI_T
  rm -f $PLD/$name.*.report "$LOGD/$name.cli"
  E="env LD_PRELOAD=$PRE $PL_SHIM_ENV"
  tr_of() { grep -o '"transport":"[a-z]*"' "$PLD/$name.$1.report" 2>/dev/null | head -1 | cut -d'"' -f4; }
  ping_as() {   # ping_as TAG WANT: one PING under the shim, whose socket must be over WANT
    echo "--- $1" >>"$LOGD/$name.cli"
    timeout 20 $E SDP_REPORT=$PLD/$name.$1.report redis-cli -h $B -p 7503 ping >>"$LOGD/$name.cli" 2>&1 ||
      PL_WHY="${PL_WHY}$1: redis-cli failed; "
    t=$(tr_of "$1")
    [ "$t" = "$2" ] || PL_WHY="${PL_WHY}$1: the client went over ${t:-nothing} (want $2); "
  }
  if pl_srv "$name" "$E SDP_REPORT=$PLD/$name.srv.report redis-server --bind $B --port 7503 --save '' --appendonly no --protected-mode no --daemonize no --dir $PLD"; then
    ping_as before rdma
    tk=$(now)
    timeout 30 rdma link delete rxe1 || PL_WHY="${PL_WHY}rdma link delete rxe1 failed or waited 30 s; "
    took=$(since "$tk")
    rdma link add rxe1 type rxe netdev veth1 || PL_WHY="${PL_WHY}rdma link add rxe1 failed; "
    i=0
    while [ $i -lt 100 ] && ! grep -q ACTIVE /sys/class/infiniband/rxe1/ports/1/state 2>/dev/null; do sleep 0.1; i=$((i + 1)); done
    ping_as fallback tcp
    ping_as after rdma
    n=$(grep -c PONG "$LOGD/$name.cli")
    [ "$n" = 3 ] || PL_WHY="${PL_WHY}$n PONGs of 3; "
    pl_stop TERM
  fi
  if [ -z "$PL_WHY" ]; then
    pass "$name" "rdma, then tcp while no SDP listener, then rdma again; rxe1 deleted in ${took}s ($(since "$t0p")s)"
  else
    echo "  server:"; show "$LOGD/$name.srv" 2>/dev/null | tail -8
    echo "  clients:"; show "$LOGD/$name.cli" 2>/dev/null | tail -12
    fail "$name" "${PL_WHY%; } ($(since "$t0p")s)"
  fi
}

# bench.sh sources this file for its functions only
[ "${PL_LIB_ONLY:-0}" = 1 ] && return 0
PL_PROGS=${PL_PROGS:-nc iperf3 redis sockperf nginx}
: >$PL_TABLE
section "preload: unmodified programs under the project's shim, SDP over rdma (server $B, client $A)"
for p in $PL_PROGS; do pl_run sdp "$p"; done
[ "${PL_RELISTEN:-1}" = 1 ] && pl_relisten
if [ -f $RSP ]; then
  section "preload: the same programs under rsockets' librspreload (findings, not rig failures)"
  for p in $PL_PROGS; do pl_run rs "$p"; done
fi
echo
echo "  preload table (works/fails; time; what was measured or why it failed):"
awk '{m[$1" "$2] = $3 " (" substr($4, 1, index($4, "|") - 1) "s)"; if (!($1 in seen)) {seen[$1] = 1; o[++n] = $1}}
     END {printf "  %-9s %-18s %-18s\n", "program", "sdp-preload", "librspreload"
          for (i = 1; i <= n; i++) printf "  %-9s %-18s %-18s\n", o[i], m[o[i]" sdp"], (o[i]" rs" in m) ? m[o[i]" rs"] : "-"}' $PL_TABLE
while IFS= read -r l; do echo "  PRELOAD-ROW: $l"; done <$PL_TABLE
