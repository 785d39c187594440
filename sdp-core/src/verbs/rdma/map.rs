//! Pure translations between the verbs/CM C values and the provider layer's types. No FFI calls
//! and no device: everything here is unit-tested on the host.

use crate::verbs::{Access, CmEvent, VerbsError, WcOpcode, WcStatus};

// ibv_wc_status values (verbs.h); spelled out so the mapping is testable without bindings.
pub(crate) const WC_SUCCESS: u32 = 0;
pub(crate) const WC_LOC_LEN_ERR: u32 = 1;
pub(crate) const WC_LOC_QP_OP_ERR: u32 = 2;
pub(crate) const WC_LOC_PROT_ERR: u32 = 4;
pub(crate) const WC_WR_FLUSH_ERR: u32 = 5;
pub(crate) const WC_LOC_ACCESS_ERR: u32 = 8;
pub(crate) const WC_REM_ACCESS_ERR: u32 = 10;
pub(crate) const WC_RETRY_EXC_ERR: u32 = 12;
pub(crate) const WC_RNR_RETRY_EXC_ERR: u32 = 13;

// ibv_wc_opcode values.
pub(crate) const WC_OP_SEND: u32 = 0;
pub(crate) const WC_OP_RDMA_WRITE: u32 = 1;
pub(crate) const WC_OP_RDMA_READ: u32 = 2;
pub(crate) const WC_OP_RECV: u32 = 128;

// ibv_access_flags values.
pub(crate) const ACCESS_LOCAL_WRITE: u32 = 1;
pub(crate) const ACCESS_REMOTE_WRITE: u32 = 2;
pub(crate) const ACCESS_REMOTE_READ: u32 = 4;

// rdma_cm_event_type values (rdma_cma.h).
pub(crate) const EV_ADDR_RESOLVED: u32 = 0;
pub(crate) const EV_ADDR_ERROR: u32 = 1;
pub(crate) const EV_ROUTE_RESOLVED: u32 = 2;
pub(crate) const EV_ROUTE_ERROR: u32 = 3;
pub(crate) const EV_CONNECT_REQUEST: u32 = 4;
pub(crate) const EV_CONNECT_RESPONSE: u32 = 5;
pub(crate) const EV_CONNECT_ERROR: u32 = 6;
pub(crate) const EV_UNREACHABLE: u32 = 7;
pub(crate) const EV_REJECTED: u32 = 8;
pub(crate) const EV_ESTABLISHED: u32 = 9;
pub(crate) const EV_DISCONNECTED: u32 = 10;
pub(crate) const EV_DEVICE_REMOVAL: u32 = 11;
pub(crate) const EV_ADDR_CHANGE: u32 = 14;
pub(crate) const EV_TIMEWAIT_EXIT: u32 = 15;

/// IB CM reject reason "consumer defined" (`IB_CM_REJ_CONSUMER_DEFINED`): the peer's application
/// called `rdma_reject`. Other reasons (8 = invalid service id, i.e. nobody listens on the
/// port; timeouts; stale connections) come from the CM itself.
pub(crate) const IB_CM_REJ_CONSUMER_DEFINED: i32 = 28;

/// The device's transport, as far as the provider must tell them apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transport {
    /// InfiniBand and RoCE (both use the IB CM and its reject reasons).
    Ib,
    /// iWARP (TCP-based CM: MPA rejects, and RDMA Read sinks need remote-write access).
    Iwarp,
}

/// `ibv_wc_status` folded onto [`WcStatus`].
pub(crate) fn wc_status(status: u32) -> WcStatus {
    match status {
        WC_SUCCESS => WcStatus::Success,
        WC_WR_FLUSH_ERR => WcStatus::Flushed,
        WC_LOC_LEN_ERR | WC_LOC_PROT_ERR | WC_LOC_ACCESS_ERR => WcStatus::LocalProtection,
        // Not a protection error: siw reports a send its TCP stream failed under (a peer
        // that closed or reset the connection) so.
        WC_LOC_QP_OP_ERR => WcStatus::LocalQpOp,
        WC_REM_ACCESS_ERR => WcStatus::RemoteAccess,
        WC_RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExceeded,
        WC_RETRY_EXC_ERR => WcStatus::RetryExceeded,
        other => WcStatus::Other(other),
    }
}

