#!/bin/bash
# uwsgi's HTTP router (--http: one epoll process between the clients and the workers) with
# ab -k -c 4 fetching 300 x 1 MB. Over kernel TCP ~0.8 s; with the shim on ab and uwsgi ~4-5 s.
# Only the ab->router leg matters (shim on uwsgi alone: ~1.1 s).
# The script measures a kernel-TCP baseline itself, then the same with $SHIM (if set) on every
# process; DIFF if the run under test is over 3x the baseline.
# Usage: repro-uwsgi-router-slow.sh (PASS) ; SHIM=$(dirname "$0")/../../../target/release/libsdp_preload.so repro-uwsgi-router-slow.sh (DIFF)
APP=$(mktemp --suffix=.py)
cat > $APP <<'PY'
def application(env, start):
    n = int(env['PATH_INFO'][1:] or 10)
    body = (b'0123456789abcdef' * (n // 16 + 1))[:n]
    start('200 OK', [('Content-Length', str(len(body)))])
    return [body]
PY
run() { # $1 = env prefix ; prints ms
  local P=$((29000 + RANDOM % 1000)) PF=$(mktemp)
  $1 timeout 120 uwsgi --plugin python3 --plugin http --master --wsgi-file $APP --disable-logging \
     --die-on-term --pidfile $PF --http 127.0.0.1:$P --processes 2 >/dev/null 2>&1 &
  local UP=$!
  for i in $(seq 100); do curl -s -o /dev/null http://127.0.0.1:$P/ 2>/dev/null && break; sleep 0.1; done
  local s=$(date +%s%N)
  local out=$($1 timeout 60 ab -q -k -n 300 -c 4 http://127.0.0.1:$P/1000000 2>&1)
  local ms=$(( ($(date +%s%N)-s)/1000000 ))
  echo "$out" | grep -q "Failed requests: *0" || ms=999999
  kill -TERM $(cat $PF); wait $UP; rm -f $PF
  echo $ms
}
T=env; [ -n "$SHIM" ] && T="env LD_PRELOAD=$SHIM"
b1=$(run env); t1=$(run "$T"); b2=$(run env); t2=$(run "$T")
rm -f $APP
echo "kernel TCP: ${b1} ms, ${b2} ms; under test: ${t1} ms, ${t2} ms"
base=$(( (b1 + b2) / 2 )); test=$(( (t1 + t2) / 2 ))
if [ $test -gt $((3 * base)) ]; then echo DIFF; exit 1; else echo PASS; fi
