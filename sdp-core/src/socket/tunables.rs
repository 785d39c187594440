//! The socket layer's environment knobs, read once, the first time any is needed: a program
//! may clear or change its environment after starting (nginx clears it), and a large write
//! should not look its knob up again (`std::env::var` locks the environment and allocates).
//!
//! | variable | field | default |
//! |---|---|---|
//! | `SDP_PROVIDERS` | [`Tunables::providers`] | `shm,rdma` |
//! | `SDP_SPIN_US` | [`Tunables::spin`] | adaptive (50-500 µs) |
//! | `SDP_ZCOPY_MIN` | [`Tunables::zcopy_min`] | 128 KiB over shm, 1 MiB over RDMA |
//! | `SDP_ZCOPY_STALL_US` | [`Tunables::zcopy_stall`] | 2 ms + the time of a slow copy |
//! | `SDP_EXIT_LINGER_MS` | [`Tunables::exit_linger`] | 10 s |
//! | `SDP_STAT` | [`Tunables::stat`] | on (`0` turns it off) |
//! | `SDP_DIRECT_WAKE` | [`Tunables::direct_wake`] | on (`0` turns it off) |
//! | `SDP_TRACE` | [`Tunables::trace`] | off (`1` turns it on) |
//! | `SDP_ZCOPY_SPLIT` | [`Tunables::zcopy_split`] | the provider's choice (`0` off, `1` on) |
//! | `SDP_SHORT_CONNS` | [`Tunables::short_conns`] | 8 (`0` off) |
//! | `SDP_INLINE` | [`Tunables::inline_sends`] | on (`0` turns it off) |

use std::sync::OnceLock;
use std::time::Duration;

/// See the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Tunables {
    /// `SDP_PROVIDERS`: the providers automatic choice tries, in order (a comma list of `shm`
    /// and `rdma`; `socket::stack`).
    pub providers: String,
    /// `SDP_SPIN_US`: a fixed time a blocking call polls by itself before it sleeps; `None`:
    /// adaptive (`socket::runtime`, `AdaptiveSpin`).
    pub spin: Option<Duration>,
    /// `SDP_ZCOPY_MIN` (bytes, `k`/`m` suffixes): plain blocking writes at least this big go by
    /// zero copy; `None`: the provider's default.
    pub zcopy_min: Option<usize>,
    /// `SDP_ZCOPY_STALL_US`: how long a plain zero-copy write waits for the peer to take (more
    /// of) it before the rest goes by copy; `None`: 2 ms plus the time of a slow copy.
    pub zcopy_stall: Option<Duration>,
    /// `SDP_EXIT_LINGER_MS`: how long an exiting process waits for its connections to deliver
    /// what was written (`socket::exit`).
    pub exit_linger: Duration,
    /// `SDP_STAT`: each stack answers `sdpstat` (`0` turns it off; `socket::stat`).
    pub stat: bool,
    /// `SDP_DIRECT_WAKE`: an application fd's peer (over shm) wakes its reader straight, not
    /// through this process's progress thread (`0` turns it off; `socket::ready::AppReady`).
    pub direct_wake: bool,
    /// `SDP_TRACE=1`: a line on stderr for each connection that ends with an error: the
    /// error, where the engine decided it, and the engine's state (`driver`).
    pub trace: bool,
    /// `SDP_ZCOPY_SPLIT`: split zero copy over RDMA (`Config::zcopy_split`) on (`1`) or off
    /// (`0`: every zero-copy source goes by gathered SENDs where the device prefers them, no
    /// RDMA Read); `None`: the provider's choice.
    pub zcopy_split: Option<bool>,
    /// `SDP_SHORT_CONNS`: short connections in a row to one destination after which an
    /// automatic connect goes there by kernel TCP for a while (`0`: never; `socket::history`).
    pub short_conns: u32,
    /// `SDP_INLINE`: writes that go at once go as inline SENDs (`Config::inline_sends`; `0`
    /// turns it off).
    pub inline_sends: bool,
}

/// Short connections in a row that hold a destination on kernel TCP without `SDP_SHORT_CONNS`.
pub const DEFAULT_SHORT_CONNS: u32 = 8;

/// The exit linger without `SDP_EXIT_LINGER_MS`.
pub const DEFAULT_EXIT_LINGER: Duration = Duration::from_secs(10);

