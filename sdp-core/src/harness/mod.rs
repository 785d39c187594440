//! The engine test harness (cargo feature `harness`; not part of the API): two drivers over the
//! simulated fabric in virtual time ([`pair::Pair`]) and application stand-ins that write and
//! check seeded random streams ([`stream::App`], built by named parameters), which check every
//! engine event they take against the rules any connection keeps ([`events::EventCheck`]). The
//! one copy shared by the integration tests (`sdp-tests`, `sdp-core/tests`), the criterion
//! benches (`sdp-core/benches/engine.rs`) and `sdp-bench engine`.

pub mod events;
pub mod pair;
pub mod stream;
