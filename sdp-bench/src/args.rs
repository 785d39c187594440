//! Checks of the command line, run by clap while it parses (so every bad value is reported,
//! naming its flag, before a server starts or a byte moves).

use std::fs::OpenOptions;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

/// The largest message size the server accepts (`net::serve` refuses larger ones, and the wire
/// header carries sizes as 32 bits).
pub const MAX_SIZE: usize = 64 << 20;
/// The port `sdp-bench server` listens on unless told otherwise.
pub const DEFAULT_PORT: u16 = 7471;
/// `sdp-bench server`'s default address (must end in `DEFAULT_PORT`; a unit test checks).
pub const DEFAULT_SERVER_ADDR: &str = "0.0.0.0:7471";
/// The longest `--duration`: one day.
pub const MAX_DURATION_SECS: f64 = 86_400.0;

/// "64M (67108864 bytes)".
fn max_size_name() -> String {
    format!("{}M ({MAX_SIZE} bytes)", MAX_SIZE >> 20)
}

fn size_range() -> String {
    format!("sizes are 1 to {}, e.g. 64, 64k, 1m", max_size_name())
}

/// "64", "64k", "1m", "4M" → bytes, 1 to `MAX_SIZE`.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mul) = match s.char_indices().last() {
        Some((i, 'k' | 'K')) => (&s[..i], 1 << 10),
        Some((i, 'm' | 'M')) => (&s[..i], 1 << 20),
        Some((i, 'g' | 'G')) => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    let num = num.trim();
    if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "{s:?} is not a size: expected a whole number of bytes with an optional k, m or g \
             suffix; {}",
            size_range()
        ));
    }
    // All digits: the parse fails only on overflow, which is over the limit too.
    let n = num
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .unwrap_or(usize::MAX);
    if n == 0 {
        return Err(format!("size must be at least 1 byte; {}", size_range()));
    }
    if n > MAX_SIZE {
        return Err(format!(
            "size {s} is over {}, the largest message the sdp-bench server accepts",
            max_size_name()
        ));
    }
    Ok(n)
}

/// The most CPU-bound threads `--load` starts.
pub const MAX_LOAD: usize = 1024;

/// `--load N`: 0 (a quiet host, the default) to `MAX_LOAD` CPU-bound threads.
pub fn parse_load(s: &str) -> Result<usize, String> {
    s.trim()
        .parse::<usize>()
        .ok()
        .filter(|&n| n <= MAX_LOAD)
        .ok_or_else(|| format!("{s:?}: --load is a number of threads, 0 to {MAX_LOAD}"))
}

/// Seconds per row: a finite number above 0 and at most `MAX_DURATION_SECS`.
pub fn parse_duration(s: &str) -> Result<f64, String> {
    const RANGE: &str = "seconds per row must be more than 0 and at most 86400 (1 day)";
    let d: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number; {RANGE}"))?;
    if !d.is_finite() || d <= 0.0 || d > MAX_DURATION_SECS {
        return Err(format!("{s} is out of range; {RANGE}"));
    }
    Ok(d)
}

/// A `--plot` file: it must be writable now, so that a finished run is not thrown away for want
/// of a place to put its chart. An existing file is opened for writing (and left as it is); a new
/// one is created and removed again.
pub fn parse_plot_path(s: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(s);
    if s.is_empty() {
        return Err("the plot path is empty".into());
    }
    if path.is_dir() {
        return Err(format!("{s} is a directory, not a file"));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.exists() {
        return Err(format!("directory {} does not exist", dir.display()));
    }
    if !dir.is_dir() {
        return Err(format!("{} is not a directory", dir.display()));
    }
    if path.exists() {
        OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(|e| format!("cannot write {s}: {e}"))?;
    } else {
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| format!("cannot create {s}: {e}"))?;
        let _ = std::fs::remove_file(&path);
    }
    Ok(path)
}

