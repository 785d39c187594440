//! Send completions: what each posted send-queue work request was, and what its completion
//! frees or finishes.

use super::Conn;
use crate::proto::buff::BufStore;
use crate::proto::tx::Inflight;
use crate::proto::Instant;
use crate::verbs::{Completion, WcStatus};

impl<S: BufStore> Conn<S> {
    pub(super) fn on_send_completion(&mut self, now: Instant, idx: usize, wc: &Completion) {
        let Some(inf) = self.tx.complete(idx) else {
            return;
        };
        // Whether the work request carried stream bytes of ours (lost if it failed).
        let stream = match inf {
            Inflight::Msg { buf, ctrl, data } => {
                if ctrl {
                    self.tx.put_ctrl_buf(&mut self.store, buf);
                } else {
                    self.tx.put_data_buf(&mut self.store, buf);
                    self.tx.data_completed();
                    self.tx.bytes_out(data as usize);
                }
                !ctrl && data > 0
            }
            Inflight::WriteData { buf, data } => {
                self.tx.put_data_buf(&mut self.store, buf);
                self.tx.bytes_out(data as usize);
                true
            }
            Inflight::WriteSrc { key, len } => {
                self.tx.bytes_out(len as usize);
                self.src_written(now, key, len, wc.status == WcStatus::Success);
                true
            }
            Inflight::Inline { hdr, len } => {
                self.tx.put_ctrl_buf(&mut self.store, hdr);
                self.tx.data_completed();
                self.tx.bytes_out(len as usize);
                true
            }
            Inflight::SendSrc { hdr, key, len } => {
                self.tx.put_ctrl_buf(&mut self.store, hdr);
                self.tx.data_completed();
                self.tx.bytes_out(len as usize);
                self.src_written(now, key, len, wc.status == WcStatus::Success);
                true
            }
            other @ (Inflight::Read(_) | Inflight::Keepalive) => {
                // Posted under another work request kind; never happens, but keep the memory.
                other.release(&mut self.store);
                return;
            }
        };
        if wc.status != WcStatus::Success {
            self.on_wc_error_lost(now, wc.status, stream);
        }
    }
}
