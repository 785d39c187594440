#!/usr/bin/env bash
# Run one corners case (tests/preload/corners.c; none: all of them) under the shim N times, each
# within a time bound; on the first run that outlives it, dump what every process of the run is
# doing (ps, each thread's user stack with gdb, kernel stacks, fds) and stop. For hangs that show
# once in many runs: the fork child's lock of 2026-11-27 hung fork_per_conn once in ~20 runs.
#
#   tests/preload/loop-corners.sh [CASE] [N] [SECONDS]     (defaults: all, 50, 120)
#
# Dumps go to a directory it names; SDP_SO=PATH runs another build of the shim.
set -uo pipefail
cd "$(dirname "$0")/../.."
CASE=${1:-}
N=${2:-50}
BOUND=${3:-120}
cargo build -q --release -p sdp-preload || exit 1
SO=${SDP_SO:-$PWD/target/release/libsdp_preload.so}
WORK=$(mktemp -d /tmp/sdp-loop-corners.XXXXXX)
command -v gdb >/dev/null || apt-get install -y -qq gdb >/dev/null 2>&1 || true
cc -O2 -Wall -Werror -o "$WORK/corners" tests/preload/corners.c || exit 1
for i in $(seq "$N"); do
    SDP_REPORT="$WORK/report.jsonl" LD_PRELOAD="$SO" setsid "$WORK/corners" ${CASE:+"$CASE"} \
        >"$WORK/out" 2>"$WORK/err" &
    pid=$!
    t=0
    while kill -0 "$pid" 2>/dev/null && [ $t -lt $((BOUND * 10)) ]; do
        sleep 0.1
        t=$((t + 1))
    done
    if kill -0 "$pid" 2>/dev/null; then
        d="$WORK/hang-$i"
        mkdir -p "$d"
        pg=$(ps -o pgid= -p "$pid" | tr -d ' ')
        ps -eo pid,ppid,pgid,stat,wchan:30,cmd | awk -v g="$pg" '$3 == g' >"$d/ps"
        for p in $(awk '{ print $1 }' "$d/ps"); do
            gdb -p "$p" -batch -ex 'thread apply all bt' >"$d/bt.$p" 2>&1
            ls -l "/proc/$p/fd" >"$d/fd.$p" 2>&1
            for th in /proc/"$p"/task/*; do
                echo "== $th $(cat "$th/comm") $(cat "$th/wchan")"
                cat "$th/stack" 2>/dev/null
            done >"$d/kstack.$p"
        done
        cp "$WORK/out" "$WORK/err" "$d/"
        kill -9 -- -"$pg" 2>/dev/null
        wait "$pid" 2>/dev/null
        echo "loop-corners: run $i of ${CASE:-all} outlived ${BOUND} s; processes:"
        cat "$d/ps"
        echo "loop-corners: stacks and fds in $d"
        exit 1
    fi
    wait "$pid"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "loop-corners: run $i of ${CASE:-all} failed (exit $rc):"
        tail -5 "$WORK/out" "$WORK/err"
        exit 1
    fi
done
echo "loop-corners: $N runs of ${CASE:-all}, none outlived ${BOUND} s or failed"
rm -rf "$WORK"
