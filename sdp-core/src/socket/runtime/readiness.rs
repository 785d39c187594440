//! Readiness: bringing a socket's readiness fd and the shim's application fd up to date with
//! its connection's state after a call or a round of progress, and turning direct wakeups of
//! an application fd on and off.

use super::*;

impl<P: Provider + 'static> Runtime<P> {
    /// Bring one socket's readiness fd up to date after an application call.
    pub(super) fn refresh(g: &mut Inner<P>, id: ConnId) {
        let Inner { driver, socks, .. } = g;
        if let Some(s) = socks.get_mut(&id) {
            refresh_sock(driver, id, s);
        }
    }
}

pub(super) fn refresh_sock<P: Provider>(driver: &Driver<P>, id: ConnId, s: &mut Sock) {
    refresh_app(driver, id, s, None);
    let Some(r) = s.ready.as_mut() else {
        return;
    };
    match driver.view(id) {
        Some(c) => {
            let hup = c.state() == State::Closed || (c.read_closed() && c.write_closed());
            r.set(c.is_readable(), c.is_writable(), hup)
        }
        None => r.set(true, true, true),
    }
}

/// What an application fd of the connection should report.
fn app_state<P: Provider>(
    driver: &Driver<P>,
    id: ConnId,
    lowat: usize,
    error_taken: bool,
) -> AppState {
    match driver.view(id) {
        Some(c) => AppState {
            readable: c.read_ready() && !c.rx_below(lowat),
            rx_total: c.stats().data_bytes_rcvd,
            writable: c.is_writable(),
            // Once the bytes before the peer's FIN are read (TCP's POLLRDHUP comes at the FIN:
            // showing it earlier would shut our end's write half, and a fork child that
            // shares the fd later could not get those bytes through the file).
            rdhup: c.read_closed() || c.state() == State::Closed,
            hup: c.state() == State::Closed && c.error().is_none()
                || (c.read_closed() && c.write_closed()),
            // A failure shows at once, as TCP's POLLERR | POLLHUP at a reset, data still
            // unread or not (reads return that first) ...
            err: c.error().is_some(),
            // ... until a call reported it (Linux clears `sk_err` then: POLLHUP stays).
            err_taken: error_taken,
            urgent: c.urgent_pending(),
        },
        None => AppState {
            readable: true,
            writable: true,
            rdhup: true,
            hup: true,
            ..AppState::default()
        },
    }
}

/// Bring a socket's application fd up to date; `user` when an application call holds it.
/// Direct wakeups (`AppReady`) are on while an arriving message needs nothing but a reader:
/// the fd writable and nothing of ours queued to send (both wait on the peer's messages, which
/// then go through the progress thread).
pub(super) fn refresh_app<P: Provider>(
    driver: &Driver<P>,
    id: ConnId,
    s: &mut Sock,
    user: Option<RawFd>,
) {
    refresh_app_taking(driver, id, s, user, true)
}

/// [`refresh_app`]; `take` false when the caller takes the tokens back itself right after
/// (`AppReady::update_taking`).
pub(super) fn refresh_app_taking<P: Provider>(
    driver: &Driver<P>,
    id: ConnId,
    s: &mut Sock,
    user: Option<RawFd>,
    take: bool,
) {
    // A stream another process may hold (a fork child inherited its fd) is never settled: if
    // this process dies, the connection dies under that holder (and with the pump's bytes),
    // where TCP's lives on: the peer hears a reset, not an orderly end.
    driver.note_settled(
        id,
        s.pump.is_none() && s.exposed.is_none() && s.parked.is_none(),
    );
    if let Some(a) = s.app.as_mut() {
        let st = app_state(driver, id, s.lowat, s.error_taken);
        a.update_taking(st, user, take);
        if a.direct {
            // A direct wakeup makes the fd readable at any byte: not under SO_RCVLOWAT.
            let want = st.writable
                && s.lowat <= 1
                && !st.rdhup
                && !st.hup
                && !st.err
                && s.zbacklog.is_empty()
                && driver.tx_queued(id) == 0;
            if want != a.direct_on {
                a.direct_on = want;
                driver.set_direct_wake(id, want, false);
            }
        }
    }
}
