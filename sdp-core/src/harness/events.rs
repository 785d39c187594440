//! The rules one connection's engine events keep, whatever the test: [`EventCheck`] follows the
//! zero-copy offers an application made and the events it takes, and says which rule an event
//! broke. [`App`](super::stream::App) feeds it everything it offers and takes, and panics on
//! the first broken rule.
//!
//! The rules:
//! - every zero-copy source and sink accepted by the engine is reported exactly once
//!   (`ZcopySent` for a source, `ZcopyReceived` for a sink), sources in the order they were
//!   offered, with no more bytes than were offered; no report for a token never offered;
//! - all of them are reported by the time `Closed` comes (it is the last word: the engine fails
//!   what is pending first);
//! - `Closed` comes at most once and nothing comes after it; no zero-copy offer is accepted
//!   after it;
//! - `Connected` comes at most once, before anything else;
//! - `Closed(Some(_))` only when the test said the connection may fail (`may_fail`).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::proto::{ConnError, Event};

/// What one connection's events have said so far, as its application saw them.
#[derive(Debug, Default)]
pub struct EventCheck {
    /// Zero-copy sources offered and not yet reported, oldest first: (token, bytes offered).
    srcs: VecDeque<(u64, usize)>,
    /// Zero-copy sinks offered and not yet reported: token -> bytes offered.
    sinks: BTreeMap<u64, usize>,
    /// Every token offered (a token is offered and reported once).
    offered: BTreeSet<u64>,
    /// Events taken so far.
    seen: u64,
    connected: bool,
    closed: Option<Option<ConnError>>,
}

impl EventCheck {
    pub fn new() -> EventCheck {
        EventCheck::default()
    }

    /// The engine accepted a zero-copy source of `len` bytes under `token`.
    pub fn offer_src(&mut self, token: u64, len: usize) -> Result<(), String> {
        self.offer(token)?;
        self.srcs.push_back((token, len));
        Ok(())
    }

    /// The engine accepted a zero-copy sink of `len` bytes under `token`
    /// ([`ZRecv::Pending`](crate::proto::read::ZRecv::Pending)).
    pub fn offer_sink(&mut self, token: u64, len: usize) -> Result<(), String> {
        self.offer(token)?;
        self.sinks.insert(token, len);
        Ok(())
    }

    fn offer(&mut self, token: u64) -> Result<(), String> {
        if let Some(how) = &self.closed {
            return Err(format!(
                "zero-copy token {token} accepted after Closed({how:?}): it will never be reported"
            ));
        }
        if !self.offered.insert(token) {
            return Err(format!("zero-copy token {token} offered twice"));
        }
        Ok(())
    }

    /// Check the next event; `may_fail`: the test expects (or accepts) the connection to end
    /// in an error.
    pub fn event(&mut self, ev: &Event, may_fail: bool) -> Result<(), String> {
        self.seen += 1;
        if let Some(how) = &self.closed {
            return Err(format!("{ev:?} after Closed({how:?})"));
        }
        match ev {
            Event::Connected => {
                if self.connected {
                    return Err("Connected twice".into());
                }
                if self.seen > 1 {
                    return Err(format!("Connected after {} other events", self.seen - 1));
                }
                self.connected = true;
            }
            Event::Urgent => {}
            Event::ZcopySent { token, bytes } => {
                let (token, bytes) = (*token, *bytes);
                match self.srcs.front() {
                    Some(&(t, len)) if t == token => {
                        if bytes > len {
                            return Err(format!(
                                "ZcopySent {{ token: {token}, bytes: {bytes} }} for a source of {len} bytes"
                            ));
                        }
                        self.srcs.pop_front();
                    }
                    _ if self.srcs.iter().any(|&(t, _)| t == token) => {
                        return Err(format!(
                            "ZcopySent for source {token} before the older source {}",
                            self.srcs[0].0
                        ))
                    }
                    _ => return Err(self.unknown("ZcopySent", token)),
                }
            }
            Event::ZcopyReceived { token, bytes } => {
                let (token, bytes) = (*token, *bytes);
                match self.sinks.remove(&token) {
                    Some(len) if bytes > len => {
                        return Err(format!(
                            "ZcopyReceived {{ token: {token}, bytes: {bytes} }} for a sink of {len} bytes"
                        ))
                    }
                    Some(_) => {}
                    None => return Err(self.unknown("ZcopyReceived", token)),
                }
            }
            Event::Closed(err) => {
                self.closed = Some(err.clone());
                if let Some(e) = err {
                    if !may_fail {
                        return Err(format!(
                            "Closed(Some({e:?})): the connection failed, and the test did not say it may"
                        ));
                    }
                }
                if !self.srcs.is_empty() || !self.sinks.is_empty() {
                    let srcs: Vec<u64> = self.srcs.iter().map(|s| s.0).collect();
                    let sinks: Vec<u64> = self.sinks.keys().copied().collect();
                    return Err(format!(
                        "Closed({err:?}) with zero-copy sources {srcs:?} and sinks {sinks:?} never reported"
                    ));
                }
            }
        }
        Ok(())
    }

