//! Zero copy by registered regions: waiting for a transfer's end (polling about as long as
//! the peer takes to copy it), starting sends and receives of granted memory, collecting the
//! engine's zero-copy events, and settling the asynchronous sends of `send_registered_async`
//! (revoking the peer's access, sending by copy what did not go by zero copy).

use super::*;

/// Bytes per nanosecond a peer is assumed to copy a zero-copy transfer at (sizing the poll
/// before a zero-copy wait sleeps).
const COPY_RATE: usize = 8;
/// The longest a zero-copy wait polls before it sleeps.
const MAX_ZCOPY_SPIN: Duration = Duration::from_millis(1);

impl<P: Provider + 'static> Runtime<P> {
    fn zcopy_wait(&self, id: ConnId, token: u64) -> io::Result<usize> {
        self.zcopy_wait_for(id, token, 0)
    }

    /// Wait for the zero-copy transfer `token` of `len` bytes. The peer must copy all of them
    /// before it answers, so the caller polls for about that long (at [`COPY_RATE`]) on top
    /// of the usual spin before it sleeps: a sleep and a wakeup cost more than the wait they
    /// would save, and the reply usually comes within it.
    fn zcopy_wait_for(&self, id: ConnId, token: u64, len: usize) -> io::Result<usize> {
        let copy = Duration::from_nanos((len / COPY_RATE) as u64);
        let w = Wait {
            spin: Some((spin_time() + copy).min(MAX_ZCOPY_SPIN)),
            ..Wait::default()
        };
        // No timeout: the peer may be reading or writing the memory until the engine says it
        // is done, which it always does (finished, cancelled, or the connection failed: every
        // source and sink in flight is reported once).
        self.block_on(w, |g, _| {
            Self::collect_zdone(g, id);
            let Some(s) = g.socks.get_mut(&id) else {
                return Some(Err(io::Error::from_raw_os_error(libc::EBADF)));
            };
            if let Some(i) = s.zdone.iter().position(|&(t, _)| t == token) {
                return Some(Ok(s.zdone.swap_remove(i).1));
            }
            // The engine is gone (closed and released), and its endpoint with it: nothing
            // reaches the memory any more, and no report will come.
            g.driver
                .view(id)
                .is_none()
                .then(|| Err(io::Error::from_raw_os_error(libc::ECONNRESET)))
        })
    }

    /// Move the socket's zero-copy reports from the engine to `zdone` (an application call,
    /// such as a cancel, may produce one without a round of progress to collect it).
    fn collect_zdone(g: &mut Inner<P>, id: ConnId) {
        let Inner { driver, socks, .. } = g;
        let Some(s) = socks.get_mut(&id) else {
            return;
        };
        for ev in driver.take_events(id) {
            if let Event::ZcopySent { token, bytes } | Event::ZcopyReceived { token, bytes } = ev {
                s.zdone.push((token, bytes));
            }
        }
    }

    /// Send `len` bytes of registered memory at `mr[off..]` by zero copy, waiting until the peer
    /// has them; returns bytes sent (fewer if the peer cancelled, or, with a `stall` bound, if
    /// the peer stopped taking them: send the rest again). The peer may read those bytes, and
    /// nothing else of `mr`, through a grant of their own, until the call returns.
    pub(super) fn zcopy_send(
        &self,
        id: ConnId,
        mr: &mut DynMr,
        off: usize,
        len: usize,
        stall: Option<Duration>,
    ) -> io::Result<usize> {
        let grant = mr
            .advertise(off, len, Access::REMOTE_READ)
            .map_err(verbs_err)?;
        let r = self.zcopy_send_granted(id, &grant, stall);
        // Every way out (finished, cancelled, failed, never queued): the engine is done with
        // the source, so the peer's access ends here.
        let revoke = mr.revoke(&grant);
        let sent = r?;
        revoke.map_err(verbs_err)?;
        Ok(sent)
    }

    /// Body of [`Self::zcopy_send`]: advertise `grant` and wait for the engine to end it.
    fn zcopy_send_granted(
        &self,
        id: ConnId,
        grant: &Grant,
        stall: Option<Duration>,
    ) -> io::Result<usize> {
        let len = grant.len;
        let src = ZSrc {
            addr: grant.addr,
            len: len as u32,
            lkey: grant.lkey,
            rkey: grant.rkey,
        };
        let mut token = 0;
        self.block_on(Wait::default(), |g, now| {
            if !Self::zsends_settled(g, now, id) {
                return None;
            }
            if token == 0 {
                token = g.next_token;
                g.next_token += 1;
            }
            let r = match stall {
                Some(d) => g.driver.write_zcopy_bounded(now, id, src, token, d),
                None => g.driver.write_zcopy(now, id, src, token),
            };
            match r {
                Ok(()) => Some(Ok(())),
                Err(CallError::WouldBlock) => None,
                Err(e) => Some(Err(io_err(e))),
            }
        })?;
        // (The wait polls the engine itself, timers included, and wakes the progress thread,
        // whose next deadline may now be the stall bound, before it sleeps.)
        self.zcopy_wait_for(id, token, len)
    }

    /// Receive the next bytes straight into registered memory when they are a peer's zero-copy
    /// source. `Ok(None)`: they are not; read by copy. The sink is `len` bytes at `mr[off..]`
    /// under a grant of their own (an RDMA Read sink: on iWARP the peer's read response
    /// writes it), revoked before the call returns.
    pub(super) fn zcopy_recv(
        &self,
        id: ConnId,
        mr: &mut DynMr,
        off: usize,
        len: usize,
    ) -> io::Result<Option<usize>> {
        // Registering a grant costs more than a look: only when there is a source to read.
        if !self.next_is_zcopy(id)? {
            return Ok(None);
        }
        let len = len.min(u32::MAX as usize);
        let grant = mr
            .advertise(off, len, Access::LOCAL_WRITE | Access::READ_SINK)
            .map_err(verbs_err)?;
        let r = self.zcopy_recv_granted(id, &grant);
        let revoke = mr.revoke(&grant);
        let n = r?;
        revoke.map_err(verbs_err)?;
        Ok(n)
    }

    /// Whether the next stream bytes of `id` are a peer's zero-copy source we may read.
    fn next_is_zcopy(&self, id: ConnId) -> io::Result<bool> {
        self.lock()?.driver.next_is_zcopy(id).map_err(driver_err)
    }

    /// Body of [`Self::zcopy_recv`]: read into `grant` and wait for the engine to end it.
    fn zcopy_recv_granted(&self, id: ConnId, grant: &Grant) -> io::Result<Option<usize>> {
        let sink = ZSink {
            addr: grant.addr,
            len: grant.len as u32,
            lkey: grant.lkey,
            rkey: grant.rkey,
        };
        let token = {
            let mut g = self.lock()?;
            let now = self.now();
            if !g.driver.next_is_zcopy(id).map_err(driver_err)? {
                return Ok(None);
            }
            let token = g.next_token;
            g.next_token += 1;
            match g.driver.read_zcopy(now, id, sink, token) {
                Ok(ZRecv::Pending) => token,
                Ok(ZRecv::Copy) => return Ok(None),
                Err(CallError::WouldBlock) => return Ok(None),
                Err(e) => return Err(io_err(e)),
            }
        };
        match self.zcopy_wait(id, token)? {
            0 => Ok(None),
            n => Ok(Some(n)),
        }
    }

    /// Collect the socket's zero-copy events and settle its asynchronous sends; true when no
    /// bytes of a short one wait to go (so a new write keeps stream order).
    pub(super) fn zsends_settled(g: &mut Inner<P>, now: Instant, id: ConnId) -> bool {
        let Inner { driver, socks, .. } = g;
        let Some(s) = socks.get_mut(&id) else {
            return true;
        };
        if s.zsends.is_empty() && s.zbacklog.is_empty() {
            return true;
        }
        for ev in driver.take_events(id) {
            if let Event::ZcopySent { token, bytes } | Event::ZcopyReceived { token, bytes } = ev {
                s.zdone.push((token, bytes));
            }
        }
        settle_zsends(driver, now, id, s);
        s.zbacklog.is_empty()
    }
}

