//! Shared application fds: when an [`AppStream`](super::app::AppStream)'s fd is shared with
//! another process (fork), the stream's bytes flow through the kernel file itself, so every
//! process holding the fd reads and writes it natively, as with a TCP socket. The runtime of
//! the process that owns the SDP connection pumps: what arrives over SDP is written into its end
//! of the pair, what the applications write into the file is sent over SDP. The connection ends
//! when the last holder of the file (in any process) closes it. Correct, not fast: every byte
//! crosses the kernel twice more.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use crate::driver::Driver;
use crate::proto::conn::CallError;
use crate::proto::table::ConnId;
use crate::proto::{Instant, Shutdown};
use crate::sys;
use crate::verbs::Provider;

const CHUNK: usize = 64 * 1024;

/// A stream's pump (see the module docs).
#[derive(Debug)]
pub(crate) struct Pump {
    ours: Option<OwnedFd>,
    /// Received over SDP, not yet written into the file.
    out: Vec<u8>,
    out_off: usize,
    /// Written by the applications, not yet sent over SDP.
    inb: Vec<u8>,
    in_off: usize,
    /// SDP's end of stream was passed on (our end's write half shut).
    eof_out: bool,
    /// The applications shut their write half (or closed): SDP's write half was shut.
    eof_in: bool,
    /// Every holder of the file closed it.
    pub(crate) hup: bool,
    /// The owning process let go of its handle too.
    pub(crate) released: bool,
    /// The SDP connection was closed after `hup`.
    pub(crate) closed: bool,
}

impl Pump {
    /// Start pumping on `ours`; `eof_out` if SDP's end of stream was already shown on the file.
    pub(crate) fn new(ours: OwnedFd, eof_out: bool) -> Pump {
        // Room for real data in both directions.
        let _ = sys::setsockopt_int(ours.as_raw_fd(), libc::SOL_SOCKET, libc::SO_SNDBUF, 1 << 20);
        let _ = sys::setsockopt_int(ours.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVBUF, 1 << 20);
        Pump {
            ours: Some(ours),
            out: Vec::new(),
            out_off: 0,
            inb: Vec::new(),
            in_off: 0,
            eof_out,
            eof_in: false,
            hup: false,
            released: false,
            closed: false,
        }
    }

    pub(crate) fn fd(&self) -> Option<std::os::fd::RawFd> {
        self.ours.as_ref().map(|o| o.as_raw_fd())
    }

    /// Move what can move without blocking; returns how much happened (0: nothing).
    pub(crate) fn run<P: Provider>(
        &mut self,
        driver: &mut Driver<P>,
        now: Instant,
        id: ConnId,
    ) -> usize {
        let Some(ours) = self.ours.as_ref().map(|o| o.as_raw_fd()) else {
            return 0;
        };
        let mut act = 0;
        if self.eof_out && !self.eof_in && driver.view(id).is_some_and(|c| c.error().is_some()) {
            // Reset after SDP's end of stream was passed on (TCP's RST in CLOSE_WAIT, the
            // peer's answer to bytes after its close): the holders' writes fail from now on
            // (EPIPE, SIGPIPE), as TCP's; their reads stay at EOF.
            let _ = sys::shutdown(ours, libc::SHUT_RD);
        }
        // SDP -> file.
        loop {
            if self.out_off == self.out.len() {
                if self.eof_out {
                    break;
                }
                self.out.resize(CHUNK, 0);
                self.out_off = 0;
                match driver.read(now, id, &mut self.out) {
                    Ok(0) => {
                        self.out.clear();
                        self.eof_out = true;
                        let _ = sys::shutdown(ours, libc::SHUT_WR);
                        act += 1;
                        break;
                    }
                    Ok(n) => self.out.truncate(n),
                    Err(CallError::WouldBlock) => {
                        self.out.clear();
                        break;
                    }
                    Err(_) => {
                        // The connection failed: the holders see the file reset (hung up
                        // first: a peer's dup for direct wakeups may keep our end open), and
                        // the pump is done (nothing more can go either way): it closes as if
                        // every holder had, or a keeper waiting for its pumps would wait for
                        // good.
                        self.out.clear();
                        let _ = sys::shutdown(ours, libc::SHUT_RDWR);
                        self.ours = None;
                        self.inb.clear();
                        self.in_off = 0;
                        self.eof_out = true;
                        self.eof_in = true;
                        self.hup = true;
                        return act + 1;
                    }
                }
            }
            match sys::send_nb(ours, &self.out[self.out_off..]) {
                Ok(0) => break,
                Ok(n) => {
                    self.out_off += n;
                    act += 1;
                }
                Err(_) => break,
            }
        }
        // File -> SDP.
        loop {
            if self.in_off == self.inb.len() {
                if self.eof_in {
                    break;
                }
                self.inb.resize(CHUNK, 0);
                self.in_off = 0;
                match recv_or_eof(ours, &mut self.inb) {
                    Ok(Some(0)) => {
                        self.inb.clear();
                        self.eof_in = true;
                        let _ = driver.shutdown(now, id, Shutdown::Write);
                        act += 1;
                        break;
                    }
                    Ok(Some(n)) => self.inb.truncate(n),
                    Ok(None) | Err(_) => {
                        self.inb.clear();
                        break;
                    }
                }
            }
            match driver.write(now, id, &self.inb[self.in_off..]) {
                Ok(n) => {
                    self.in_off += n;
                    act += 1;
                }
                Err(CallError::WouldBlock) => break,
                Err(_) => {
                    // The connection takes nothing more: neither does the file (the holders'
                    // writes fail, as TCP's after a reset).
                    self.in_off = self.inb.len();
                    let _ = sys::shutdown(ours, libc::SHUT_RD);
                    break;
                }
            }
        }
        if self.eof_in
            && !self.hup
            && sys::poll_now(ours, 0).is_ok_and(|ev| ev & libc::POLLHUP != 0)
        {
            self.hup = true;
            act += 1;
        }
        act
    }

    /// The connection is closed (every holder closed the file): our end goes too. Polled, a
    /// file every holder closed says POLLHUP at once, every time: while the owner still holds
    /// the stream (its fd closed behind the shim's back: `fclose` of an `fdopen`ed socket), the
    /// progress thread would spin on it.
    pub(crate) fn finish(&mut self) {
        self.ours = None;
    }

    /// POLLOUT when received bytes wait for room in the file.
    pub(crate) fn wants_out(&self) -> i16 {
        if self.out_off < self.out.len() {
            libc::POLLOUT
        } else {
            0
        }
    }

    /// Nothing is left to send over SDP.
    pub(crate) fn drained(&self) -> bool {
        self.in_off == self.inb.len()
    }
}

/// Receive without blocking: `Some(0)` at EOF, `None` when nothing is there.
fn recv_or_eof(fd: std::os::fd::RawFd, buf: &mut [u8]) -> io::Result<Option<usize>> {
    sys::recv_nb_eof(fd, buf)
}
