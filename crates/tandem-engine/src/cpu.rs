//! The CPU backend: `tandem_model::CpuLlama` plus the paged `KvCache` it reads and writes.

use crate::backend::{Backend, BackendError};
use tandem_model::{CpuLlama, ForwardBatch, KvCache, KvDtype, KvLayout};

/// The Llama-family model on CPU with a KV cache sized from a byte budget.
pub struct CpuBackend {
    model: CpuLlama,
    kv: KvCache,
    eos: Vec<u32>,
}

impl CpuBackend {
    /// Sizes the KV cache to as many `block_size`-token blocks as `kv_cache_bytes` holds across all layers.
    pub fn new(model: CpuLlama, block_size: usize, kv_cache_bytes: usize) -> CpuBackend {
        let c = model.config();
        let num_blocks = KvLayout::blocks_for_budget(
            kv_cache_bytes,
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            block_size,
            KvDtype::F32,
        );
        let eos = c.eos_token_ids.clone();
        let kv = KvCache::new(model.kv_layout(block_size, num_blocks));
        tracing::info!(num_blocks, block_size, "CPU KV cache allocated");
        CpuBackend { model, kv, eos }
    }
}

impl Backend for CpuBackend {
    fn kv_layout(&self) -> KvLayout {
        *self.kv.layout()
    }

    fn vocab_size(&self) -> usize {
        self.model.config().vocab_size
    }

    fn max_model_len(&self) -> usize {
        self.model.config().max_position_embeddings
    }

    fn eos_token_ids(&self) -> &[u32] {
        &self.eos
    }

    fn forward(&mut self, batch: &ForwardBatch, logits: &mut Vec<f32>) -> Result<(), BackendError> {
        self.model
            .forward(batch, &mut self.kv, logits)
            .map_err(|e| BackendError::new(e.to_string()))
    }

    fn export_block(&self, layer: usize, block: u32, out: &mut [u8]) {
        self.kv.export_block(layer, block, out);
    }

    fn import_block(&mut self, layer: usize, block: u32, data: &[u8]) {
        self.kv.import_block(layer, block, data);
    }

    fn copy_block(&mut self, src: u32, dst: u32) {
        self.kv.copy_block(src, dst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Engine, EngineConfig, EngineHandle, RequestStream};
    use crate::types::{EngineRequest, RequestMode, SamplingParams};
    use proptest::prelude::*;
    use std::path::PathBuf;
    use std::sync::OnceLock;
    use std::time::Duration;

    /// The default model, loaded once per test binary; None (tests skip) when the file is absent.
    fn model() -> Option<&'static tandem_model::LoadedModel> {
        static MODEL: OnceLock<Option<tandem_model::LoadedModel>> = OnceLock::new();
        MODEL
            .get_or_init(|| {
                let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                    .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
                if !path.exists() {
                    eprintln!(
                        "skipping CPU engine tests: {} is absent (run scripts/fetch-model.sh)",
                        path.display()
                    );
                    return None;
                }
                Some(
                    tandem_model::load(&path, &tandem_model::LoadOptions::default())
                        .expect("default model loads"),
                )
            })
            .as_ref()
    }

    fn engine(
        m: &tandem_model::LoadedModel,
        kv_blocks: usize,
        f: impl FnOnce(&mut EngineConfig),
    ) -> EngineHandle {
        let llama = CpuLlama::new(m.config.clone(), m.weights.clone(), 2);
        let per_block = llama.kv_layout(4, 1).block_bytes() * m.config.num_layers;
        let mut cfg = EngineConfig {
            block_size: 4,
            ..Default::default()
        };
        f(&mut cfg);
        Engine::start(CpuBackend::new(llama, 4, per_block * kv_blocks), cfg).unwrap()
    }