/// Collect finished asynchronous zero-copy sends of one socket: revoke the peer's access, and
/// queue what did not reach the peer (the rest of a short one, all of each later one: the
/// engine ends them together, in stream order) for sending by copy; then feed that backlog to
/// the engine as room allows.
pub(super) fn settle_zsends<P: Provider>(
    driver: &mut Driver<P>,
    now: Instant,
    id: ConnId,
    s: &mut Sock,
) {
    let Sock {
        zdone,
        zsends,
        zbacklog,
        ..
    } = s;
    for z in zsends.iter_mut().filter(|z| z.done.is_none()) {
        let Some(i) = zdone.iter().position(|&(t, _)| t == z.token) else {
            continue;
        };
        let bytes = zdone.swap_remove(i).1.min(z.len);
        let revoke = z.mr.revoke(&z.grant);
        let failed = driver.conn_error(id).cloned();
        z.done = Some(match (revoke, failed) {
            (Err(e), _) => Err(verbs_err(e)),
            (Ok(()), Some(e)) if bytes < z.len => Err(io::Error::from_raw_os_error(e.errno())),
            (Ok(()), _) => {
                if bytes < z.len {
                    let mut rest = vec![0u8; z.len - bytes];
                    z.mr.read(z.off + bytes, &mut rest);
                    zbacklog.extend(rest);
                }
                Ok(z.len)
            }
        });
    }
    while !zbacklog.is_empty() {
        let chunk = zbacklog.as_slices().0;
        match driver.write(now, id, chunk) {
            Ok(n) => {
                zbacklog.drain(..n);
            }
            Err(CallError::WouldBlock) => break,
            Err(_) => {
                // The connection failed: the application's next call reports it.
                zbacklog.clear();
            }
        }
    }
}