impl Tunables {
    /// The knobs from `get` (a variable's value, if set).
    pub(crate) fn from_fn(get: impl Fn(&str) -> Option<String>) -> Tunables {
        let num = |name: &str| get(name).and_then(|v| v.trim().parse::<u64>().ok());
        Tunables {
            providers: get("SDP_PROVIDERS").unwrap_or_else(|| "shm,rdma".into()),
            spin: num("SDP_SPIN_US").map(Duration::from_micros),
            zcopy_min: get("SDP_ZCOPY_MIN").and_then(|v| parse_size(&v)),
            zcopy_stall: num("SDP_ZCOPY_STALL_US").map(Duration::from_micros),
            exit_linger: num("SDP_EXIT_LINGER_MS")
                .map_or(DEFAULT_EXIT_LINGER, Duration::from_millis),
            stat: get("SDP_STAT").is_none_or(|v| v != "0"),
            direct_wake: get("SDP_DIRECT_WAKE").is_none_or(|v| v != "0"),
            trace: get("SDP_TRACE").is_some_and(|v| v.trim() == "1"),
            zcopy_split: match get("SDP_ZCOPY_SPLIT").as_deref().map(str::trim) {
                Some("0") => Some(false),
                Some("1") => Some(true),
                _ => None,
            },
            short_conns: num("SDP_SHORT_CONNS")
                .map_or(DEFAULT_SHORT_CONNS, |n| n.min(u32::MAX.into()) as u32),
            inline_sends: get("SDP_INLINE").is_none_or(|v| v.trim() != "0"),
        }
    }
}

/// The process's knobs, read from its environment the first time.
pub(crate) fn tunables() -> &'static Tunables {
    static T: OnceLock<Tunables> = OnceLock::new();
    T.get_or_init(|| Tunables::from_fn(|name| std::env::var(name).ok()))
}

/// A byte count: digits with an optional `k`/`m` suffix (binary units).
fn parse_size(v: &str) -> Option<usize> {
    let v = v.trim().to_ascii_lowercase();
    let (num, mul) = match v.as_bytes().last()? {
        b'k' => (&v[..v.len() - 1], 1024),
        b'm' => (&v[..v.len() - 1], 1024 * 1024),
        _ => (&v[..], 1),
    };
    num.parse::<usize>().ok()?.checked_mul(mul)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> Tunables {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Tunables::from_fn(|name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
    }

    #[test]
    fn defaults_without_variables() {
        let t = with(&[]);
        assert_eq!(t.providers, "shm,rdma");
        assert_eq!((t.spin, t.zcopy_min, t.zcopy_stall), (None, None, None));
        assert_eq!(t.exit_linger, DEFAULT_EXIT_LINGER);
        assert!(t.stat);
        assert!(!t.trace);
        assert_eq!(t.zcopy_split, None);
        assert_eq!(t.short_conns, DEFAULT_SHORT_CONNS);
        assert!(t.inline_sends);
    }

    #[test]
    fn each_variable_sets_its_knob_and_bad_values_are_ignored() {
        let t = with(&[
            ("SDP_PROVIDERS", "rdma"),
            ("SDP_SPIN_US", "0"),
            ("SDP_ZCOPY_MIN", "256k"),
            ("SDP_ZCOPY_STALL_US", " 5000 "),
            ("SDP_EXIT_LINGER_MS", "250"),
            ("SDP_STAT", "0"),
            ("SDP_TRACE", "1"),
            ("SDP_ZCOPY_SPLIT", "0"),
            ("SDP_SHORT_CONNS", "0"),
            ("SDP_INLINE", "0"),
        ]);
        assert_eq!(t.providers, "rdma");
        assert_eq!(t.spin, Some(Duration::ZERO));
        assert_eq!(t.zcopy_min, Some(256 * 1024));
        assert_eq!(t.zcopy_stall, Some(Duration::from_millis(5)));
        assert_eq!(t.exit_linger, Duration::from_millis(250));
        assert!(!t.stat);
        assert!(t.trace);
        assert_eq!(t.zcopy_split, Some(false));
        assert_eq!(t.short_conns, 0);
        assert!(!t.inline_sends);
        let bad = with(&[
            ("SDP_SPIN_US", "fast"),
            ("SDP_ZCOPY_MIN", "2g"),
            ("SDP_EXIT_LINGER_MS", "-1"),
            ("SDP_STAT", "1"),
            ("SDP_TRACE", "yes"),
            ("SDP_ZCOPY_SPLIT", "maybe"),
            ("SDP_SHORT_CONNS", "few"),
        ]);
        assert_eq!((bad.spin, bad.zcopy_min), (None, None));
        assert_eq!(bad.exit_linger, DEFAULT_EXIT_LINGER);
        assert!(bad.stat);
        assert!(!bad.trace);
        assert_eq!(bad.zcopy_split, None);
        assert_eq!(bad.short_conns, DEFAULT_SHORT_CONNS);
        assert_eq!(parse_size("1M"), Some(1 << 20));
    }
}
