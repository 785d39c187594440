//! Zero copy from and into the application's own buffers (plain reads and writes): caller
//! memory registered for one call, advertised, and let go once the peer is done with it.

use super::*;

/// Register caller memory on the runtime's provider, for the duration of one call.
impl<P: Provider + 'static> Runtime<P> {
    /// Zero-copy send of an application slice: registered for the call, advertised, and
    /// deregistered once the peer has read it. `Ok(None)` if the provider cannot register
    /// caller memory.
    pub(crate) fn write_user_zcopy(&self, id: ConnId, buf: &[u8]) -> io::Result<Option<usize>> {
        let mut mr = {
            let g = self.lock()?;
            let p = g.driver.caller_memory();
            drop(g);
            // SAFETY: `buf` outlives the region: the region is dropped (deregistered) before
            // this function returns, and zcopy_send returns only once the engine reports the
            // transfer finished, cancelled or failed, after which the peer cannot reach it.
            let r = unsafe {
                p.reg_mr_at(
                    NonNull::new(buf.as_ptr() as *mut u8).expect("slice pointer is not null"),
                    buf.len(),
                    Access::empty(),
                )
            };
            match r {
                Ok(mr) => Box::new(mr) as DynMr,
                Err(VerbsError::Invalid(_)) => {
                    self.sh.user_zcopy.store(false, Ordering::Relaxed);
                    return Ok(None);
                }
                Err(e) => return Err(verbs_err(e)),
            }
        };
        // Like TCP's, the write must not wait for the peer's application: zero copy only while
        // the peer takes the bytes, the rest by copy (which blocks only on a full send buffer).
        let sent = self.zcopy_send(
            id,
            &mut mr,
            0,
            buf.len(),
            Some(zcopy_write_stall(buf.len())),
        )?;
        drop(mr);
        if sent < buf.len() {
            self.write_copy(id, &buf[sent..], Wait::default())?;
        }
        Ok(Some(buf.len()))
    }

    /// Whether a plain blocking write of `len` bytes is more than the send buffer takes now,
    /// so it goes by zero copy from the caller's memory. TCP's write returns once its bytes
    /// are in the send buffer, whatever the peer does (stopped by SIGSTOP or a debugger, say),
    /// while a zero-copy source holds the caller until the peer's engine has taken the bytes
    /// or given them back: zero copy only where TCP's write would wait for the peer too. What
    /// fits goes by copy (the engine stages a large write: one copy, then the peer's read).
    pub(super) fn beyond_send_room(&self, id: ConnId, len: usize) -> io::Result<bool> {
        let g = self.lock()?;
        Ok(g.driver.view(id).is_some_and(|c| len > c.send_room()))
    }

    /// Zero-copy receive into an application slice when the next bytes are a peer's
    /// zero-copy source. `Ok(None)`: read by copy.
    pub(crate) fn read_user_zcopy(&self, id: ConnId, buf: &mut [u8]) -> io::Result<Option<usize>> {
        {
            let g = self.lock()?;
            if g.driver.next_is_zcopy(id) != Ok(true) {
                return Ok(None);
            }
        }
        let p = self.lock()?.driver.caller_memory();
        // SAFETY: as in write_user_zcopy: the region is dropped before return, and only after
        // the engine reported the RDMA Read into it finished or failed.
        let r = unsafe {
            p.reg_mr_at(
                NonNull::new(buf.as_mut_ptr()).expect("slice pointer is not null"),
                buf.len(),
                Access::LOCAL_WRITE,
            )
        };
        let mut mr: DynMr = match r {
            Ok(mr) => Box::new(mr),
            Err(VerbsError::Invalid(_)) => {
                self.sh.user_zcopy.store(false, Ordering::Relaxed);
                return Ok(None);
            }
            Err(e) => return Err(verbs_err(e)),
        };
        self.sh.user_zreads.fetch_add(1, Ordering::Relaxed);
        let r = self.zcopy_recv(id, &mut mr, 0, buf.len());
        drop(mr);
        r
    }

    pub(super) fn write_copy(&self, id: ConnId, buf: &[u8], w: Wait) -> io::Result<usize> {
        // Like a blocking TCP send: everything is queued before the call returns, unless the
        // connection fails or the timeout passes after a part went.
        let mut done = 0;
        let r = self.block_on(w, |g, now| {
            if !Self::zsends_settled(g, now, id) {
                return None;
            }
            let r = match g.driver.write(now, id, &buf[done..]) {
                Ok(n) => {
                    done += n;
                    (done == buf.len() || w.nonblocking).then_some(Ok(done))
                }
                Err(CallError::WouldBlock) => None,
                Err(e) if done > 0 => {
                    let _ = e;
                    Some(Ok(done))
                }
                Err(e) => Some(Self::report_once(
                    g,
                    id,
                    e,
                    Err(io::Error::from_raw_os_error(libc::EPIPE)),
                )),
            };
            Self::refresh(g, id);
            r
        });
        match r {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && done > 0 => Ok(done),
            r => r,
        }
    }

    pub(crate) fn zcopy_threshold(&self) -> usize {
        // No lock: a forked child's write on an inherited stream asks before anything checks
        // the process, and the parent's progress thread may have held the lock at fork().
        self.sh.zcopy_threshold
    }

    /// Plain blocking writes at least this big go by zero copy. Each such write costs a
    /// registration and a round trip (the call returns when the peer has the bytes), which a
    /// copy beats for smaller writes: `SDP_ZCOPY_MIN` (bytes, `k`/`m` suffixes), by default
    /// [`USER_ZCOPY_MIN_SHM`] / [`USER_ZCOPY_MIN_RDMA`], never below the engine's threshold.
    pub(crate) fn user_zcopy_min(&self) -> usize {
        let floor = self.zcopy_threshold().max(1);
        let v = crate::socket::tunables::tunables()
            .zcopy_min
            .unwrap_or(match self.sh.name {
                "rdma" => USER_ZCOPY_MIN_RDMA,
                _ => USER_ZCOPY_MIN_SHM,
            });
        v.max(floor)
    }
}

/// How long a plain blocking write sent by zero copy waits for the peer to take (more of) it
/// before the rest goes by copy: [`ZCOPY_STALL`] plus the time a slow copy of `len` bytes takes
/// (at [`STALL_COPY_RATE`]; the peer acknowledges a read when it is done), or
/// `SDP_ZCOPY_STALL_US` if set. A peer that is reading (blocked in `read`, woken by the
/// SrcAvail) starts within microseconds; one that is busy elsewhere (writing to us itself,
/// computing) would hold the writer, which TCP never does once the bytes fit its send buffer.
pub(super) fn zcopy_write_stall(len: usize) -> Duration {
    let fixed = crate::socket::tunables::tunables().zcopy_stall;
    fixed.unwrap_or(ZCOPY_STALL + Duration::from_nanos((len / STALL_COPY_RATE) as u64))
}

/// The least a plain zero-copy write waits for the peer to make progress on it.
pub(super) const ZCOPY_STALL: Duration = Duration::from_millis(2);
/// Bytes per nanosecond a peer is allowed to take for a read before it acknowledges.
pub(super) const STALL_COPY_RATE: usize = 2;

/// Default smallest plain write sent by zero copy over shm (measured crossover, docs/benchmarks.md).
pub(crate) const USER_ZCOPY_MIN_SHM: usize = 128 * 1024;
/// Default smallest plain write sent by zero copy over RDMA (registration is costly there).
pub(crate) const USER_ZCOPY_MIN_RDMA: usize = 1024 * 1024;
