//! Feeds arbitrary bytes to the frame decoder (both entry points). It must return frames or
//! errors, never panic, never allocate more than a frame's declared (bounded) size, and
//! every frame it returns must re-encode to bytes that decode again.
//!
//! Run: `cd crates/locker-proto/fuzz && cargo fuzz run decode` (needs cargo-fuzz; on a
//! stable toolchain set RUSTC_BOOTSTRAP=1).
#![no_main]

use libfuzzer_sys::fuzz_target;
use locker_proto::{read_frame, Frame};

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some((frame, used))) = Frame::decode(rest) {
        let mut again = Vec::new();
        frame.encode(&mut again).expect("a decoded frame re-encodes");
        let (_, n) = Frame::decode(&again).expect("re-decode").expect("whole frame");
        assert_eq!(n, again.len());
        rest = &rest[used..];
    }
    let mut r = data;
    let mut scratch = Vec::new();
    while let Ok(Some(_)) = read_frame(&mut r, &mut scratch) {}
});