/// `ibv_wc_opcode` of a successful completion. Verbs leaves the opcode of an error completion
/// undefined; the engine routes completions by `wr_id`, so `fallback` is reported then.
pub(crate) fn wc_opcode(opcode: u32, fallback: WcOpcode) -> WcOpcode {
    match opcode {
        WC_OP_SEND => WcOpcode::Send,
        WC_OP_RDMA_WRITE => WcOpcode::RdmaWrite,
        WC_OP_RDMA_READ => WcOpcode::RdmaRead,
        WC_OP_RECV => WcOpcode::Recv,
        _ => fallback,
    }
}

/// The `ibv_access_flags` for a region (or a grant) that needs `access`. Remote write without
/// local write is refused, as `ibv_reg_mr` does. On iWARP an RDMA Read places its data with
/// what the standard models as a remote write tagged with the sink's key, so memory asked for
/// as a Read sink ([`Access::READ_SINK`]) also gets remote write there; IB and RoCE need no
/// more than local write. Nothing else gets a right it did not ask for.
pub(crate) fn access_flags(access: Access, transport: Transport) -> Result<u32, VerbsError> {
    if access.intersects(Access::REMOTE_WRITE | Access::READ_SINK)
        && !access.contains(Access::LOCAL_WRITE)
    {
        return Err(VerbsError::Invalid(
            "REMOTE_WRITE and READ_SINK need LOCAL_WRITE",
        ));
    }
    let mut f = 0;
    if access.contains(Access::LOCAL_WRITE) {
        f |= ACCESS_LOCAL_WRITE;
    }
    if access.contains(Access::READ_SINK) && transport == Transport::Iwarp {
        f |= ACCESS_REMOTE_WRITE;
    }
    if access.contains(Access::REMOTE_WRITE) {
        f |= ACCESS_REMOTE_WRITE;
    }
    if access.contains(Access::REMOTE_READ) {
        f |= ACCESS_REMOTE_READ;
    }
    Ok(f)
}

/// Whether `flags` give a peer anything.
pub(crate) fn remote_flags(flags: u32) -> bool {
    flags & (ACCESS_REMOTE_WRITE | ACCESS_REMOTE_READ) != 0
}

/// Whether a REJECTED event came from the peer's application (`rdma_reject`) rather than from
/// the CM (nobody listening, a timeout). IB/RoCE say so in the status (the IB CM reject
/// reason). iWARP reports `-ECONNREFUSED` for both a peer's MPA reject and a TCP reset, so
/// there only a reject carrying private data counts as the consumer's.
pub(crate) fn reject_is_consumer(status: i32, private_data: &[u8], transport: Transport) -> bool {
    match transport {
        Transport::Ib => status == IB_CM_REJ_CONSUMER_DEFINED,
        Transport::Iwarp => private_data.iter().any(|&b| b != 0),
    }
}

/// IB pads reject private data with zeros to 148 bytes; the padding is not the peer's.
pub(crate) fn trim_padding(data: &[u8]) -> &[u8] {
    let end = data.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    &data[..end]
}

/// What an endpoint's CM event means for the engine, for the events that map one to one.
/// `ADDR_RESOLVED`, `ROUTE_RESOLVED` and `CONNECT_REQUEST` are steps the provider takes
/// itself (`None` here); so are `CONNECT_RESPONSE` (never produced when the id has a QP, as
/// ours always do) and multicast events (unused).
pub(crate) fn cm_event(
    event: u32,
    status: i32,
    private_data: &[u8],
    transport: Transport,
) -> Option<CmEvent> {
    Some(match event {
        EV_ADDR_ERROR => CmEvent::AddrError,
        EV_ROUTE_ERROR => CmEvent::RouteError,
        EV_UNREACHABLE => CmEvent::Unreachable,
        EV_REJECTED => CmEvent::Rejected {
            consumer: reject_is_consumer(status, private_data, transport),
            private_data: trim_padding(private_data).to_vec(),
        },
        EV_CONNECT_ERROR => CmEvent::ConnectError,
        EV_ESTABLISHED => CmEvent::Established {
            private_data: private_data.to_vec(),
        },
        EV_DISCONNECTED => CmEvent::Disconnected,
        EV_DEVICE_REMOVAL => CmEvent::DeviceRemoval,
        EV_ADDR_CHANGE => CmEvent::AddrChange,
        EV_TIMEWAIT_EXIT => CmEvent::TimewaitExit,
        _ => return None,
    })
}

