#!/bin/bash
# run.sh plain|shim SCRIPT.py: one reproduction over kernel TCP or under the shim (README.md).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
so="$here/../../../target/release/libsdp_preload.so"
case "${1:-}" in
plain) exec python3 "$here/$2" ;;
shim)
    [ -e "$so" ] || { echo "build the shim first: cargo build --release -p sdp-preload" >&2; exit 2; }
    LD_PRELOAD="$so" exec python3 "$here/$2" ;;
*) echo "usage: $0 plain|shim SCRIPT.py" >&2; exit 2 ;;
esac