    fn greedy(max_tokens: usize) -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        }
    }

    fn collect(s: &mut RequestStream) -> Vec<u32> {
        let mut out = Vec::new();
        while let Some(o) = s.blocking_recv() {
            out.push(o.token);
        }
        assert!(s.error().is_none(), "{:?}", s.error());
        out
    }

    fn alone(e: &EngineHandle, id: u64, prompt: &[u32], n: usize) -> Vec<u32> {
        collect(
            &mut e
                .submit(EngineRequest::new(id, prompt.to_vec(), greedy(n)))
                .unwrap(),
        )
    }

    #[test]
    fn kv_cache_is_sized_from_the_byte_budget() {
        let Some(m) = model() else { return };
        let llama = CpuLlama::new(m.config.clone(), m.weights.clone(), 1);
        let b = CpuBackend::new(llama, 16, 64 << 20);
        let l = b.kv_layout();
        assert_eq!(l.block_size, 16);
        assert_eq!(l.num_blocks, (64 << 20) / (l.block_bytes() * l.n_layers));
        assert_eq!(b.vocab_size(), m.config.vocab_size);
    }

    #[test]
    fn pd_transfer_on_cpu_matches_colocated_greedy() {
        let Some(m) = model() else { return };
        let prompt: Vec<u32> = vec![1, 504, 3070, 314, 260, 2767, 282, 4649, 30, 216, 2];
        let a = engine(m, 64, |c| c.max_num_batched_tokens = 6);
        let want = alone(&a, 100, &prompt, 5);
        let req = EngineRequest {
            id: 1,
            prompt: prompt.clone(),
            params: greedy(5),
            mode: RequestMode::PrefillOnly {
                pin_timeout: Duration::from_secs(60),
            },
        };
        let first = collect(&mut a.submit(req).unwrap());
        assert_eq!(first, want[..1]);
        let kv = a.export_blocks(1).wait_blocking().unwrap();
        let b = engine(m, 64, |_| {});
        let (mut s, plan) = b
            .import_prefilled(EngineRequest::new(1, prompt, greedy(5)), first[0])
            .unwrap();
        assert_eq!(plan.wait_blocking().unwrap().num_blocks, kv.num_blocks);
        for layer in 0..kv.layout.n_layers {
            for blk in 0..kv.num_blocks {
                b.import_block(1, layer, blk, kv.block(layer, blk).to_vec())
                    .wait_blocking()
                    .unwrap();
            }
        }
        b.start_decoding(1).wait_blocking().unwrap();
        a.release_pin(1);
        assert_eq!(collect(&mut s), want);
        let st = b.checked_stats().wait_blocking().unwrap();
        assert_eq!((st.prefill_tokens_computed, st.kv_blocks_used), (0, 0));
        assert_eq!(a.checked_stats().wait_blocking().unwrap().kv_blocks_used, 0);
        a.shutdown();
        b.shutdown();
    }

    #[test]
    fn abort_mid_generation_frees_blocks_on_cpu() {
        let Some(m) = model() else { return };
        let e = engine(m, 64, |_| {});
        let mut s = e
            .submit(EngineRequest::new(1, vec![1, 504, 3070, 314], greedy(1000)))
            .unwrap();
        assert!(s.blocking_recv().unwrap().finish.is_none());
        drop(s);
        assert_eq!(e.checked_stats().wait_blocking().unwrap().kv_blocks_used, 0);
        e.shutdown();
    }

    proptest! {
        // The real model on 2 shared cores is slow: a handful of cases, short generations.
        #![proptest_config(ProptestConfig::with_cases(3))]
        #[test]
        fn real_model_batching_matches_running_alone(
            tails in proptest::collection::vec(proptest::collection::vec(300..5000u32, 1..9), 2..5),
            kv_blocks in 12..20usize,
            budget in 5..16usize,
        ) {
            let Some(m) = model() else { return Ok(()) };
            // A shared 8-token head so the prefix cache hits; tiny pools force preemption.
            let head = [1u32, 504, 3070, 314, 260, 2767, 282, 4649];
            let prompts: Vec<Vec<u32>> = tails.iter().map(|t| head.iter().chain(t).copied().collect()).collect();
            let solo = engine(m, 256, |c| c.enable_prefix_caching = false);
            let want: Vec<Vec<u32>> = prompts.iter().enumerate().map(|(i, p)| alone(&solo, i as u64, p, 4)).collect();
            solo.shutdown();
            let e = engine(m, kv_blocks, |c| c.max_num_batched_tokens = budget);
            let mut streams: Vec<_> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| e.submit(EngineRequest::new(i as u64, p.clone(), greedy(4))).unwrap())
                .collect();
            for (w, s) in want.iter().zip(&mut streams) {
                prop_assert_eq!(&collect(s), w);
            }
            let st = e.checked_stats().wait_blocking().unwrap();
            prop_assert_eq!(st.kv_blocks_used, 0);
            e.shutdown();
        }
    }
}
