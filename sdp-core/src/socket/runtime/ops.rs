//! The socket calls: `impl StackOps for Runtime` (connect, listen, accept, read, write,
//! registered and asynchronous zero-copy sends, close and linger, options, the shim's
//! application-fd calls), and how a close without linger goes under the lock.

use super::*;

/// A connector turned away by a full listen queue tries again after this, then after twice
/// as long each time ...
const QUEUE_FULL_RETRY_FIRST: Duration = Duration::from_millis(25);
/// ... up to this (TCP sends its first SYN again after 1 s; a listener on this host or fabric
/// answers a new try cheaply, so a waiting connector gets in sooner after an accept).
const QUEUE_FULL_RETRY_MAX: Duration = Duration::from_secs(1);

/// Reads at least this big may take a peer's zero-copy source straight into the caller's
/// buffer.
const ZREAD_MIN: usize = 16 * 1024;

/// Closing (see [`StackOps::close`]).
impl<P: Provider + 'static> Runtime<P> {
    /// The listener's readiness fd; `hand_out`: marked as watched from outside calls
    /// ([`StackOps::listener_fd`]), else for a wait inside one ([`StackOps::listener_wait_fd`]).
    fn listener_ready_fd(&self, l: ListenerId, hand_out: bool) -> io::Result<RawFd> {
        let mut g = self.lock()?;
        let ls = g
            .lsocks
            .get_mut(&l)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
        ls.fd_given |= hand_out;
        Ok(ls.ready.fd())
    }

    /// The start of `close(2)` under the lock: a stream another process holds is handed to
    /// its pump, and the connection closes at once (reset with SO_LINGER {1, 0}); with a
    /// linger time the time is returned, to wait before [`Runtime::close_locked`]. A stream
    /// shared with other processes (pumped) ends with its last holder's close, as a TCP file
    /// does: no linger.
    pub(super) fn close_begin(g: &mut Inner<P>, now: Instant, id: ConnId) -> Option<Duration> {
        // What the peer sent and no round took yet (a direct wakeup's SEND waits in the
        // endpoint for the reader's round) is data that arrived: unread, it makes the close a
        // reset, as TCP's.
        g.driver.poll_one(now, id);
        Self::close_exposed(g, now, id);
        match g
            .socks
            .get(&id)
            .filter(|s| s.pump.is_none())
            .and_then(|s| s.linger)
        {
            None => {
                Self::close_locked(g, now, id);
                None
            }
            Some(l) if l.is_zero() => {
                g.socks.remove(&id);
                g.driver.abort(now, id);
                g.driver.release(now, id);
                None
            }
            Some(l) => Some(l),
        }
    }

    /// `close(2)` without a linger, under the lock.
    pub(super) fn close_locked(g: &mut Inner<P>, now: Instant, id: ConnId) {
        if let Some(p) = g.socks.get_mut(&id).and_then(|s| s.pump.as_mut()) {
            // Other processes may still hold the file: the pump closes when they all did.
            p.released = true;
            if !p.closed {
                return;
            }
            g.socks.remove(&id);
            g.pumps -= 1;
            return;
        }
        g.socks.remove(&id);
        g.driver.close(now, id);
    }

    fn listen_with(&self, addr: SocketAddr, backlog: u32, adopted: bool) -> io::Result<ListenerId> {
        let mut g = self.lock()?;
        // As listen(2): the kernel caps the backlog at somaxconn.
        let backlog = backlog.min(sys::somaxconn());
        let l = if adopted {
            g.driver.listen_adopted(addr, backlog)
        } else {
            g.driver.listen(addr, backlog)
        }
        .map_err(driver_err)?;
        g.lsocks.insert(
            l,
            LSock {
                fd_given: false,
                ready: ReadyFd::new()?,
                bell: None,
                handoff_bell: None,
            },
        );
        // Make the listener's readiness fd unwritable: only POLLIN means something.
        if let Some(ls) = g.lsocks.get_mut(&l) {
            ls.ready.set(false, false, false);
        }
        Ok(l)
    }
}

