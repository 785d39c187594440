# shellcheck shell=bash
# Helpers shared by programs.sh and bench.sh.

# Wait until something listens on TCP port $1 (read from /proc: a probe connection would be a
# client of the server under test).
wait_port() {
    local hex; hex=$(printf ':%04X' "$1")
    for _ in $(seq 200); do
        awk -v h="$hex" '$4 == "0A" && $2 ~ h"$" { f = 1 } END { exit !f }' /proc/net/tcp /proc/net/tcp6 && return 0
        sleep 0.05
    done
    return 1
}
