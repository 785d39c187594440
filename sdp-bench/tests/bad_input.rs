//! `sdp-bench` with bad arguments: the built binary must refuse them at once, with a message that
//! names the flag and what it accepts, before a server starts or a row is measured.
//!
//! The other arguments keep a run short (kernel TCP only, one small size, stream only) so that
//! a binary without these checks fails the tests quickly instead of benchmarking for minutes.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// How long a refused run may take: parsing the command line and no more.
const QUICK: Duration = Duration::from_millis(1000);

struct Refused {
    stderr: String,
}

/// Run `sdp-bench ARGS` and check that it is refused by the command line parser: exit status 2,
/// nothing on stdout, no sign of a benchmark on stderr, well under a second.
fn refused(args: &[&str]) -> Refused {
    let t0 = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_sdp-bench"))
        .args(args)
        .output()
        .expect("run sdp-bench");
    let took = t0.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let what = format!(
        "sdp-bench {args:?}\nstatus {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    assert_eq!(out.status.code(), Some(2), "not a usage error: {what}");
    assert!(
        stdout.is_empty(),
        "results of a run that should not start: {what}"
    );
    assert!(
        !stderr.contains("sdp-bench compare: server") && !stderr.contains("[1/"),
        "a benchmark started: {what}"
    );
    assert!(!stderr.contains("panicked"), "{what}");
    assert!(took < QUICK, "took {took:?}: {what}");
    Refused { stderr }
}

impl Refused {
    /// The message names the flag (or argument) and says `all` of these.
    fn says(&self, flag: &str, all: &[&str]) -> &Self {
        assert!(
            self.stderr.contains(&format!("for '{flag}")),
            "the message does not name {flag}:\n{}",
            self.stderr
        );
        for s in all {
            assert!(self.stderr.contains(s), "no {s:?} in:\n{}", self.stderr);
        }
        self
    }
}

const SHORT: [&str; 4] = ["--only", "tcp", "--tests", "stream"];

fn compare(extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = ["compare"]
        .iter()
        .chain(&SHORT)
        .map(|s| s.to_string())
        .collect();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn refused_compare(extra: &[&str]) -> Refused {
    let args = compare(extra);
    refused(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

#[test]
fn infinite_and_huge_durations_are_refused() {
    for d in ["inf", "1e30", "86401"] {
        refused_compare(&["--sizes", "64", "--duration", d]).says(
            "--duration",
            &["out of range", "more than 0", "86400 (1 day)"],
        );
        refused(&["client", "127.0.0.1:1", "--duration", d])
            .says("--duration", &["out of range", "86400"]);
    }
}

#[test]
fn zero_negative_and_nan_durations_are_refused() {
    for args in [
        &["--duration=-1"][..],
        &["--duration", "-1"],
        &["--duration", "0"],
        &["--duration", "nan"],
    ] {
        let mut a = vec!["--sizes", "64"];
        a.extend_from_slice(args);
        refused_compare(&a).says("--duration", &["more than 0", "86400"]);
    }
    refused_compare(&["--sizes", "64", "--duration", "2s"])
        .says("--duration", &["not a number", "86400"]);
}

#[test]
fn sizes_over_the_server_limit_are_refused_naming_it() {
    for s in ["65m", "64,67108865", "1g"] {
        refused_compare(&["--duration", "0.05", "--sizes", s])
            .says("--sizes", &["64M (67108864 bytes)", "largest"]);
    }
    refused(&["client", "127.0.0.1:1", "--sizes", "100m"]).says("--sizes", &["64M"]);
}

#[test]
fn zero_and_unparsable_sizes_are_refused() {
    refused_compare(&["--duration", "0.05", "--sizes", "0"])
        .says("--sizes", &["at least 1 byte", "64M"]);
    for s in ["abc", "1.5k", "-1", "64,,1k"] {
        refused_compare(&["--duration", "0.05", "--sizes", s])
            .says("--sizes", &["is not a size", "k, m or g", "64M"]);
    }
}

fn scratch(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("bad-input-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn an_unwritable_plot_path_is_refused_before_the_run() {
    let d = scratch("plot");
    let missing = d.join("no-such-dir").join("x.svg");
    let r = refused_compare(&[
        "--duration",
        "0.05",
        "--sizes",
        "64",
        "--plot",
        missing.to_str().unwrap(),
    ]);
    r.says("--plot", &["no-such-dir", "does not exist"]);
    refused_compare(&[
        "--duration",
        "0.05",
        "--sizes",
        "64",
        "--plot",
        d.to_str().unwrap(),
    ])
    .says("--plot", &["is a directory"]);
    refused(&["client", "127.0.0.1:1", "--plot", missing.to_str().unwrap()])
        .says("--plot", &["does not exist"]);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_client_address_without_a_port_says_so() {
    for (addr, example) in [
        ("localhost", "localhost:7471"),
        ("127.0.0.1", "127.0.0.1:7471"),
    ] {
        refused(&[
            "client",
            addr,
            "--duration",
            "0.05",
            "--sizes",
            "64",
            "--mode",
            "tcp",
        ])
        .says(
            "<HOST:PORT>",
            &["has no port", example, "7471 is the server's default port"],
        );
    }
    refused(&["client", "localhost:http"]).says("<HOST:PORT>", &["bad port", "65535"]);
}

#[test]
fn a_server_address_without_a_port_says_so() {
    refused(&["server", "0.0.0.0"]).says("[HOST:PORT]", &["has no port", "0.0.0.0:7471"]);
}

#[test]
fn an_unknown_test_kind_is_refused() {
    refused(&[
        "compare",
        "--only",
        "tcp",
        "--sizes",
        "64",
        "--duration",
        "0.05",
        "--tests",
        "streem",
    ])
    .says("--tests", &["stream", "pingpong", "both"]);
}