/// A readable name of a CM event type, for error messages.
pub(crate) fn cm_event_name(event: u32) -> &'static str {
    match event {
        EV_ADDR_RESOLVED => "ADDR_RESOLVED",
        EV_ADDR_ERROR => "ADDR_ERROR",
        EV_ROUTE_RESOLVED => "ROUTE_RESOLVED",
        EV_ROUTE_ERROR => "ROUTE_ERROR",
        EV_CONNECT_REQUEST => "CONNECT_REQUEST",
        EV_CONNECT_RESPONSE => "CONNECT_RESPONSE",
        EV_CONNECT_ERROR => "CONNECT_ERROR",
        EV_UNREACHABLE => "UNREACHABLE",
        EV_REJECTED => "REJECTED",
        EV_ESTABLISHED => "ESTABLISHED",
        EV_DISCONNECTED => "DISCONNECTED",
        EV_DEVICE_REMOVAL => "DEVICE_REMOVAL",
        EV_ADDR_CHANGE => "ADDR_CHANGE",
        EV_TIMEWAIT_EXIT => "TIMEWAIT_EXIT",
        _ => "other",
    }
}

/// An errno from a librdmacm/libibverbs call as a [`VerbsError`].
pub(crate) fn errno_error(errno: i32, what: &'static str) -> VerbsError {
    match errno {
        libc::EADDRINUSE => VerbsError::AddrInUse,
        libc::EADDRNOTAVAIL => VerbsError::AddrNotAvailable,
        libc::ENOMEM => VerbsError::QueueFull(what),
        libc::EINVAL => VerbsError::Invalid(what),
        libc::ENODEV | libc::ENXIO => VerbsError::NoDevice(format!("{what}: device gone")),
        e => VerbsError::Os(format!("{what}: {}", std::io::Error::from_raw_os_error(e))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wc_status_mapping() {
        assert_eq!(wc_status(0), WcStatus::Success);
        assert_eq!(wc_status(5), WcStatus::Flushed);
        assert_eq!(wc_status(4), WcStatus::LocalProtection);
        assert_eq!(wc_status(1), WcStatus::LocalProtection);
        assert_eq!(wc_status(2), WcStatus::LocalQpOp);
        assert_eq!(wc_status(10), WcStatus::RemoteAccess);
        assert_eq!(wc_status(12), WcStatus::RetryExceeded);
        assert_eq!(wc_status(13), WcStatus::RnrRetryExceeded);
        // Remote invalid request and remote operation errors keep their number (the simulator
        // reports the same values for the same failures).
        assert_eq!(
            wc_status(9),
            WcStatus::Other(crate::verbs::sim::WC_REM_INV_REQ_ERR)
        );
        assert_eq!(
            wc_status(11),
            WcStatus::Other(crate::verbs::sim::WC_REM_OP_ERR)
        );
        assert_eq!(wc_status(21), WcStatus::Other(21));
    }

    #[test]
    fn wc_opcode_mapping() {
        assert_eq!(wc_opcode(0, WcOpcode::Recv), WcOpcode::Send);
        assert_eq!(wc_opcode(1, WcOpcode::Recv), WcOpcode::RdmaWrite);
        assert_eq!(wc_opcode(2, WcOpcode::Recv), WcOpcode::RdmaRead);
        assert_eq!(wc_opcode(128, WcOpcode::Send), WcOpcode::Recv);
        assert_eq!(wc_opcode(77, WcOpcode::RdmaRead), WcOpcode::RdmaRead);
    }

    #[test]
    fn access_least_privilege() {
        let ib = Transport::Ib;
        assert_eq!(access_flags(Access::empty(), ib), Ok(0));
        assert_eq!(access_flags(Access::LOCAL_WRITE, ib), Ok(1));
        assert_eq!(
            access_flags(Access::LOCAL_WRITE | Access::REMOTE_WRITE, ib),
            Ok(3)
        );
        assert_eq!(access_flags(Access::REMOTE_READ, ib), Ok(4));
        assert!(access_flags(Access::REMOTE_WRITE, ib).is_err());
        // A Read sink needs nothing more on IB.
        assert_eq!(
            access_flags(Access::LOCAL_WRITE | Access::READ_SINK, ib),
            Ok(1)
        );
        assert!(access_flags(Access::READ_SINK, ib).is_err());
        // iWARP: RDMA Read sinks need remote write, and only they get it.
        let iw = Transport::Iwarp;
        assert_eq!(access_flags(Access::LOCAL_WRITE, iw), Ok(1));
        assert_eq!(
            access_flags(Access::LOCAL_WRITE | Access::READ_SINK, iw),
            Ok(3)
        );
        assert_eq!(access_flags(Access::REMOTE_READ, iw), Ok(4));
        assert_eq!(access_flags(Access::empty(), iw), Ok(0));
        assert!(!remote_flags(1));
        assert!(remote_flags(3) && remote_flags(4));
    }

    #[test]
    fn reject_reasons() {
        let ib = Transport::Ib;
        // rdma_reject by the peer's application
        assert!(reject_is_consumer(28, b"SDP: bad hello", ib));
        // nobody listens (IB_CM_REJ_INVALID_SERVICE_ID), or a CM timeout
        assert!(!reject_is_consumer(8, &[0; 148], ib));
        assert!(!reject_is_consumer(1, &[], ib));
        let iw = Transport::Iwarp;
        assert!(reject_is_consumer(-libc::ECONNREFUSED, b"why", iw));
        assert!(!reject_is_consumer(-libc::ECONNREFUSED, &[], iw));
        assert!(!reject_is_consumer(-libc::ECONNREFUSED, &[0, 0], iw));
    }

    #[test]
    fn cm_events() {
        let ib = Transport::Ib;
        let mut padded = b"SDP: no".to_vec();
        padded.resize(148, 0);
        assert_eq!(
            cm_event(EV_REJECTED, 28, &padded, ib),
            Some(CmEvent::Rejected {
                private_data: b"SDP: no".to_vec(),
                consumer: true
            })
        );
        assert_eq!(
            cm_event(EV_REJECTED, 8, &[0; 148], ib),
            Some(CmEvent::Rejected {
                private_data: vec![],
                consumer: false
            })
        );
        assert_eq!(
            cm_event(EV_ESTABLISHED, 0, b"ack\0\0", ib),
            Some(CmEvent::Established {
                private_data: b"ack\0\0".to_vec()
            })
        );
        assert_eq!(
            cm_event(EV_ADDR_ERROR, -110, &[], ib),
            Some(CmEvent::AddrError)
        );
        assert_eq!(
            cm_event(EV_ROUTE_ERROR, -110, &[], ib),
            Some(CmEvent::RouteError)
        );
        assert_eq!(
            cm_event(EV_UNREACHABLE, -110, &[], ib),
            Some(CmEvent::Unreachable)
        );
        assert_eq!(
            cm_event(EV_CONNECT_ERROR, -1, &[], ib),
            Some(CmEvent::ConnectError)
        );
        assert_eq!(
            cm_event(EV_DISCONNECTED, 0, &[], ib),
            Some(CmEvent::Disconnected)
        );
        assert_eq!(
            cm_event(EV_DEVICE_REMOVAL, 0, &[], ib),
            Some(CmEvent::DeviceRemoval)
        );
        assert_eq!(
            cm_event(EV_ADDR_CHANGE, 0, &[], ib),
            Some(CmEvent::AddrChange)
        );
        assert_eq!(
            cm_event(EV_TIMEWAIT_EXIT, 0, &[], ib),
            Some(CmEvent::TimewaitExit)
        );
        for internal in [
            EV_ADDR_RESOLVED,
            EV_ROUTE_RESOLVED,
            EV_CONNECT_REQUEST,
            EV_CONNECT_RESPONSE,
            12,
            13,
        ] {
            assert_eq!(cm_event(internal, 0, &[], ib), None, "{internal}");
        }
        assert_eq!(cm_event_name(EV_REJECTED), "REJECTED");
    }

    #[test]
    fn errno_mapping() {
        assert_eq!(errno_error(libc::EADDRINUSE, "bind"), VerbsError::AddrInUse);
        assert_eq!(
            errno_error(libc::EADDRNOTAVAIL, "bind"),
            VerbsError::AddrNotAvailable
        );
        assert_eq!(
            errno_error(libc::ENOMEM, "post"),
            VerbsError::QueueFull("post")
        );
        assert!(matches!(errno_error(libc::EIO, "x"), VerbsError::Os(m) if m.starts_with("x: ")));
    }
}
