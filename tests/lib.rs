//! Cross-crate integration tests. The harness they use (Pair over the simulated fabric, App
//! stand-ins) lives in `sdp_core::harness` (feature `harness`), shared with sdp-core's own tests
//! and benches and `sdp-bench engine`; re-exported here under its old paths.

pub use sdp_core::harness::{pair, stream};

/// Voluntary and involuntary context switches of this process so far (every thread): the
/// benchmark tools' per-exchange figures (`sdp-rigtest`, `sdp-peer`).
pub fn context_switches() -> (i64, i64) {
    // SAFETY: getrusage fills the rusage struct we pass; an all-zero rusage is a valid value.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    (ru.ru_nvcsw, ru.ru_nivcsw)
}
