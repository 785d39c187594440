#!/bin/sh
# Repeat sdp-rigtest scenario pairs over siw (server siw1, client siw0) in one boot and count failures;
# a failure prints both sides' output on the console. Used to measure the siw LocalProtection race:
#   RIG_WORK=... tests/rig/run --guest-test-only --extra tests/rig/demo \
#     --guest-test 'sh /extra/siw-pair-loop.sh 75 "zsend zcopy"'   (75 rounds of each, ~6 min)
N=${1:-30}; SCS=${2:-"zsend zcopy"}
SDP=/rig/bin/sdp-rigtest
A=192.168.78.1 B=192.168.78.2
L=/tmp/loop-logs; mkdir -p $L
listeners() {
  t=$(awk 'FNR > 1 && $4 == "0A"' /proc/net/tcp /proc/net/tcp6 2>/dev/null | wc -l)
  r=$(rdma res show cm_id 2>/dev/null | grep -c 'state LISTEN')
  echo $((t + r))
}
now() { cut -d' ' -f1 /proc/uptime; }
fails=0; runs=0
i=1
while [ $i -le $N ]; do
  for sc in $SCS; do
    port=$((7500 + (i % 200) * 2))
    [ $sc = zcopy ] && port=$((port + 1))
    base=$(listeners)
    t0=$(now)
    timeout 90 $SDP server $sc $B:$port >$L/srv 2>&1 &
    spid=$!
    j=0
    while [ $j -lt 150 ] && [ "$(listeners)" -le "$base" ] && kill -0 $spid 2>/dev/null; do sleep 0.1; j=$((j+1)); done
    timeout 60 $SDP client $sc $B:$port $A >$L/cli 2>&1
    crc=$?
    if [ $crc != 0 ]; then sleep 1; kill $spid 2>/dev/null; fi
    wait $spid; src=$?
    runs=$((runs + 1))
    t=$(awk -v a="$t0" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}')
    if [ $crc = 0 ] && [ $src = 0 ]; then
      echo "LOOP $sc $i PASS ${t}s $(grep -o 'gathered from sources [0-9]* B' $L/cli)"
    else
      fails=$((fails + 1))
      {
      echo "LOOP $sc $i FAIL ${t}s client=$crc server=$src"
      echo "---- server:"; sed 's/^/  S| /' $L/srv | tail -40
      echo "---- client:"; sed 's/^/  C| /' $L/cli | tail -40
      dmesg | tail -20 | sed 's/^/  K| /'
      } > /dev/console 2>&1
      cp $L/srv $L/fail-$fails.srv; cp $L/cli $L/fail-$fails.cli
    fi
  done
  i=$((i + 1))
done
echo "LOOP-SUMMARY runs=$runs fails=$fails"
[ $fails = 0 ]
