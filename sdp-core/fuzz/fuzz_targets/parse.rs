//! Fuzz the SDP wire parser: `Header::parse` and `Header::parse_private_data` must never panic,
//! and whatever they accept must re-emit to the same bytes and re-parse to the same header.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sdp_core::proto::msgs::{Header, Mid};

fuzz_target!(|data: &[u8]| {
    if let Ok((header, payload)) = Header::parse(data) {
        assert_eq!(header.bsdh.len as usize, data.len());
        assert!(header.bsdh.mid == Mid::Data || payload.is_empty());
        let mut buf = vec![0u8; header.header_len() + payload.len()];
        let n = header.emit(&mut buf).expect("re-emit of a parsed header");
        assert_eq!(n, header.header_len());
        buf[n..].copy_from_slice(payload);
        assert_eq!(buf, data, "parse accepted a non-canonical encoding");
        let (again, again_payload) = Header::parse(&buf).expect("re-parse of an emitted header");
        assert_eq!(again, header);
        assert_eq!(again_payload, payload);
    }
    if let Ok(header) = Header::parse_private_data(data) {
        assert!(matches!(header.bsdh.mid, Mid::Hello | Mid::HelloAck));
        let mut buf = vec![0u8; header.header_len()];
        header
            .emit(&mut buf)
            .expect("re-emit of a parsed Hello/HelloAck");
        assert_eq!(&data[..buf.len()], &buf[..]);
        assert_eq!(Header::parse_private_data(&buf), Ok(header));
        assert_eq!(Header::parse(&buf).map(|(h, _)| h), Ok(header));
    }
});
