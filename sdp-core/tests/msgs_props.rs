//! Property tests for the SDP wire messages (`sdp_core::proto::msgs`).
//!
//! * every valid header (+ payload for Data) survives emit → parse unchanged;
//! * `parse` and `parse_private_data` never panic, on arbitrary bytes and on mutations of valid
//!   messages, and whatever they accept is canonical (re-emitting reproduces the input bytes).

use proptest::prelude::*;
use proptest::sample::select;
use sdp_core::proto::msgs::*;

fn arb_flags() -> impl Strategy<Value = BsdhFlags> {
    (0u8..8).prop_map(BsdhFlags::from_bits_truncate)
}

fn arb_version() -> impl Strategy<Value = u8> {
    0x20u8..=0x2F
}

fn arb_rcv_size() -> impl Strategy<Value = u32> {
    prop_oneof![
        Just(MIN_RCV_SIZE),
        Just(MAX_RCV_SIZE),
        MIN_RCV_SIZE..=MAX_RCV_SIZE
    ]
}

fn arb_nonzero_u32() -> impl Strategy<Value = u32> {
    prop_oneof![Just(1u32), Just(u32::MAX), 1u32..]
}

/// A mid and an extended header valid for it.
fn arb_mid_ext() -> BoxedStrategy<(Mid, Ext)> {
    let no_ext = select(vec![
        Mid::DisConn,
        Mid::AbortConn,
        Mid::SendSm,
        Mid::Data,
        Mid::SrcAvailCancel,
        Mid::SinkAvailCancel,
        Mid::SinkCancelAck,
        Mid::SuspCommAck,
    ])
    .prop_map(|mid| (mid, Ext::None));
    let hello = (
        arb_version(),
        select(vec![4u8, 6]),
        any::<u8>(),
        arb_rcv_size(),
        arb_rcv_size(),
        any::<u16>(),
    )
        .prop_map(
            |(version, ip_version, max_adverts, desired_rcv_size, local_rcv_size, src_port)| {
                (
                    Mid::Hello,
                    Ext::Hello(Hello {
                        version,
                        ip_version,
                        max_adverts,
                        desired_rcv_size,
                        local_rcv_size,
                        src_port,
                    }),
                )
            },
        );
    let hello_ack = (arb_version(), any::<u8>(), arb_rcv_size(), arb_rcv_size()).prop_map(
        |(version, max_adverts, actual_rcv_size, desired_rcv_size)| {
            (
                Mid::HelloAck,
                Ext::HelloAck(HelloAck {
                    version,
                    max_adverts,
                    actual_rcv_size,
                    desired_rcv_size,
                }),
            )
        },
    );
    let src_avail = (arb_nonzero_u32(), any::<u32>(), any::<u64>())
        .prop_map(|(len, rkey, vaddr)| (Mid::SrcAvail, Ext::SrcAvail { len, rkey, vaddr }));
    let sink_avail = (arb_nonzero_u32(), any::<u32>(), any::<u64>(), any::<u32>()).prop_map(
        |(len, rkey, vaddr, non_disc)| {
            (
                Mid::SinkAvail,
                Ext::SinkAvail {
                    len,
                    rkey,
                    vaddr,
                    non_disc,
                },
            )
        },
    );
    prop_oneof![
        no_ext,
        hello,
        hello_ack,
        src_avail,
        sink_avail,
        arb_nonzero_u32().prop_map(|len| (Mid::RdmaRdCompl, Ext::RdmaRdCompl { len })),
        arb_nonzero_u32().prop_map(|len| (Mid::RdmaWrCompl, Ext::RdmaWrCompl { len })),
        arb_rcv_size().prop_map(|size| (Mid::ChRcvBuf, Ext::ChRcvBuf { size })),
        arb_rcv_size().prop_map(|size| (Mid::ChRcvBufAck, Ext::ChRcvBufAck { size })),
        any::<u64>().prop_map(|service_id| (Mid::SuspComm, Ext::SuspComm { service_id })),
        any::<u8>().prop_map(|flags| (Mid::ModeChange, Ext::ModeChange { flags })),
    ]
    .boxed()
}

