//! sdp-bench: throughput and latency of SDP against kernel TCP.
//!
//! * `sdp-bench compare` (the default): starts a server process, then runs SDP (auto, BCopy
//!   only, ZCopy from registered buffers) and kernel TCP one after another over message sizes
//!   64 B to 4 MiB, and prints one table: throughput, messages/s, ping-pong round-trip p50/p99
//!   and CPU seconds per GiB of both ends.
//! * `sdp-bench server [HOST:PORT]` / `sdp-bench client HOST:PORT`: the two ends on their own.
//! * `sdp-bench engine`: the SDP engine alone over the in-memory simulator.

mod args;
mod engine;
mod net;
mod plot;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "sdp-bench",
    version,
    about = "SDP throughput and latency against kernel TCP"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(clap::Args, Clone, Debug)]
pub struct RunOpts {
    /// Message sizes, e.g. 64,64k,1m (default 64 B to 4 MiB; 1 B to 64M, the largest the
    /// server accepts).
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = args::parse_size,
        allow_negative_numbers = true
    )]
    pub sizes: Option<Vec<usize>>,
    /// Seconds per row and test: more than 0, at most 86400 (1 day).
    #[arg(
        long,
        value_name = "SECS",
        default_value_t = 2.0,
        value_parser = args::parse_duration,
        allow_negative_numbers = true
    )]
    pub duration: f64,
    /// Print one JSON object per result row instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Draw throughput and latency against message size into this SVG file (checked for
    /// writing before the run).
    #[arg(long, value_name = "FILE", value_parser = args::parse_plot_path)]
    pub plot: Option<std::path::PathBuf>,
    /// Which tests: stream, pingpong or both.
    #[arg(long, default_value = "both", value_parser = ["stream", "pingpong", "both"])]
    pub tests: String,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run every transport and mode against a server process started for the run.
    Compare {
        #[command(flatten)]
        run: RunOpts,
        /// Only these transports/modes (comma list of sdp-auto, sdp-bcopy, sdp-zcopy, tcp).
        #[arg(long, value_delimiter = ',')]
        only: Option<Vec<String>>,
        /// A busy host: N CPU-bound threads at normal priority run beside the benchmark for the
        /// whole run (in a process of their own, so their CPU is not counted in either end's).
        #[arg(long, value_name = "N", default_value_t = 0, value_parser = args::parse_load)]
        load: usize,
    },
    /// N CPU-bound threads until killed (what `compare --load N` starts).
    #[command(hide = true)]
    Burn { threads: usize },
    /// Serve benchmark clients (SDP and kernel TCP on the same port).
    Server {
        /// Address to listen on.
        #[arg(
            value_name = "HOST:PORT",
            default_value = args::DEFAULT_SERVER_ADDR,
            value_parser = args::parse_server_addr
        )]
        addr: String,
        /// Print the bound address on stdout once listening (for scripts).
        #[arg(long)]
        print_addr: bool,
    },
    /// Run against a server.
    Client {
        /// The server's address (the server listens on port 7471 unless told otherwise).
        #[arg(value_name = "HOST:PORT", value_parser = args::parse_client_addr)]
        addr: String,
        #[command(flatten)]
        run: RunOpts,
        /// Transport/mode: sdp-auto, sdp-bcopy, sdp-zcopy or tcp.
        #[arg(long, default_value = "sdp-auto")]
        mode: String,
    },
    /// The SDP engine alone over the in-memory simulator.
    Engine {
        /// MiB per row.
        #[arg(long, default_value_t = 256)]
        mib: u64,
    },
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.cmd {
        None => net::compare(
            &RunOpts {
                sizes: None,
                duration: 2.0,
                json: false,
                plot: None,
                tests: "both".into(),
            },
            None,
            0,
        ),
        Some(Cmd::Compare { run, only, load }) => net::compare(&run, only, load),
        Some(Cmd::Burn { threads }) => net::burn(threads),
        Some(Cmd::Server { addr, print_addr }) => net::server(&addr, print_addr),
        Some(Cmd::Client { addr, run, mode }) => net::client(&addr, &run, &mode),
        Some(Cmd::Engine { mib }) => {
            engine::run(mib);
            Ok(())
        }
    };
    if let Err(e) = r {
        eprintln!("sdp-bench: {e}");
        std::process::exit(1);
    }
}
