//! `sdpstat` lists this process's live SDP connections with their byte counts.

use std::io::{Read, Write};
use std::process::Command;

use sdp_core::socket::{Options, SdpListener, SdpStream};

#[test]
fn sdpstat_lists_live_connections_with_their_counts() {
    let l = SdpListener::bind_with("127.0.0.1:0", &Options::sdp_only()).unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut b = vec![0u8; 12345];
        s.read_exact(&mut b).unwrap();
        s
    });
    let mut c = SdpStream::connect_with(addr, &Options::sdp_only()).unwrap();
    c.write_all(&vec![7u8; 12345]).unwrap();
    let server = t.join().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_sdpstat"))
        .arg("--json")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let pid = format!("\"pid\":\"{}\"", std::process::id());
    let mine: Vec<&str> = text.lines().filter(|l| l.contains(&pid)).collect();
    assert!(
        mine.iter()
            .any(|l| l.contains("\"bytes_out\":\"12345\"") && l.contains("\"stack\":\"shm\"")),
        "{text}"
    );
    assert!(
        mine.iter().any(
            |l| l.contains("\"bytes_in\":\"12345\"") && l.contains("\"state\":\"Established\"")
        ),
        "{text}"
    );
    drop((c, server));
}