impl<P: Provider + 'static> StackOps for Runtime<P> {
    fn name(&self) -> &'static str {
        // No lock: after fork() the child may ask, and the parent's lock may be held forever.
        self.sh.name
    }
    fn alive(&self) -> bool {
        sys::getpid() == self.sh.pid() && !self.sh.failed()
    }

    fn connect(
        &self,
        dst: SocketAddr,
        src: Option<SocketAddr>,
        timeout: Option<Duration>,
        wait_room: bool,
        patience: Option<Patience>,
    ) -> io::Result<ConnId> {
        // The whole connect, tries again included, within the timeout.
        let start = std::time::Instant::now();
        let limit = match timeout {
            Some(t) => t,
            None => self.lock()?.driver.config().connect_timeout,
        };
        let mut pause = QUEUE_FULL_RETRY_FIRST;
        loop {
            let left = limit.saturating_sub(start.elapsed());
            match self.connect_once(dst, src, Some(left), patience) {
                Err(None) if wait_room => {
                    let left = limit.saturating_sub(start.elapsed());
                    if left.is_zero() {
                        return Err(io::Error::from_raw_os_error(libc::ETIMEDOUT));
                    }
                    std::thread::sleep(pause.min(left));
                    pause = (pause * 2).min(QUEUE_FULL_RETRY_MAX);
                }
                Err(None) => return Err(io::Error::from_raw_os_error(libc::ECONNREFUSED)),
                Err(Some(e)) => return Err(e),
                Ok(id) => return Ok(id),
            }
        }
    }

    fn listen(&self, addr: SocketAddr, backlog: u32) -> io::Result<ListenerId> {
        self.listen_with(addr, backlog, false)
    }

    fn listen_adopted(&self, addr: SocketAddr, backlog: u32) -> io::Result<ListenerId> {
        self.listen_with(addr, backlog, true)
    }

    fn adopt(&self, l: ListenerId, request: OwnedFd) -> io::Result<()> {
        let mut g = self.lock()?;
        g.driver.adopt(l, request).map_err(driver_err)?;
        drop(g);
        // Its connect request is news for the next round.
        sys::eventfd_signal(&self.sh.wake);
        Ok(())
    }

    fn listener_busy(&self, l: ListenerId) -> bool {
        self.lock().ok().is_some_and(|g| {
            g.driver
                .listen_stats(l)
                .is_some_and(|s| s.queued > 0 || s.unanswered > 0)
        })
    }

    fn set_handoff(&self, l: ListenerId, to: OwnedFd, bell: Bell) -> io::Result<()> {
        let mut g = self.lock()?;
        g.driver.set_handoff(l, to).map_err(driver_err)?;
        let told = g.driver.listen_stats(l).map_or(0, |s| s.handed_off);
        let ls = g
            .lsocks
            .get_mut(&l)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
        ls.handoff_bell = Some((bell.clone(), told));
        // Requests taken before and handed now.
        if told > 0 {
            bell(told as usize);
        }
        drop(g);
        sys::eventfd_signal(&self.sh.wake);
        Ok(())
    }

    fn listener_addr(&self, l: ListenerId) -> Option<SocketAddr> {
        self.lock().ok()?.driver.listener_addr(l)
    }

    fn accept(&self, l: ListenerId, w: Wait) -> io::Result<(ConnId, SocketAddr)> {
        self.block_on(w, |g, _| {
            let Inner {
                driver,
                lsocks,
                socks,
                ..
            } = g;
            let Some(ls) = lsocks.get_mut(&l) else {
                return Some(Err(io::Error::from_raw_os_error(libc::EBADF)));
            };
            // The first one set up, in arrival order (the driver's queue; one whose setup
            // failed is never handed over, one established and reset or closed since is).
            let id = driver.accept_established(l)?;
            socks.insert(id, Sock::default());
            ls.set_ready(driver.listen_stats(l).map_or(0, |s| s.ready));
            let peer = driver
                .peer_addr(id)
                .unwrap_or_else(|| SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), 0));
            Some(Ok((id, peer)))
        })
    }

    fn close_listener(&self, l: ListenerId) {
        let Ok(mut g) = self.lock() else { return };
        g.lsocks.remove(&l);
        // The driver aborts the connections nobody accepted (their peers see a reset).
        g.driver.close_listener(l);
    }

    fn listener_wait_fd(&self, l: ListenerId) -> io::Result<RawFd> {
        self.listener_ready_fd(l, false)
    }

    fn listener_fd(&self, l: ListenerId) -> io::Result<RawFd> {
        self.listener_ready_fd(l, true)
    }

    fn read(&self, id: ConnId, buf: &mut [u8], w: Wait) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        // A blocking read of a peer's zero-copy source takes it straight into `buf`, unless
        // the stream has zero copy off (`SdpStream::set_zero_copy(false)`).
        let mut try_z = !w.nonblocking
            && w.zcopy
            && buf.len() >= ZREAD_MIN
            && self.sh.user_zcopy.load(Ordering::Relaxed);
        loop {
            let r = self.block_on(w, |g, now| {
                if try_z && g.driver.next_is_zcopy(id) == Ok(true) {
                    return Some(Ok(None));
                }
                let r = match g.driver.read(now, id, buf) {
                    Ok(n) => Some(Ok(Some(n))),
                    Err(CallError::WouldBlock) => None,
                    Err(e) => Some(Self::report_once(g, id, e, Ok(0)).map(Some)),
                };
                Self::refresh(g, id);
                r
            })?;
            match r {
                Some(n) => return Ok(n),
                None => {
                    if let Some(n) = self.read_user_zcopy(id, buf)? {
                        return Ok(n);
                    }
                    try_z = false;
                }
            }
        }
    }

    fn write(&self, id: ConnId, buf: &[u8], w: Wait) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        // Zero copy holds the caller until the peer has the bytes, so only blocking writes
        // without a timeout use it.
        if !w.nonblocking
            && w.zcopy
            && w.timeout.is_none()
            && buf.len() >= self.user_zcopy_min()
            && buf.len() <= u32::MAX as usize
            && self.sh.user_zcopy.load(Ordering::Relaxed)
            && self.beyond_send_room(id, buf.len())?
        {
            if let Some(n) = self.write_user_zcopy(id, buf)? {
                return Ok(n);
            }
        }
        self.write_copy(id, buf, w)
    }

    fn send_registered(
        &self,
        id: ConnId,
        mr: &mut DynMr,
        off: usize,
        len: usize,
    ) -> io::Result<usize> {
        check_range(mr, off, len)?;
        let zmin = self.sh.zcopy_threshold;
        if len < zmin.max(1) {
            // Small: a copy costs less than the round trip of an advertisement.
            let mut tmp = vec![0u8; len];
            mr.read(off, &mut tmp);
            return self.write_copy(id, &tmp, Wait::default());
        }
        // The peer reads these bytes (only these) while the transfer is outstanding.
        let sent = self.zcopy_send(id, mr, off, len.min(u32::MAX as usize), None)?;
        if sent < len {
            let mut tmp = vec![0u8; len - sent];
            mr.read(off + sent, &mut tmp);
            self.write_copy(id, &tmp, Wait::default())?;
        }
        Ok(len)
    }

    fn recv_registered(
        &self,
        id: ConnId,
        mr: &mut DynMr,
        off: usize,
        len: usize,
    ) -> io::Result<usize> {
        check_range(mr, off, len)?;
        if len == 0 {
            return Ok(0);
        }
        // Wait for something to read, then take it straight into the region if it is a
        // zero-copy source, by copy otherwise.
        self.block_on(Wait::default(), |g, _| {
            let c = g.driver.view(id)?;
            c.is_readable().then_some(Ok(()))
        })?;
        if let Some(n) = self.zcopy_recv(id, mr, off, len)? {
            return Ok(n);
        }
        let mut tmp = vec![0u8; len];
        let n = self.read(id, &mut tmp, Wait::default())?;
        mr.write(off, &tmp[..n]);
        Ok(n)
    }

    fn register(&self, len: usize) -> io::Result<DynMr> {
        let g = self.lock()?;
        let mr = g
            .driver
            .reg_mr(len, Access::LOCAL_WRITE)
            .map_err(verbs_err)?;
        Ok(Box::new(mr))
    }

    fn send_registered_async(&self, id: ConnId, mut mr: DynMr, off: usize, len: usize) -> ZStart {
        if let Err(e) = check_range(&mr, off, len) {
            return ZStart::Done(mr, Err(e));
        }
        let zmin = match self.lock() {
            Ok(g) => g.driver.config().zcopy_threshold,
            Err(e) => return ZStart::Done(mr, Err(e)),
        };
        if len < zmin.max(1) || len > u32::MAX as usize {
            // Small (or too large for one source): the synchronous path copies or splits.
            let r = self.send_registered(id, &mut mr, off, len);
            return ZStart::Done(mr, r);
        }
        // The peer reads these bytes (only these) until the engine reports the source done.
        let grant = match mr.advertise(off, len, Access::REMOTE_READ) {
            Ok(g) => g,
            Err(e) => return ZStart::Done(mr, Err(verbs_err(e))),
        };
        let src = ZSrc {
            addr: grant.addr,
            len: len as u32,
            lkey: grant.lkey,
            rkey: grant.rkey,
        };
        let mut slot = Some(mr);
        let mut token = 0;
        let r = self.block_on(Wait::default(), |g, now| {
            if !Self::zsends_settled(g, now, id) {
                return None;
            }
            if token == 0 {
                token = g.next_token;
                g.next_token += 1;
            }
            match g.driver.write_zcopy(now, id, src, token) {
                Ok(()) => {
                    let Some(s) = g.socks.get_mut(&id) else {
                        return Some(Err(io::Error::from_raw_os_error(libc::EBADF)));
                    };
                    let mr = slot.take().expect("taken once");
                    s.zsends.push_back(ZSend {
                        token,
                        mr,
                        grant,
                        off,
                        len,
                        done: None,
                    });
                    Some(Ok(()))
                }
                Err(CallError::WouldBlock) => None,
                Err(e) => Some(Err(io_err(e))),
            }
        });
        match (r, slot) {
            (Ok(()), _) => ZStart::Pending(token),
            (Err(e), Some(mut mr)) => {
                // Never advertised: take the peer's access back.
                let _ = mr.revoke(&grant);
                ZStart::Done(mr, Err(e))
            }
            (Err(e), None) => {
                // Queued in the engine yet the call failed: cannot happen (the push is the last
                // step), but the region stays with the runtime until the engine ends it.
                let _ = e;
                ZStart::Pending(token)
            }
        }
    }

    fn send_registered_poll(
        &self,
        id: ConnId,
        ticket: u64,
        block: bool,
    ) -> io::Result<Option<(DynMr, io::Result<usize>)>> {
        let w = Wait {
            nonblocking: !block,
            ..Wait::default()
        };
        // No timeout when blocking: the peer may read the memory until the engine says it is
        // done, which it always does (finished, cancelled, or the connection failed).
        let r = self.block_on(w, |g, now| {
            Self::zsends_settled(g, now, id);
            let Some(s) = g.socks.get_mut(&id) else {
                return Some(Err(io::Error::from_raw_os_error(libc::EBADF)));
            };
            let i = s.zsends.iter().position(|z| z.token == ticket)?;
            s.zsends[i].done.as_ref()?;
            let z = s.zsends.remove(i).expect("found");
            Some(Ok((z.mr, z.done.expect("checked"))))
        });
        match r {
            Ok(v) => Ok(Some(v)),
            Err(e) if !block && e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn send_registered_peek(&self, id: ConnId, ticket: u64) -> io::Result<bool> {
        let mut g = self.lock()?;
        if self.sh.step(&mut g) > 0 {
            self.sh.wake_waiters();
        }
        let now = self.now();
        Self::zsends_settled(&mut g, now, id);
        let Some(s) = g.socks.get(&id) else {
            return Ok(true);
        };
        Ok(s.zsends
            .iter()
            .find(|z| z.token == ticket)
            .is_none_or(|z| z.done.is_some()))
    }

    fn shutdown(&self, id: ConnId, how: Shutdown) -> io::Result<()> {
        self.with_sock(id, |g, now| g.driver.shutdown(now, id, how).map_err(io_err))
    }

    fn set_linger(&self, id: ConnId, linger: Option<Duration>) -> io::Result<()> {
        self.with_sock(id, |g, _| {
            if let Some(s) = g.socks.get_mut(&id) {
                s.linger = linger;
            }
            Ok(())
        })
    }
    fn linger(&self, id: ConnId) -> io::Result<Option<Duration>> {
        self.with_sock(id, |g, _| Ok(g.socks.get(&id).and_then(|s| s.linger)))
    }

    fn close(&self, id: ConnId) {
        let linger = {
            let Ok(mut g) = self.lock() else { return };
            let now = self.now();
            if g.ended_behind.remove(&id).is_some() {
                return;
            }
            match Self::close_begin(&mut g, now, id) {
                Some(l) => l,
                None => return,
            }
        };
        let w = Wait {
            timeout: Some(linger),
            ..Wait::default()
        };
        // As TCP's close with a linger: blocks (nonblocking or not) until the peer has
        // acknowledged every byte or the time is up; the close goes on either way.
        let _ = self.block_on(w, |g, _| {
            let backlog = g.socks.get(&id).map_or(0, |s| s.zbacklog.len());
            let open = g
                .driver
                .view(id)
                .is_some_and(|c| c.state() != State::Closed);
            (!open || backlog + g.driver.tx_queued(id) == 0).then_some(Ok(()))
        });
        if let Ok(mut g) = self.lock() {
            let now = self.now();
            Self::close_locked(&mut g, now, id);
        }
    }

    fn ready_fd(&self, id: ConnId) -> io::Result<RawFd> {
        let mut g = self.lock()?;
        let s = g
            .socks
            .get_mut(&id)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
        if s.ready.is_none() {
            s.ready = Some(ReadyFd::new()?);
        }
        let fd = s.ready.as_ref().map(|r| r.fd()).unwrap_or(-1);
        Self::refresh(&mut g, id);
        Ok(fd)
    }

    fn addrs(&self, id: ConnId) -> io::Result<(SocketAddr, SocketAddr)> {
        let g = self.lock()?;
        // After a failure there is no peer (getpeername gives ENOTCONN on a reset TCP socket).
        let failed = g
            .driver
            .view(id)
            .is_some_and(|c| c.state() == State::Closed && c.error().is_some());
        match (g.driver.local_addr(id), g.driver.peer_addr(id)) {
            (Some(l), Some(p)) if !failed => Ok((l, p)),
            _ => Err(io::Error::from_raw_os_error(libc::ENOTCONN)),
        }
    }

    fn set_nodelay(&self, id: ConnId, on: bool) -> io::Result<()> {
        self.with_sock(id, |g, now| {
            g.driver.set_nodelay(now, id, on).map_err(driver_err)
        })
    }
    fn set_oob_inline(&self, id: ConnId, on: bool) -> io::Result<()> {
        self.with_sock(id, |g, now| {
            g.driver.set_oob_inline(now, id, on).map_err(driver_err)
        })
    }
    fn nodelay(&self, id: ConnId) -> io::Result<bool> {
        self.option(id, |d| d.nodelay(id))
    }
    fn set_sndbuf(&self, id: ConnId, bytes: usize) -> io::Result<()> {
        self.with_sock(id, |g, now| {
            g.driver.set_sndbuf(now, id, bytes).map_err(driver_err)
        })
    }
    fn sndbuf(&self, id: ConnId) -> io::Result<usize> {
        self.option(id, |d| d.sndbuf(id))
    }
    fn set_rcvbuf(&self, id: ConnId, bytes: usize) -> io::Result<()> {
        self.with_sock(id, |g, now| {
            g.driver.set_rcvbuf(now, id, bytes).map_err(driver_err)
        })
    }
    fn rcvbuf(&self, id: ConnId) -> io::Result<usize> {
        self.option(id, |d| d.rcvbuf(id))
    }
    fn take_error(&self, id: ConnId) -> io::Result<Option<io::Error>> {
        self.with_sock(id, |g, _| {
            let Inner { driver, socks, .. } = g;
            let s = socks.get_mut(&id).expect("checked by with_sock");
            if s.error_taken {
                return Ok(None);
            }
            let e: Option<ConnError> = driver.conn_error(id).cloned();
            Ok(e.map(|e| {
                s.error_taken = true;
                io::Error::from_raw_os_error(e.errno())
            }))
        })
    }
    fn send_queue_len(&self, id: ConnId) -> io::Result<usize> {
        self.with_sock(id, |g, _| {
            let backlog = g.socks.get(&id).map_or(0, |s| s.zbacklog.len());
            let queued = g.driver.tx_queued(id);
            Ok(queued + backlog)
        })
    }
    fn owner_pid(&self) -> u32 {
        self.sh.pid()
    }
    fn fork_moving(&self, fork: &mut dyn FnMut() -> libc::pid_t) -> libc::pid_t {
        self.fork_moving_here(fork)
    }
    fn inject_progress_panic(&self) {
        self.sh.inject_panic.store(true, Ordering::SeqCst);
        sys::eventfd_signal(&self.sh.wake);
    }
    fn user_zcopy_reads(&self) -> u64 {
        self.sh.user_zreads.load(Ordering::Relaxed)
    }
    fn conn_count(&self) -> usize {
        self.lock().map_or(0, |g| g.driver.conn_count())
    }
    fn app_attach(&self, id: ConnId, nonblocking: bool, cloexec: bool) -> io::Result<OwnedFd> {
        let mut g = self.lock()?;
        let Inner { driver, socks, .. } = &mut *g;
        let s = socks
            .get_mut(&id)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
        if s.app.is_some() {
            return Err(io::Error::from_raw_os_error(libc::EEXIST));
        }
        let (mut app, user) = AppReady::new(nonblocking, cloexec)?;
        // No staged sends behind application fds: they stalled there until readers read
        // ahead (below), and since show no gain for iperf3 (docs/findings.md).
        let now = self.now();
        driver.stop_staging(now, id).map_err(driver_err)?;
        // The fd is readable only once bytes are here: a peer's SrcAvail is fetched ahead,
        // not by a read that readiness would never prompt.
        driver.set_read_ahead(now, id).map_err(driver_err)?;
        if crate::socket::tunables::tunables().direct_wake {
            if let Some(fd) = app.ours_fd() {
                app.direct = driver.give_direct_wake(id, fd);
            }
            if app.direct {
                // One token at a time until the application's fd is watched for edges
                // (`StackOps::app_want_edges`).
                app.unread_clear = driver.direct_unread_clear(id).map(UnreadClear);
                driver.set_direct_level(id, app.unread_clear.is_some());
            }
        }
        self.sh.watch_app_hangup(&app, id);
        s.app = Some(app);
        refresh_app(driver, id, s, Some(user.as_raw_fd()));
        Ok(user)
    }

    fn app_read(
        &self,
        id: ConnId,
        user: RawFd,
        buf: &mut [u8],
        peek: bool,
        min: usize,
    ) -> io::Result<usize> {
        // As TCP's: a connection's error is reported once; reads after it see EOF.
        self.app_call_once(id, user, true, Ok(0), |g, now| {
            if min > 1 && g.driver.view(id).is_some_and(|c| c.rx_below(min)) {
                return Err(CallError::WouldBlock);
            }
            if peek {
                g.driver
                    .peek(id, buf)
                    .unwrap_or(Err(CallError::Conn(ConnError::Reset)))
            } else {
                g.driver.read(now, id, buf)
            }
        })
    }

    fn app_set_rcvlowat(&self, id: ConnId, user: RawFd, lowat: usize) -> io::Result<()> {
        let mut g = self.lock()?;
        let Inner { driver, socks, .. } = &mut *g;
        let Some(s) = socks.get_mut(&id) else {
            return Err(io::Error::from_raw_os_error(libc::EBADF));
        };
        s.lowat = lowat;
        let was_direct = s.app.as_ref().is_some_and(|a| a.direct_on);
        // Readable now or not, as TCP looks again when the mark is set.
        refresh_app(driver, id, s, Some(user));
        if was_direct && s.app.as_ref().is_some_and(|a| !a.direct_on) {
            // The mark turned direct wakeups off: a token the peer wrote for bytes below it
            // (unknown to our readiness state, which only a read that finds nothing takes
            // back) would leave the fd polling readable for them. Wait for a peer mid-write,
            // take every token back, take the SENDs they announced, and look again.
            driver.set_direct_wake(id, false, true);
            if let Some(a) = s.app.as_mut() {
                a.take_direct_tokens(user);
            }
            self.app_call_round(&mut g, id);
            let Inner { driver, socks, .. } = &mut *g;
            if let Some(s) = socks.get_mut(&id) {
                refresh_app(driver, id, s, Some(user));
            }
        }
        Ok(())
    }

    fn app_want_edges(&self, id: ConnId) {
        let Ok(mut g) = self.lock() else { return };
        let Inner { driver, socks, .. } = &mut *g;
        if let Some(a) = socks.get_mut(&id).and_then(|s| s.app.as_mut()) {
            a.edges = true;
            if a.direct {
                driver.set_direct_level(id, false);
            }
        }
    }

    fn app_write(&self, id: ConnId, user: RawFd, buf: &[u8]) -> io::Result<usize> {
        // ... and writes after it EPIPE.
        let later = Err(io::Error::from_raw_os_error(libc::EPIPE));
        self.app_call_once(id, user, false, later, |g, now| {
            if !Self::zsends_settled(g, now, id) {
                return Err(CallError::WouldBlock);
            }
            g.driver.write(now, id, buf)
        })
    }

    fn app_shutdown(&self, id: ConnId, user: RawFd, how: Shutdown) -> io::Result<()> {
        self.app_call(id, user, |g, now| g.driver.shutdown(now, id, how))
    }

    fn app_poll_time(&self) -> Duration {
        poll_time(&self.sh.spin, || SpinGuard::allowed() && CpuRoom::allows())
    }

    fn app_poll_readable(&self, id: ConnId, spin: Duration, stop: &dyn Fn() -> bool) -> bool {
        self.poll_app_readable(id, spin, stop)
    }

    fn app_waited(&self, waited: Duration) {
        self.sh.spin.record(waited);
    }

    fn app_info(&self, id: ConnId) -> io::Result<crate::socket::app::AppInfo> {
        let mut g = self.lock()?;
        // FIONREAD after a direct wakeup counts what the wakeup announced, as TCP's counts what
        // made the fd readable.
        if Self::direct_pending(&g, id) && self.sh.step(&mut g) > 0 {
            self.sh.wake_waiters();
        }
        match g.driver.view(id) {
            Some(c) => Ok(info_of(&c)),
            None => g
                .ended_behind
                .get(&id)
                .cloned()
                .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF)),
        }
    }

    fn app_send_urgent(&self, id: ConnId, user: RawFd, byte: u8) -> io::Result<()> {
        self.app_call(id, user, |g, now| {
            g.driver
                .send_urgent(now, id, byte)
                .unwrap_or(Err(CallError::Conn(ConnError::Reset)))
        })
    }

    fn app_read_urgent(&self, id: ConnId, user: RawFd, peek: bool) -> io::Result<Option<u8>> {
        self.app_call(id, user, |g, now| {
            g.driver
                .read_urgent(now, id, peek)
                .map_err(|_| CallError::Conn(ConnError::Reset))
        })
    }

    fn app_share(&self, id: ConnId, user: RawFd) -> io::Result<()> {
        let mut g = self.lock()?;
        let now = self.now();
        if !g.socks.contains_key(&id) {
            return Err(io::Error::from_raw_os_error(libc::EBADF));
        }
        share_locked(&mut g, now, id, Some(user));
        drop(g);
        sys::eventfd_signal(&self.sh.wake);
        Ok(())
    }

    fn app_pump_through(&self, id: ConnId, file: OwnedFd) -> io::Result<()> {
        let mut g = self.lock()?;
        let now = self.now();
        let Inner {
            driver,
            socks,
            pumps,
            ..
        } = &mut *g;
        let s = socks
            .get_mut(&id)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
        // As behind an application fd (`app_attach`): no staged sends, a peer's SrcAvail
        // fetched ahead (the pump reads when the file has room, not when a reader asks).
        driver.stop_staging(now, id).map_err(driver_err)?;
        driver.set_read_ahead(now, id).map_err(driver_err)?;
        let mut p = crate::socket::pump::Pump::new(file, false);
        p.released = true;
        p.run(driver, now, id);
        s.pump = Some(p);
        *pumps += 1;
        drop(g);
        sys::eventfd_signal(&self.sh.wake);
        Ok(())
    }

    fn app_expose(
        &self,
        id: ConnId,
        file: (u64, u64),
        shared: Arc<crate::socket::app::Sharing>,
    ) -> io::Result<()> {
        self.expose(id, file, shared)
    }

    fn app_join(&self, id: ConnId, user: RawFd) -> io::Result<()> {
        self.join(id, user)
    }

    fn wait_pumps_done(&self) {
        self.pumps_done();
    }

    fn app_quiesce(&self, id: ConnId, user: RawFd) {
        self.quiesce(id, user)
    }

    fn set_listener_refusing(&self, l: ListenerId, on: bool) {
        if let Ok(mut g) = self.lock() {
            g.driver.set_refusing(l, on);
        }
    }

    fn set_listener_defer(&self, l: ListenerId, secs: u32) {
        if let Ok(mut g) = self.lock() {
            let Inner { driver, lsocks, .. } = &mut *g;
            driver.set_defer_accept(l, secs);
            if let Some(ls) = lsocks.get_mut(&l) {
                ls.set_ready(driver.listen_stats(l).map_or(0, |s| s.ready));
            }
        }
    }

    fn set_listener_bell(&self, l: ListenerId, bell: Bell) -> io::Result<()> {
        let mut g = self.lock()?;
        let ls = g
            .lsocks
            .get_mut(&l)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
        ls.bell = Some(bell);
        Ok(())
    }

    fn registered_bytes(&self) -> usize {
        self.lock().map_or(0, |g| g.driver.registered_bytes())
    }
}

fn check_range(mr: &DynMr, off: usize, len: usize) -> io::Result<()> {
    if off.checked_add(len).is_none_or(|end| end > mr.len()) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "range outside the registered buffer",
        ));
    }
    Ok(())
}

/// A connection's state and counters as the application asks for them.
pub(super) fn info_of<P: Provider>(
    c: &crate::driver::ConnView<'_, P>,
) -> crate::socket::app::AppInfo {
    let s = c.stats();
    crate::socket::app::AppInfo {
        state: c.state(),
        rx_queued: c.inq(),
        tx_queued: c.tx_queued(),
        bytes_in: s.data_bytes_rcvd,
        bytes_out: s.data_bytes_sent,
        msgs_in: s.msgs_rcvd,
        msgs_out: s.msgs_sent,
        zcopy_bytes: s.zcopy_read_bytes + s.zcopy_write_bytes + s.zcopy_send_bytes,
        credits: c.tx_credits(),
        send_size: c.send_size(),
        read_closed: c.read_closed(),
        write_closed: c.write_closed(),
        error: c.error().map(|e| e.errno()),
        urgent: c.urgent_pending(),
        at_mark: c.at_mark(),
    }
}
