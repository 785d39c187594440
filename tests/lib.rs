//! Cross-crate test support: the [`pair::Pair`] harness (two SDP engines over the simulated
//! fabric, in virtual time) and stream helpers that generate and check random data.

pub mod pair;
pub mod stream;