/// A valid header and its payload (non-empty only for Data).
fn arb_message() -> impl Strategy<Value = (Header, Vec<u8>)> {
    (
        arb_mid_ext(),
        arb_flags(),
        any::<u16>(),
        any::<u32>(),
        any::<u32>(),
        proptest::collection::vec(any::<u8>(), 0..300),
    )
        .prop_map(|((mid, ext), flags, bufs, mseq, mseq_ack, payload)| {
            let payload = if mid == Mid::Data {
                payload
            } else {
                Vec::new()
            };
            let header = Header::new(mid, ext, flags, bufs, mseq, mseq_ack, payload.len());
            (header, payload)
        })
}

fn wire(header: &Header, payload: &[u8]) -> Vec<u8> {
    let mut buf = vec![0u8; header.header_len() + payload.len()];
    let n = header.emit(&mut buf).expect("emit of a valid header");
    assert_eq!(n, header.header_len());
    buf[n..].copy_from_slice(payload);
    buf
}

/// Parse `bytes` (and as private data); whatever is accepted must be canonical. Never panics
/// (a panic fails the property).
fn check_parse(bytes: &[u8]) -> Result<(Header, Vec<u8>), WireError> {
    let parsed = Header::parse(bytes).map(|(h, p)| (h, p.to_vec()));
    if let Ok((h, p)) = &parsed {
        assert_eq!(h.bsdh.len as usize, bytes.len());
        assert!(h.bsdh.mid == Mid::Data || p.is_empty());
        assert_eq!(wire(h, p), bytes, "accepted bytes are not canonical");
    }
    if let Ok(h) = Header::parse_private_data(bytes) {
        assert!(matches!(h.bsdh.mid, Mid::Hello | Mid::HelloAck));
        let canon = wire(&h, &[]);
        assert_eq!(&bytes[..canon.len()], &canon[..]);
    }
    parsed
}

#[derive(Debug, Clone)]
enum Mutation {
    /// XOR the byte at index (mod len) with a non-zero mask.
    Flip(usize, u8),
    /// Keep only the first n bytes (n mod len).
    Truncate(usize),
    /// Append bytes.
    Extend(Vec<u8>),
    /// Overwrite the BSDH len field with the current length.
    FixLen,
}

fn arb_mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), 1u8..).prop_map(|(i, m)| Mutation::Flip(i, m)),
        1 => any::<usize>().prop_map(Mutation::Truncate),
        1 => proptest::collection::vec(any::<u8>(), 1..40).prop_map(Mutation::Extend),
        1 => Just(Mutation::FixLen),
    ]
}

