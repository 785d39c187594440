use sdp_core::proto::Config;
use sdp_tests::pair::Pair;

#[test]
fn hello_world() {
    let mut p = Pair::new(1, Config::default());
    let (a, b) = p.connect();
    let now = p.now();
    let mut all = Vec::new();
    for i in 0..5000u32 {
        all.extend_from_slice(&i.to_be_bytes());
    }
    let n = p.a.write(now, a, &all).unwrap();
    assert_eq!(n, all.len());
    let mut got = Vec::new();
    p.run_until(1_000_000_000, |p| {
        let now = p.now();
        let mut buf = [0u8; 777];
        while let Ok(k) = p.b.read(now, b, &mut buf) {
            if k == 0 {
                break;
            }
            got.extend_from_slice(&buf[..k]);
        }
        got.len() >= all.len()
    });
    assert_eq!(got.len(), all.len());
    let pos = got.iter().zip(&all).position(|(x, y)| x != y);
    assert_eq!(
        pos,
        None,
        "got {:?} want {:?}",
        &got[pos.unwrap_or(0)..pos.unwrap_or(0) + 16],
        &all[pos.unwrap_or(0)..pos.unwrap_or(0) + 16]
    );
}

#[test]
fn many_small_writes() {
    let mut p = Pair::new(1, Config::default());
    let (a, b) = p.connect();
    let mut all = Vec::new();
    for i in 0..50000u32 {
        all.extend_from_slice(&i.to_be_bytes());
    }
    let mut off = 0;
    let mut got = Vec::new();
    p.run_until(10_000_000_000, |p| {
        let now = p.now();
        while off < all.len() {
            let end = (off + 1000).min(all.len());
            match p.a.write(now, a, &all[off..end]) {
                Ok(n) => off += n,
                Err(_) => break,
            }
        }
        let mut buf = [0u8; 777];
        while let Ok(k) = p.b.read(now, b, &mut buf) {
            if k == 0 {
                break;
            }
            got.extend_from_slice(&buf[..k]);
        }
        got.len() >= all.len()
    });
    assert_eq!(got.len(), all.len());
    let pos = got.iter().zip(&all).position(|(x, y)| x != y);
    assert_eq!(
        pos,
        None,
        "got {:?} want {:?}",
        &got[pos.unwrap_or(0)..pos.unwrap_or(0) + 16],
        &all[pos.unwrap_or(0)..pos.unwrap_or(0) + 16]
    );
}

#[test]
fn duplex_simple() {
    let mut p = Pair::new(1, Config::default());
    let (a, b) = p.connect();
    let mut all = Vec::new();
    for i in 0..50000u32 {
        all.extend_from_slice(&i.to_be_bytes());
    }
    let (mut offa, mut offb) = (0, 0);
    let (mut gota, mut gotb) = (Vec::new(), Vec::new());
    p.run_until(10_000_000_000, |p| {
        let now = p.now();
        while offa < all.len() {
            let end = (offa + 1000).min(all.len());
            match p.a.write(now, a, &all[offa..end]) {
                Ok(n) => offa += n,
                Err(_) => break,
            }
        }
        while offb < all.len() {
            let end = (offb + 3000).min(all.len());
            match p.b.write(now, b, &all[offb..end]) {
                Ok(n) => offb += n,
                Err(_) => break,
            }
        }
        let mut buf = [0u8; 777];
        while let Ok(k) = p.b.read(now, b, &mut buf) {
            if k == 0 {
                break;
            }
            gotb.extend_from_slice(&buf[..k]);
        }
        while let Ok(k) = p.a.read(now, a, &mut buf) {
            if k == 0 {
                break;
            }
            gota.extend_from_slice(&buf[..k]);
        }
        gota.len() >= all.len() && gotb.len() >= all.len()
    });
    for got in [&gota, &gotb] {
        assert_eq!(got.len(), all.len());
        let pos = got.iter().zip(&all).position(|(x, y)| x != y);
        assert_eq!(
            pos,
            None,
            "got {:?} want {:?}",
            &got[pos.unwrap_or(0)..pos.unwrap_or(0) + 16],
            &all[pos.unwrap_or(0)..pos.unwrap_or(0) + 16]
        );
    }
}
