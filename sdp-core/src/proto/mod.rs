//! The SDP engine: sans-IO, no syscalls, no clock (time is passed in).
#![forbid(unsafe_code)]

pub mod msgs;
