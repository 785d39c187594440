//! Send completions: what each posted send-queue work request was, and what its completion
//! frees or finishes.

use super::buff::{Buf, BufStore};
use super::conn::Conn;
use super::Instant;
use crate::verbs::{Completion, WcStatus};

/// A send-queue work request in flight (SEND, RDMA Write, RDMA Read or keepalive).
#[derive(Debug)]
pub(crate) enum Inflight {
    /// A SEND from a send buffer (`ctrl`: from the control pool); `data` payload bytes.
    Msg { buf: Buf, ctrl: bool, data: u32 },
    /// RDMA Write of queued bytes from a send buffer into the peer's sink.
    WriteData { buf: Buf, data: u32 },
    /// RDMA Write of part of a zero-copy source into the peer's sink.
    WriteSrc { key: u64, len: u32 },
    /// A Data message: header from a control buffer, `len` payload bytes gathered from a
    /// zero-copy source.
    SendSrc { hdr: Buf, key: u64, len: u32 },
    /// RDMA Read of a peer's source: into a bounce buffer, or into the application's sink.
    Read(super::read::ReadReq),
    /// Zero-byte RDMA Write keepalive probe.
    Keepalive,
}

impl Inflight {
    pub(crate) fn release(self, store: &mut impl BufStore) {
        match self {
            Inflight::Msg { buf, .. }
            | Inflight::WriteData { buf, .. }
            | Inflight::SendSrc { hdr: buf, .. } => store.free(buf),
            Inflight::Read(r) => {
                if let Some(b) = r.bounce {
                    store.free(b);
                }
            }
            Inflight::WriteSrc { .. } | Inflight::Keepalive => {}
        }
    }
}

impl<S: BufStore> Conn<S> {
    pub(crate) fn on_send_completion(&mut self, now: Instant, idx: usize, wc: &Completion) {
        let Some(inf) = self.tx_inflight.try_remove(idx) else {
            return;
        };
        match inf {
            Inflight::Msg { buf, ctrl, data } => {
                if ctrl {
                    self.ctrl_pool.put(&mut self.store, buf);
                } else {
                    self.tx_pool.put(&mut self.store, buf);
                    self.tx_data_outstanding -= 1;
                    self.tx_bytes -= data as usize;
                    self.wake_writer();
                }
            }
            Inflight::WriteData { buf, data } => {
                self.tx_pool.put(&mut self.store, buf);
                self.tx_bytes -= data as usize;
                self.wake_writer();
            }
            Inflight::WriteSrc { key, len } => {
                self.tx_bytes -= len as usize;
                self.src_written(now, key, len, wc.status == WcStatus::Success);
            }
            Inflight::SendSrc { hdr, key, len } => {
                self.ctrl_pool.put(&mut self.store, hdr);
                self.tx_data_outstanding -= 1;
                self.tx_bytes -= len as usize;
                self.src_written(now, key, len, wc.status == WcStatus::Success);
            }
            other @ (Inflight::Read(_) | Inflight::Keepalive) => {
                // Posted under another work request kind; never happens, but keep the memory.
                other.release(&mut self.store);
                return;
            }
        }
        if wc.status != WcStatus::Success {
            self.on_wc_error(now, wc.status);
        }
    }
}
