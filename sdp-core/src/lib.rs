//! Sockets Direct Protocol (SDP) over RDMA reliable connections, in user space.
//!
//! * [`proto`]: the SDP engine, sans-IO (no syscalls, no clock): wire messages, connection state
//!   machine, credits, buffer pool, zero-copy advertisements.
//! * [`verbs`]: the provider layer (device, PD, MR, QP, CQ, CM) and its providers.
//! * [`driver`]: runs engines over a provider: posts their work requests, feeds them completions
//!   and CM events.

pub mod driver;
pub mod proto;
pub mod socket;
pub mod verbs;