fn apply(buf: &mut Vec<u8>, m: &Mutation) {
    match m {
        Mutation::Flip(i, mask) if !buf.is_empty() => {
            let n = buf.len();
            buf[i % n] ^= mask;
        }
        Mutation::Flip(..) => {}
        Mutation::Truncate(n) if !buf.is_empty() => buf.truncate(n % buf.len()),
        Mutation::Truncate(_) => {}
        Mutation::Extend(more) => buf.extend_from_slice(more),
        Mutation::FixLen if buf.len() >= 8 => {
            let n = buf.len() as u32;
            buf[4..8].copy_from_slice(&n.to_be_bytes());
        }
        Mutation::FixLen => {}
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn roundtrip_valid_messages((header, payload) in arb_message()) {
        let bytes = wire(&header, &payload);
        prop_assert_eq!(bytes.len(), header.header_len() + payload.len());
        prop_assert_eq!(bytes.len(), header.bsdh.len as usize);
        let (parsed, got) = Header::parse(&bytes).expect("valid message parses");
        prop_assert_eq!(parsed, header);
        prop_assert_eq!(got, &payload[..]);
        let packet = Packet::new_checked(&bytes[..]).expect("checked view");
        prop_assert_eq!(packet.mid(), Ok(header.bsdh.mid));
        prop_assert_eq!(packet.bufs(), header.bsdh.bufs);
        prop_assert_eq!(packet.mseq(), header.bsdh.mseq);
        prop_assert_eq!(packet.mseq_ack(), header.bsdh.mseq_ack);
        prop_assert_eq!(packet.payload(), &payload[..]);
    }

    #[test]
    fn private_data_ignores_padding(
        (header, _) in arb_message().prop_filter("hello", |(h, _)| {
            matches!(h.bsdh.mid, Mid::Hello | Mid::HelloAck)
        }),
        pad in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut bytes = wire(&header, &[]);
        bytes.extend_from_slice(&pad);
        prop_assert_eq!(Header::parse_private_data(&bytes), Ok(header));
        if !pad.is_empty() {
            let is_length_mismatch =
                matches!(Header::parse(&bytes), Err(WireError::LengthMismatch { .. }));
            prop_assert!(is_length_mismatch);
        }
    }

    #[test]
    fn emit_into_short_buffer_is_truncated((header, _) in arb_message(), cut in 1usize..=36) {
        let have = header.header_len().saturating_sub(cut);
        let mut buf = vec![0u8; have];
        prop_assert_eq!(
            header.emit(&mut buf),
            Err(WireError::Truncated { need: header.header_len(), have })
        );
    }

    #[test]
    fn parse_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
        let _ = check_parse(&bytes);
    }

    /// Arbitrary bytes behind a plausible BSDH (known mid, len = actual length), so the
    /// extended-header checks are reached often.
    #[test]
    fn parse_arbitrary_ext(
        mid in select(Mid::ALL.to_vec()),
        flags in 0u8..8,
        rest in proptest::collection::vec(any::<u8>(), 14..60),
    ) {
        let mut bytes = vec![mid as u8, flags];
        bytes.extend_from_slice(&rest);
        let n = bytes.len() as u32;
        bytes[4..8].copy_from_slice(&n.to_be_bytes());
        match check_parse(&bytes) {
            Ok((h, _)) => prop_assert_eq!(h.bsdh.mid, mid),
            Err(e) => {
                // Mid, flags and len are right: only ext-level errors can remain.
                let ext_level = matches!(
                    e,
                    WireError::Truncated { .. }
                        | WireError::UnexpectedPayload { .. }
                        | WireError::ReservedNonZero { .. }
                        | WireError::OutOfRange { .. }
                        | WireError::BadVersion(_)
                );
                prop_assert!(ext_level, "{:?}", e);
            }
        }
    }

    #[test]
    fn parse_mutated_messages(
        (header, payload) in arb_message(),
        mutations in proptest::collection::vec(arb_mutation(), 1..4),
    ) {
        let original = wire(&header, &payload);
        let mut bytes = original.clone();
        for m in &mutations {
            apply(&mut bytes, m);
        }
        let _ = check_parse(&bytes);
    }

    #[test]
    fn truncated_messages_are_rejected((header, payload) in arb_message(), cut in any::<usize>()) {
        let bytes = wire(&header, &payload);
        let keep = cut % bytes.len();
        let err = check_parse(&bytes[..keep]).unwrap_err();
        let expected = if keep < BSDH_LEN {
            WireError::Truncated { need: BSDH_LEN, have: keep }
        } else if keep < header.header_len() {
            WireError::Truncated { need: header.header_len(), have: keep }
        } else {
            WireError::LengthMismatch { claimed: header.bsdh.len, actual: keep }
        };
        prop_assert_eq!(err, expected);
    }

    #[test]
    fn extended_messages(
        (header, payload) in arb_message(),
        more in proptest::collection::vec(any::<u8>(), 1..40),
    ) {
        let mut bytes = wire(&header, &payload);
        bytes.extend_from_slice(&more);
        // Without fixing the length: always a mismatch.
        prop_assert_eq!(
            check_parse(&bytes).unwrap_err(),
            WireError::LengthMismatch { claimed: header.bsdh.len, actual: bytes.len() }
        );
        // With the length fixed: more payload for Data, an error for everything else.
        apply(&mut bytes, &Mutation::FixLen);
        let mid = header.bsdh.mid;
        match check_parse(&bytes) {
            Ok((h, p)) => {
                prop_assert_eq!(mid, Mid::Data);
                prop_assert_eq!(h.payload_len(), payload.len() + more.len());
                prop_assert_eq!(&p[..payload.len()], &payload[..]);
            }
            Err(e) => prop_assert_eq!(
                e,
                WireError::UnexpectedPayload { mid, len: more.len() }
            ),
        }
    }

    #[test]
    fn single_byte_flips_in_header(
        (header, payload) in arb_message(),
        at in any::<usize>(),
        mask in 1u8..,
    ) {
        let mut bytes = wire(&header, &payload);
        let at = at % header.header_len();
        bytes[at] ^= mask;
        // A flip inside the header either is rejected or yields a different header (the
        // encoding is injective: no two headers share bytes).
        if let Ok((h, _)) = check_parse(&bytes) {
            prop_assert_ne!(h, header);
        }
    }
}
