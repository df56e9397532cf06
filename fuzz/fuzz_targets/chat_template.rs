//! Any user content through the default model's chat template (minijinja): up to eight messages cut
//! at NUL bytes, roles chosen by the first byte. Errors are fine; a panic or hang is a finding.
#![no_main]

#[path = "common.rs"]
mod common;

use libfuzzer_sys::fuzz_target;
use serde_json::json;
use tandem_api::TextCodec;

const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

fuzz_target!(|data: &[u8]| {
    let Some((&roles, rest)) = data.split_first() else {
        return;
    };
    let messages: Vec<_> = rest
        .split(|&b| b == 0)
        .take(8)
        .enumerate()
        .map(|(i, part)| {
            let role = ROLES[(roles as usize >> (i % 4 * 2)) & 3];
            json!({"role": role, "content": String::from_utf8_lossy(part)})
        })
        .collect();
    let codec = common::codec();
    let no_kwargs = serde_json::Map::new();
    if let Ok(text) = codec.render_chat(&messages, roles & 1 == 0, None, &no_kwargs) {
        let _ = codec.encode(&text, false);
    }
});
