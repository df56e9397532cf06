//! Any bytes as the JSON bodies of the workers' control API and the head's registration: what a
//! worker parses from the ingress (prefill, decode, release), what the ingress parses from a worker
//! (info, load, stream events, errors) and registration. A panic is a finding.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tandem_cluster::protocol::{
    DecodeRequest, ErrorBody, PrefillRequest, PrefillResponse, RegisterRequest, ReleaseRequest,
    StreamEvent, WorkerInfo, WorkerLoad,
};

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    match which % 9 {
        0 => drop(serde_json::from_slice::<PrefillRequest>(body)),
        1 => drop(serde_json::from_slice::<DecodeRequest>(body)),
        2 => drop(serde_json::from_slice::<ReleaseRequest>(body)),
        3 => drop(serde_json::from_slice::<RegisterRequest>(body)),
        4 => drop(serde_json::from_slice::<PrefillResponse>(body)),
        5 => drop(serde_json::from_slice::<StreamEvent>(body)),
        6 => drop(serde_json::from_slice::<WorkerInfo>(body)),
        7 => drop(serde_json::from_slice::<WorkerLoad>(body)),
        _ => drop(serde_json::from_slice::<ErrorBody>(body)),
    }
});
