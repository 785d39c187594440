//! Cross-crate integration tests. The harness they use (Pair over the simulated fabric, App
//! stand-ins) lives in `sdp_core::harness` (feature `harness`), shared with sdp-core's own tests
//! and benches and `sdp-bench engine`; re-exported here under its old paths.

pub use sdp_core::harness::{pair, stream};