/// A server address to connect to: HOST:PORT, the port 1 to 65535.
pub fn parse_client_addr(s: &str) -> Result<String, String> {
    if port_of(s)? == 0 {
        return Err(format!(
            "port 0 in {s:?}: the port must be 1 to 65535 (the server's default is {DEFAULT_PORT})"
        ));
    }
    Ok(s.to_string())
}

/// An address to listen on: HOST:PORT (port 0: any free port).
pub fn parse_server_addr(s: &str) -> Result<String, String> {
    port_of(s)?;
    Ok(s.to_string())
}

/// The port of `s` as HOST:PORT (IPv6 hosts in brackets), or an error that says what is
/// missing. The host is not resolved here.
fn port_of(s: &str) -> Result<u16, String> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a.port());
    }
    let missing_port = |host: &str| {
        format!(
            "{s:?} has no port: give HOST:PORT, e.g. {host}:{DEFAULT_PORT} ({DEFAULT_PORT} is \
             the server's default port)"
        )
    };
    if s.is_empty() {
        return Err(format!(
            "the address is empty: give HOST:PORT, e.g. 127.0.0.1:{DEFAULT_PORT}"
        ));
    }
    match s.parse::<IpAddr>() {
        Ok(IpAddr::V6(_)) => return Err(missing_port(&format!("[{s}]"))),
        Ok(IpAddr::V4(_)) => return Err(missing_port(s)),
        Err(_) => {}
    }
    if s.starts_with('[') && s.ends_with(']') {
        return Err(missing_port(s));
    }
    let Some((host, port)) = s.rsplit_once(':') else {
        return Err(missing_port(s));
    };
    if host.is_empty() {
        return Err(format!(
            "{s:?} has no host: give HOST:PORT, e.g. 127.0.0.1{s}"
        ));
    }
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        return Err(format!(
            "{s:?}: an IPv6 address goes in brackets, e.g. [::1]:{DEFAULT_PORT}"
        ));
    }
    if port.is_empty() {
        return Err(missing_port(host));
    }
    port.parse::<u16>()
        .map_err(|_| format!("bad port {port:?} in {s:?}: a port is a number from 1 to 65535"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_is_a_bounded_thread_count() {
        assert_eq!(parse_load("0"), Ok(0));
        assert_eq!(parse_load("2"), Ok(2));
        assert_eq!(parse_load(&MAX_LOAD.to_string()), Ok(MAX_LOAD));
        for bad in ["-1", "x", "", "1.5", "1025"] {
            let e = parse_load(bad).unwrap_err();
            assert!(e.contains("0 to 1024"), "{bad}: {e}");
        }
    }

    #[test]
    fn sizes_up_to_the_server_limit_only() {
        assert_eq!(parse_size("64"), Ok(64));
        assert_eq!(parse_size("64k"), Ok(64 << 10));
        assert_eq!(parse_size(" 1M "), Ok(1 << 20));
        assert_eq!(parse_size("64m"), Ok(MAX_SIZE));
        assert_eq!(parse_size("67108864"), Ok(MAX_SIZE));
        for s in [
            "65m",
            "67108865",
            "1g",
            "16G",
            "99999999999999999999999",
            "18446744073709551615k",
        ] {
            let e = parse_size(s).expect_err(s);
            assert!(e.contains("64M") && e.contains("largest"), "{s}: {e}");
        }
    }

    #[test]
    fn zero_and_unparsable_sizes_are_refused() {
        let e = parse_size("0").unwrap_err();
        assert!(e.contains("at least 1 byte"), "{e}");
        assert!(parse_size("0k").unwrap_err().contains("at least 1 byte"));
        for s in ["", "k", "abc", "1.5k", "-1", "+5", "1x", "1kb", "1 2"] {
            let e = parse_size(s).expect_err(s);
            assert!(e.contains("is not a size") && e.contains("64M"), "{s}: {e}");
        }
    }

    #[test]
    fn durations_above_0_up_to_a_day_only() {
        assert_eq!(parse_duration("2"), Ok(2.0));
        assert_eq!(parse_duration("0.05"), Ok(0.05));
        assert_eq!(parse_duration("1e-3"), Ok(0.001));
        assert_eq!(parse_duration("86400"), Ok(86400.0));
        for s in [
            "inf", "-inf", "infinity", "nan", "NaN", "1e30", "86400.5", "0", "-0", "-1", "0.0",
        ] {
            let e = parse_duration(s).expect_err(s);
            assert!(
                e.contains("out of range") && e.contains("86400"),
                "{s}: {e}"
            );
        }
        for s in ["", "two", "1s", "1,5"] {
            let e = parse_duration(s).expect_err(s);
            assert!(
                e.contains("not a number") && e.contains("86400"),
                "{s}: {e}"
            );
        }
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("sdp-bench-args-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn plot_path_must_be_writable_and_is_left_alone() {
        let d = scratch("plot");
        let new = d.join("new.svg");
        assert_eq!(parse_plot_path(new.to_str().unwrap()), Ok(new.clone()));
        assert!(!new.exists(), "the probe file is removed again");
        let old = d.join("old.svg");
        std::fs::write(&old, "keep").unwrap();
        assert_eq!(parse_plot_path(old.to_str().unwrap()), Ok(old.clone()));
        assert_eq!(std::fs::read_to_string(&old).unwrap(), "keep");

        let missing = d.join("no-such-dir").join("x.svg");
        let e = parse_plot_path(missing.to_str().unwrap()).unwrap_err();
        assert!(
            e.contains("does not exist") && e.contains("no-such-dir"),
            "{e}"
        );
        let e = parse_plot_path(d.to_str().unwrap()).unwrap_err();
        assert!(e.contains("is a directory"), "{e}");
        let file = d.join("file");
        std::fs::write(&file, "").unwrap();
        let e = parse_plot_path(file.join("x.svg").to_str().unwrap()).unwrap_err();
        assert!(e.contains("is not a directory"), "{e}");
        assert!(parse_plot_path("").unwrap_err().contains("empty"));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn host_port_is_accepted_and_a_missing_port_named_with_the_default_port() {
        for s in [
            "127.0.0.1:7471",
            "localhost:7471",
            "bench-host.example:1",
            "[::1]:7471",
        ] {
            assert_eq!(parse_client_addr(s), Ok(s.to_string()));
        }
        assert_eq!(parse_server_addr("127.0.0.1:0"), Ok("127.0.0.1:0".into()));
        assert_eq!(
            parse_server_addr(DEFAULT_SERVER_ADDR),
            Ok(DEFAULT_SERVER_ADDR.into())
        );
        assert!(DEFAULT_SERVER_ADDR.ends_with(&format!(":{DEFAULT_PORT}")));
        for (s, example) in [
            ("localhost", "localhost:7471"),
            ("10.0.0.2", "10.0.0.2:7471"),
            ("10.0.0.2:", "10.0.0.2:7471"),
            ("::1", "[::1]:7471"),
            ("[::1]", "[::1]:7471"),
        ] {
            for e in [parse_client_addr(s), parse_server_addr(s)] {
                let e = e.unwrap_err();
                assert!(e.contains("has no port") && e.contains(example), "{s}: {e}");
                assert!(e.contains("7471 is the server's default port"), "{s}: {e}");
            }
        }
    }

    #[test]
    fn other_bad_addresses_say_what_is_wrong() {
        assert!(parse_client_addr("").unwrap_err().contains("empty"));
        assert!(parse_client_addr(":7471").unwrap_err().contains("no host"));
        assert!(parse_client_addr("host:http")
            .unwrap_err()
            .contains("bad port"));
        assert!(parse_client_addr("host:70000")
            .unwrap_err()
            .contains("bad port"));
        assert!(parse_client_addr("fe80::1%eth0:7471")
            .unwrap_err()
            .contains("brackets"));
        assert!(parse_client_addr("host:0").unwrap_err().contains("port 0"));
    }
}
