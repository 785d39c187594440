//! Sockets Direct Protocol (SDP) over RDMA reliable connections, in user space.
//!
//! Start with [`socket`]: [`SdpStream`] and [`SdpListener`] are shaped like `std::net`'s
//! `TcpStream` and `TcpListener`, run over SDP where the peer speaks it (shared memory between
//! processes of one host, or an RDMA device) and fall back to kernel TCP elsewhere; [`Options`]
//! chooses the transport, the source address and the backlog.
//!
//! ```no_run
//! use std::io::Write;
//! use sdp_core::{SdpListener, SdpStream};
//!
//! let listener = SdpListener::bind("127.0.0.1:0")?; // SDP and kernel TCP clients, one port
//! let mut s = SdpStream::connect(listener.local_addr()?)?;
//! println!("over {}", s.transport()); // shm, rdma or tcp
//! s.write_all(b"hello")?;
//! # Ok::<(), std::io::Error>(())
//! ```
//!
//! The layers below, for those who embed the engine or add a provider:
//!
//! * [`driver`]: runs engines over a provider: posts their work requests, feeds them completions
//!   and CM events.
//! * [`proto`]: the SDP engine, sans-IO (no syscalls, no clock): wire messages, connection state
//!   machine, credits, buffer pool, zero-copy advertisements.
//! * [`verbs`]: the provider layer (device, PD, MR, QP, CQ, CM) and its providers.

pub mod driver;
#[cfg(feature = "harness")]
#[doc(hidden)]
pub mod harness;
pub mod proto;
pub mod socket;
mod sys;
pub mod verbs;

pub use socket::{Choice, Options, SdpListener, SdpStream, Transport};
