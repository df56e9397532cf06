//! Any bytes as the JSON bodies of a NIXL pull's control frames, through the checks both sides run
//! before NIXL is called (`tandem_kv::fuzzing`): `NixlPull` as the prefill worker's KV server reads it
//! (the block selection against the pinned transfer, the staged export's per-layer runs) and
//! `NixlOpen` as the decode worker reads it (regions against its pull). The first four bytes pick the
//! transfer's shape (pinned blocks, layers, block bytes, staged or not). The metadata blob inside
//! `NixlOpen` goes to NIXL's C library, which this target does not load. A panic is a finding.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tandem_kv::fuzzing::{nixl_open, nixl_pull};

fuzz_target!(|data: &[u8]| {
    let Some((&[blocks, layers, block_bytes, flags], body)) = data.split_first_chunk::<4>() else {
        return;
    };
    // Shapes a real transfer can have: at least one layer and one block byte, up to 255 blocks.
    let n_blocks = blocks as usize;
    let n_layers = 1 + layers as usize % 64;
    let block_bytes = 1 + block_bytes as usize * 16;
    let pinned: Vec<u32> = (0..n_blocks as u32).map(|i| 1000 + i * 3).collect();
    if flags % 2 == 0 {
        let staged = (flags & 2 != 0).then_some(block_bytes as u64);
        let _ = nixl_pull(body, &pinned, n_layers, staged);
    } else {
        let _ = nixl_open(body, n_layers, n_blocks, block_bytes);
    }
});