    fn unknown(&self, what: &str, token: u64) -> String {
        if !self.offered.contains(&token) {
            format!("{what} for token {token}, never offered")
        } else if self.sinks.contains_key(&token) {
            format!("{what} for token {token}, a sink")
        } else if self.srcs.iter().any(|s| s.0 == token) {
            format!("{what} for token {token}, a source")
        } else {
            format!("{what} for token {token}, already reported")
        }
    }

    /// How the connection ended, once its `Closed` came.
    pub fn closed(&self) -> Option<&Option<ConnError>> {
        self.closed.as_ref()
    }

    /// Zero-copy sources and sinks offered and not yet reported.
    pub fn outstanding(&self) -> usize {
        self.srcs.len() + self.sinks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(c: &mut EventCheck, evs: &[Event], may_fail: bool) -> Result<(), String> {
        evs.iter().try_for_each(|e| c.event(e, may_fail))
    }

    #[test]
    fn a_proper_sequence_passes() {
        let mut c = EventCheck::new();
        c.event(&Event::Connected, false).unwrap();
        c.offer_src(1, 100).unwrap();
        c.offer_src(2, 100).unwrap();
        c.offer_sink(3, 50).unwrap();
        feed(
            &mut c,
            &[
                Event::ZcopySent {
                    token: 1,
                    bytes: 40,
                },
                Event::Urgent,
                Event::ZcopyReceived {
                    token: 3,
                    bytes: 50,
                },
                Event::ZcopySent { token: 2, bytes: 0 },
                Event::Closed(None),
            ],
            false,
        )
        .unwrap();
        assert_eq!(c.closed(), Some(&None));
        assert_eq!(c.outstanding(), 0);
        // An error close the test allows.
        let mut c = EventCheck::new();
        c.event(&Event::Closed(Some(ConnError::Reset)), true)
            .unwrap();
    }

    /// A zero-copy offer made before a case's events: (token, bytes, a source or a sink).
    type Offer = (u64, usize, bool);
    /// (what, the offers made, the events, what the complaint must say).
    type Case = (&'static str, Vec<Offer>, Vec<Event>, &'static str);

    /// Each rule, broken once: the check says so.
    #[test]
    fn each_broken_rule_is_caught() {
        let sent = |token, bytes| Event::ZcopySent { token, bytes };
        let rcvd = |token, bytes| Event::ZcopyReceived { token, bytes };
        let cases: Vec<Case> = vec![
            (
                "twice",
                vec![(1, 10, true)],
                vec![sent(1, 10), sent(1, 10)],
                "already reported",
            ),
            ("never offered", vec![], vec![sent(7, 1)], "never offered"),
            (
                "sink as source",
                vec![(1, 10, false)],
                vec![sent(1, 10)],
                "a sink",
            ),
            (
                "source as sink",
                vec![(1, 10, true)],
                vec![rcvd(1, 10)],
                "a source",
            ),
            (
                "order",
                vec![(1, 10, true), (2, 10, true)],
                vec![sent(2, 10)],
                "before the older source 1",
            ),
            (
                "too many bytes sent",
                vec![(1, 10, true)],
                vec![sent(1, 11)],
                "source of 10",
            ),
            (
                "too many bytes placed",
                vec![(1, 10, false)],
                vec![rcvd(1, 11)],
                "sink of 10",
            ),
            (
                "unreported at close",
                vec![(1, 10, true), (2, 10, false)],
                vec![Event::Closed(None)],
                "sources [1] and sinks [2] never reported",
            ),
            (
                "after close",
                vec![],
                vec![Event::Closed(None), Event::Urgent],
                "after Closed",
            ),
            (
                "close twice",
                vec![],
                vec![Event::Closed(None), Event::Closed(None)],
                "after Closed",
            ),
            (
                "unexpected error",
                vec![],
                vec![Event::Closed(Some(ConnError::Reset))],
                "did not say it may",
            ),
            (
                "connected twice",
                vec![],
                vec![Event::Connected, Event::Connected],
                "twice",
            ),
            (
                "connected late",
                vec![],
                vec![Event::Urgent, Event::Connected],
                "after 1 other",
            ),
        ];
        for (name, offers, evs, want) in cases {
            let mut c = EventCheck::new();
            for (token, len, src) in offers {
                if src {
                    c.offer_src(token, len).unwrap();
                } else {
                    c.offer_sink(token, len).unwrap();
                }
            }
            let err = feed(&mut c, &evs, false).expect_err(name);
            assert!(err.contains(want), "{name}: {err}");
        }
        // Offers: the same token twice, and one accepted after the end.
        let mut c = EventCheck::new();
        c.offer_src(1, 10).unwrap();
        assert!(c.offer_sink(1, 10).unwrap_err().contains("twice"));
        let mut c = EventCheck::new();
        c.event(&Event::Closed(None), false).unwrap();
        assert!(c.offer_src(2, 10).unwrap_err().contains("after Closed"));
    }
}
