//! `sdpstat`: the live SDP connections of this user's processes, like `ss -t` for TCP.
//!
//! `sdpstat` prints a table; `sdpstat --json` one JSON object per connection. Every process
//! using SDP (through the shim or the Rust crate) answers from its progress threads
//! (`sdp_core::socket::stat`); `SDP_STAT=0` in a process hides it.

use sdp_core::socket::stat::{query_all, StatLine};
use sdp_preload::json_str;

fn get<'a>(l: &'a StatLine, k: &str) -> &'a str {
    l.get(k).map_or("-", String::as_str)
}

fn program(pid: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

fn main() {
    let json = std::env::args().skip(1).any(|a| a == "--json");
    if let Some(a) = std::env::args().skip(1).find(|a| a != "--json") {
        eprintln!("sdpstat: unknown argument {a:?}; usage: sdpstat [--json]");
        std::process::exit(2);
    }
    let lines = match query_all() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("sdpstat: cannot read /proc/net/unix: {e}");
            std::process::exit(1);
        }
    };
    if json {
        for l in &lines {
            let mut fields: Vec<String> = l
                .iter()
                .map(|(k, v)| format!("{}:{}", json_str(k), json_str(v)))
                .collect();
            fields.push(format!("\"program\":{}", json_str(&program(get(l, "pid")))));
            println!("{{{}}}", fields.join(","));
        }
        return;
    }
    println!(
        "{:<7} {:<15} {:<5} {:<13} {:<22} {:<22} {:>12} {:>12} {:>12} {:>8} {:>8} {:>7}",
        "PID",
        "PROGRAM",
        "STACK",
        "STATE",
        "LOCAL",
        "PEER",
        "BYTES_IN",
        "BYTES_OUT",
        "ZCOPY",
        "RX_Q",
        "TX_Q",
        "CREDITS"
    );
    for l in &lines {
        println!(
            "{:<7} {:<15} {:<5} {:<13} {:<22} {:<22} {:>12} {:>12} {:>12} {:>8} {:>8} {:>7}",
            get(l, "pid"),
            program(get(l, "pid")),
            get(l, "stack"),
            get(l, "state"),
            get(l, "local"),
            get(l, "peer"),
            get(l, "bytes_in"),
            get(l, "bytes_out"),
            get(l, "zcopy_bytes"),
            get(l, "rx_queued"),
            get(l, "tx_queued"),
            get(l, "credits"),
        );
    }
}
