//! The checked byte streams: stream `seed` holds, at every offset `o`, byte `o % 8` (little
//! endian) of `word(seed, o / 8)`. Any piece of it can be made or checked on its own, so a
//! writer and a reader that cut the stream differently agree on every byte, and a reordered,
//! duplicated, lost or foreign piece shows up as bad bytes at a known offset.

/// Word `i` of stream `seed` (SplitMix64 output `i + 1` from state `seed`).
#[inline]
pub fn word(seed: u64, i: u64) -> u64 {
    let mut z = seed.wrapping_add(i.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fill `buf` with the bytes of stream `seed` from offset `off`.
pub fn fill(seed: u64, off: u64, buf: &mut [u8]) {
    let mut pos = off;
    let mut b = buf;
    // Up to the next word boundary.
    let head = ((8 - pos % 8) % 8) as usize;
    if head > 0 && !b.is_empty() {
        let w = word(seed, pos / 8).to_le_bytes();
        let s = (pos % 8) as usize;
        let n = head.min(b.len());
        b[..n].copy_from_slice(&w[s..s + n]);
        pos += n as u64;
        b = &mut b[n..];
    }
    let mut i = pos / 8;
    let mut chunks = b.chunks_exact_mut(8);
    for c in &mut chunks {
        c.copy_from_slice(&word(seed, i).to_le_bytes());
        i += 1;
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let n = rest.len();
        rest.copy_from_slice(&word(seed, i).to_le_bytes()[..n]);
    }
}

/// Bytes of `buf` that differ from stream `seed` at offset `off`, and the offset of the first.
pub fn check(seed: u64, off: u64, buf: &[u8]) -> (u64, Option<u64>) {
    let mut bad = 0u64;
    let mut first = None;
    let mut note = |at: u64, got: &[u8], want: &[u8]| {
        for (k, (g, w)) in got.iter().zip(want).enumerate() {
            if g != w {
                bad += 1;
                first.get_or_insert(at + k as u64);
            }
        }
    };
    let mut pos = off;
    let mut b = buf;
    let head = ((8 - pos % 8) % 8) as usize;
    if head > 0 && !b.is_empty() {
        let w = word(seed, pos / 8).to_le_bytes();
        let s = (pos % 8) as usize;
        let n = head.min(b.len());
        note(pos, &b[..n], &w[s..s + n]);
        pos += n as u64;
        b = &b[n..];
    }
    let mut i = pos / 8;
    let mut chunks = b.chunks_exact(8);
    for c in &mut chunks {
        let w = word(seed, i);
        let g = u64::from_le_bytes(c.try_into().expect("8 bytes"));
        if g != w {
            note(i * 8, c, &w.to_le_bytes());
        }
        i += 1;
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        note(i * 8, rest, &word(seed, i).to_le_bytes()[..rest.len()]);
    }
    (bad, first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_agree_with_the_whole() {
        let mut whole = vec![0u8; 1000];
        fill(42, 3, &mut whole);
        for cut in [0usize, 1, 5, 7, 8, 9, 13, 500, 999, 1000] {
            let mut a = vec![0u8; cut];
            let mut b = vec![0u8; 1000 - cut];
            fill(42, 3, &mut a);
            fill(42, 3 + cut as u64, &mut b);
            a.extend_from_slice(&b);
            assert_eq!(a, whole, "cut at {cut}");
            assert_eq!(check(42, 3, &whole), (0, None));
            assert_eq!(check(42, 3 + cut as u64, &whole[cut..]), (0, None));
        }
    }

    #[test]
    fn check_counts_and_locates_bad_bytes() {
        let mut v = vec![0u8; 77];
        fill(7, 5, &mut v);
        v[0] ^= 1;
        v[40] ^= 0x80;
        v[76] = v[76].wrapping_add(1);
        assert_eq!(check(7, 5, &v), (3, Some(5)));
        // Another stream, or the same one shifted, is (almost) all bad.
        let mut w = vec![0u8; 64];
        fill(7, 0, &mut w);
        assert!(check(8, 0, &w).0 > 50);
        assert!(check(7, 1, &w).0 > 50);
    }
}
