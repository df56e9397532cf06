//! What the engine's test files share: submitting and importing requests that the engine must take,
//! and reading a stream to its end.

// Each test file uses part of this module.
#![allow(dead_code)]

use tandem_engine::*;

/// Submits a normal request that the engine must accept.
pub fn submit(
    e: &EngineHandle,
    id: RequestId,
    prompt: Vec<u32>,
    params: SamplingParams,
) -> RequestStream {
    e.submit(EngineRequest::new(id, prompt, params)).unwrap()
}

/// `n` concurrent requests (ids `0..n`) of the same prompt and parameters.
pub fn submit_n(
    e: &EngineHandle,
    n: RequestId,
    prompt: &[u32],
    params: &SamplingParams,
) -> Vec<RequestStream> {
    (0..n)
        .map(|id| submit(e, id, prompt.to_vec(), params.clone()))
        .collect()
}

/// Imports a prefilled request whose first token is `first_token`, which the engine must accept: its
/// stream and the import's plan.
pub fn import(
    e: &EngineHandle,
    id: RequestId,
    prompt: Vec<u32>,
    params: SamplingParams,
    first_token: u32,
) -> (RequestStream, Pending<ImportPlan>) {
    e.import_prefilled(EngineRequest::new(id, prompt, params), first_token)
        .unwrap()
}

/// The stream's tokens through its finish (`None` when it ended without one).
pub fn collect(s: &mut RequestStream) -> (Vec<u32>, Option<FinishReason>) {
    let mut toks = Vec::new();
    while let Some(o) = s.blocking_recv() {
        toks.push(o.token);
        if o.finish.is_some() {
            return (toks, o.finish);
        }
    }
    (toks, None)
}
