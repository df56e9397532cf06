//! The CPU backend: `tandem_model::CpuLlama` plus the paged `KvCache` it reads and writes, optionally
//! split over tensor-parallel ranks that run as threads of this process.
//!
//! It sits beside the CUDA and pipeline backends: the engine knows only its `Backend` seam.

use std::panic::{catch_unwind, AssertUnwindSafe};

use tandem_engine::{Backend, BackendError, BackendErrorKind, BackendInfo};
use tandem_model::{
    CpuLlama, ExpertMap, ExpertPlacement, ForwardBatch, GroupBreaker, KvCache, KvDtype, KvLayout,
    LayerExpertTokens, LlamaWeights, ModelConfig, ModelError, Partition, ThreadCollective,
};

/// One tensor-parallel rank: its share of the model and of every KV block (its KV heads).
struct Rank {
    model: CpuLlama,
    kv: KvCache,
    /// Rank 0 returns the logits; the others' stay empty.
    logits: Vec<f32>,
    /// Breaks the group when this rank fails, so its peers error instead of waiting for it.
    breaker: Option<GroupBreaker>,
}

/// The Llama-family model on CPU with a KV cache sized from a byte budget.
///
/// With tensor parallelism every rank holds all blocks for its own KV heads; the block ids are shared, so
/// the engine's block pool is unaware of the split. Exported blocks are assembled into the canonical
/// all-heads layout (and imports split back), so workers of different tensor-parallel sizes exchange KV.
pub struct CpuBackend {
    ranks: Vec<Rank>,
    info: BackendInfo,
    /// One rank's block bytes during export/import, reused.
    staging: std::cell::RefCell<Vec<u8>>,
}

impl CpuBackend {
    /// Sizes the KV cache to as many `block_size`-token blocks as `kv_cache_bytes` holds across all layers.
    pub fn new(model: CpuLlama, block_size: usize, kv_cache_bytes: usize) -> CpuBackend {
        let layout = KvLayout::for_budget(model.config(), block_size, kv_cache_bytes, KvDtype::F32);
        let kv = KvCache::new(model.kv_layout(block_size, layout.num_blocks));
        tracing::info!(
            num_blocks = layout.num_blocks,
            block_size,
            "CPU KV cache allocated"
        );
        let c = model.config().clone();
        CpuBackend::from_ranks(
            &c,
            vec![Rank {
                model,
                kv,
                logits: Vec::new(),
                breaker: None,
            }],
            layout,
        )
    }

    /// The model split over `tp` tensor-parallel ranks (threads), a mixture of experts' routed experts
    /// placed over them by `placement`, `threads` kernel threads in all (0 = all cores), and a KV budget
    /// of `kv_cache_bytes` across all ranks. Refuses splits that do not fit the model.
    pub fn tensor_parallel(
        config: &ModelConfig,
        weights: &LlamaWeights,
        tp: usize,
        placement: ExpertPlacement,
        threads: usize,
        block_size: usize,
        kv_cache_bytes: usize,
    ) -> Result<CpuBackend, ModelError> {
        let threads = tandem_kernels::resolve_threads(threads);
        let layout = KvLayout::for_budget(config, block_size, kv_cache_bytes, KvDtype::F32);
        let num_blocks = layout.num_blocks;
        let experts = ExpertMap::new(config, tp.max(1), placement)?;
        let ranks = ThreadCollective::group(tp.max(1))
            .into_iter()
            .enumerate()
            .map(|(r, col)| {
                let breaker = (tp > 1).then(|| col.breaker());
                let part = Partition::whole(config).with_rank(r, tp.max(1));
                let collective: Option<Box<dyn tandem_model::Collective>> =
                    (tp > 1).then(|| Box::new(col) as _);
                let rank_threads = (threads / tp.max(1)).max(1);
                let model = CpuLlama::partitioned_with_experts(
                    config.clone(),
                    weights,
                    rank_threads,
                    part,
                    collective,
                    experts.clone(),
                )?;
                let kv = KvCache::new(model.kv_layout(block_size, num_blocks));
                Ok(Rank {
                    model,
                    kv,
                    logits: Vec::new(),
                    breaker,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        tracing::info!(
            num_blocks,
            block_size,
            tp,
            threads,
            "CPU KV cache allocated"
        );
        Ok(CpuBackend::from_ranks(config, ranks, layout))
    }

    fn from_ranks(c: &ModelConfig, ranks: Vec<Rank>, layout: KvLayout) -> Self {
        CpuBackend {
            ranks,
            info: BackendInfo::new(c, layout),
            staging: Default::default(),
        }
    }

    /// Tensor-parallel ranks (1 without tensor parallelism).
    pub fn tp_size(&self) -> usize {
        self.ranks.len()
    }

    /// Refuses a (layer, block) outside the cache or a buffer that is not one block, on which the KV
    /// cache would panic.
    fn check_block(&self, layer: usize, block: u32, len: usize) -> Result<(), BackendError> {
        let l = &self.info.layout;
        if layer < l.n_layers && (block as usize) < l.num_blocks && len == l.block_bytes() {
            return Ok(());
        }
        Err(BackendError::fatal(format!(
            "KV block {block} of layer {layer} with {len} bytes: the cache holds {} blocks of {} bytes in {} layers",
            l.num_blocks,
            l.block_bytes(),
            l.n_layers
        )))
    }

    /// Byte range of rank `r`'s K (part 0) or V (part 1) heads inside one canonical block.
    fn part_range(&self, r: usize, part: usize) -> std::ops::Range<usize> {
        let l = &self.info.layout;
        let head_bytes = l.block_bytes() / (2 * l.n_kv_heads);
        let heads = &self.ranks[r].model.share().kv_heads;
        let base = part * l.n_kv_heads * head_bytes;
        base + heads.start * head_bytes..base + heads.end * head_bytes
    }
}

/// Runs one rank's step, turning a panic into an error and breaking the group so no peer hangs.
fn rank_step(rank: &mut Rank, batch: &ForwardBatch) -> Result<(), BackendError> {
    let Rank {
        model,
        kv,
        logits,
        breaker,
    } = rank;
    match catch_unwind(AssertUnwindSafe(|| model.forward(batch, kv, logits))) {
        // The engine validated the batch: a model that refuses it disagrees with the engine (a bug).
        Ok(r) => r.map_err(|e| BackendError::caused(BackendErrorKind::Fatal, "CPU model", e)),
        // The rank's group is broken for good: no later step can run on these ranks.
        Err(_) => {
            if let Some(b) = breaker {
                b.break_group();
            }
            Err(BackendError::worker_lost(format!(
                "tensor-parallel rank {} failed (panicked)",
                model.partition().tp_rank
            )))
        }
    }
}

impl Backend for CpuBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    /// The ranks' counts added up: under expert parallelism each rank counts only the experts it
    /// holds, so the sum counts every routed row once.
    fn moe_expert_tokens(&self, out: &mut Vec<LayerExpertTokens>) {
        out.clear();
        out.extend(self.ranks[0].model.expert_tokens().cloned());
        for rank in &self.ranks[1..] {
            for (sum, theirs) in out.iter_mut().zip(rank.model.expert_tokens()) {
                debug_assert_eq!(sum.layer, theirs.layer, "ranks hold the same layers");
                sum.tokens
                    .iter_mut()
                    .zip(&theirs.tokens)
                    .for_each(|(a, b)| *a += b);
            }
        }
    }

    fn forward(&mut self, batch: &ForwardBatch, logits: &mut Vec<f32>) -> Result<(), BackendError> {
        let (first, rest) = self.ranks.split_first_mut().expect("at least one rank");
        if rest.is_empty() {
            std::mem::swap(&mut first.logits, logits);
            let r = rank_step(first, batch);
            std::mem::swap(&mut first.logits, logits);
            return r;
        }
        // Rank 0 runs on the engine thread; the others on scoped threads for the step.
        let others = std::thread::scope(|s| {
            let handles: Vec<_> = rest
                .iter_mut()
                .map(|rank| s.spawn(move || rank_step(rank, batch)))
                .collect();
            let mine = rank_step(first, batch);
            let theirs: Vec<_> = handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(BackendError::worker_lost("rank thread died")))
                })
                .collect();
            std::iter::once(mine)
                .chain(theirs)
                .collect::<Result<Vec<()>, _>>()
        });
        others?;
        logits.clear();
        logits.extend_from_slice(&first.logits);
        Ok(())
    }

    fn export_block(&self, layer: usize, block: u32, out: &mut [u8]) -> Result<(), BackendError> {
        self.check_block(layer, block, out.len())?;
        if self.ranks.len() == 1 {
            self.ranks[0].kv.export_block(layer, block, out);
            return Ok(());
        }
        let mut staging = self.staging.borrow_mut();
        for (r, rank) in self.ranks.iter().enumerate() {
            let local = rank.kv.layout().block_bytes();
            staging.resize(local, 0);
            rank.kv.export_block(layer, block, &mut staging);
            for part in 0..2 {
                let dst = self.part_range(r, part);
                let half = local / 2;
                out[dst].copy_from_slice(&staging[part * half..(part + 1) * half]);
            }
        }
        Ok(())
    }

    fn import_block(&mut self, layer: usize, block: u32, data: &[u8]) -> Result<(), BackendError> {
        self.check_block(layer, block, data.len())?;
        if self.ranks.len() == 1 {
            self.ranks[0].kv.import_block(layer, block, data);
            return Ok(());
        }
        let mut staging = std::mem::take(self.staging.get_mut());
        for r in 0..self.ranks.len() {
            let local = self.ranks[r].kv.layout().block_bytes();
            staging.clear();
            for part in 0..2 {
                staging.extend_from_slice(&data[self.part_range(r, part)]);
            }
            debug_assert_eq!(staging.len(), local);
            self.ranks[r].kv.import_block(layer, block, &staging);
        }
        *self.staging.get_mut() = staging;
        Ok(())
    }

    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), BackendError> {
        let bytes = self.info.layout.block_bytes();
        self.check_block(0, src, bytes)?;
        self.check_block(0, dst, bytes)?;
        for rank in &mut self.ranks {
            rank.kv.copy_block(src, dst);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::path::PathBuf;
    use std::sync::OnceLock;
    use std::time::Duration;
    use tandem_engine::{
        Engine, EngineConfig, EngineHandle, EngineRequest, RequestMode, RequestStream,
        SamplingParams,
    };

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
                .submit(EngineRequest::new(
                    id,
                    prompt.to_vec(),
                    SamplingParams::greedy(n),
                ))
                .unwrap(),
        )
    }

    /// Moves request `req.id`'s pinned prefill KV from `p` into `d` block by block, as a transfer
    /// would, starts decoding there and releases the pin; returns the decode stream.
    fn hand_over(
        p: &EngineHandle,
        d: &EngineHandle,
        req: EngineRequest,
        first: u32,
    ) -> RequestStream {
        let id = req.id;
        let kv = p.export_blocks(id).wait_blocking().unwrap();
        let (s, plan) = d.import_prefilled(req, first).unwrap();
        assert_eq!(plan.wait_blocking().unwrap().num_blocks, kv.num_blocks);
        for layer in 0..kv.layout.n_layers {
            for blk in 0..kv.num_blocks {
                d.import_block(id, layer, blk, kv.block(layer, blk).unwrap().to_vec())
                    .wait_blocking()
                    .unwrap();
            }
        }
        d.start_decoding(id).wait_blocking().unwrap();
        p.release_pin(id);
        s
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

    /// A prefill engine holding request 1's pinned prefill of a fixed prompt: (engine, prompt, the
    /// prompt's colocated greedy tokens, the prefill's first token).
    fn prefilled(m: &tandem_model::LoadedModel) -> (EngineHandle, Vec<u32>, Vec<u32>, Vec<u32>) {
        let prompt: Vec<u32> = vec![1, 504, 3070, 314, 260, 2767, 282, 4649, 30, 216, 2];
        let a = engine(m, 64, |c| c.max_num_batched_tokens = 6);
        let want = alone(&a, 100, &prompt, 5);
        let req = EngineRequest {
            id: 1,
            prompt: prompt.clone(),
            params: SamplingParams::greedy(5),
            mode: RequestMode::PrefillOnly {
                pin_timeout: Duration::from_secs(60),
            },
        };
        let first = collect(&mut a.submit(req).unwrap());
        (a, prompt, want, first)
    }

    #[test]
    fn pd_transfer_on_cpu_matches_colocated_greedy() {
        let Some(m) = model() else { return };
        let (a, prompt, want, first) = prefilled(m);
        assert_eq!(first, want[..1]);
        let b = engine(m, 64, |_| {});
        let mut s = hand_over(
            &a,
            &b,
            EngineRequest::new(1, prompt, SamplingParams::greedy(5)),
            first[0],
        );
        assert_eq!(collect(&mut s), want);
        let st = b.checked_stats().wait_blocking().unwrap();
        assert_eq!((st.prefill_tokens_computed, st.kv_blocks_used), (0, 0));
        assert_eq!(a.checked_stats().wait_blocking().unwrap().kv_blocks_used, 0);
        a.shutdown();
        b.shutdown();
    }

    /// The bulk path a transfer takes: one `import_layer` per layer from the export's layer bytes
    /// (in buffers from the engine's host pool), then the fence in `start_decoding`.
    #[test]
    fn pd_transfer_by_whole_layers_matches_colocated_greedy() {
        let Some(m) = model() else { return };
        let (a, prompt, want, first) = prefilled(m);
        let b = engine(m, 64, |_| {});
        let kv = a.export_blocks(1).wait_blocking().unwrap();
        let (mut s, plan) = b
            .import_prefilled(
                EngineRequest::new(1, prompt, SamplingParams::greedy(5)),
                first[0],
            )
            .unwrap();
        assert_eq!(plan.wait_blocking().unwrap().cached, 0);
        // A layer of the wrong size is refused, naming the expectation.
        let short = b.host_pool().take(kv.layout.block_bytes()).unwrap();
        let err = b.import_layer(1, 0, short).wait_blocking().unwrap_err();
        assert!(err.to_string().contains("bad import"), "{err}");
        for layer in 0..kv.layout.n_layers {
            let bytes = kv.layer(layer).unwrap();
            let mut buf = b.host_pool().take(bytes.len()).unwrap();
            buf.as_mut_slice().copy_from_slice(bytes);
            b.import_layer(1, layer, buf).wait_blocking().unwrap();
        }
        b.start_decoding(1).wait_blocking().unwrap();
        a.release_pin(1);
        assert_eq!(collect(&mut s), want);
        let st = b.checked_stats().wait_blocking().unwrap();
        assert_eq!((st.prefill_tokens_computed, st.kv_blocks_used), (0, 0));
        a.shutdown();
        b.shutdown();
    }

    /// An engine over `tp` tensor-parallel ranks (threads) of the default model.
    fn engine_tp(m: &tandem_model::LoadedModel, tp: usize, kv_blocks: usize) -> EngineHandle {
        let layout = CpuLlama::new(m.config.clone(), m.weights.clone(), 1).kv_layout(4, 1);
        let bytes = layout.block_bytes() * m.config.num_layers * kv_blocks;
        let b = CpuBackend::tensor_parallel(
            &m.config,
            &m.weights,
            tp,
            ExpertPlacement::Contiguous,
            2,
            4,
            bytes,
        )
        .unwrap();
        assert_eq!((b.tp_size(), b.kv_layout().num_blocks), (tp, kv_blocks));
        Engine::start(
            b,
            EngineConfig {
                block_size: 4,
                ..Default::default()
            },
        )
        .unwrap()
    }

    #[test]
    fn tensor_parallel_greedy_matches_one_rank() {
        let Some(m) = model() else { return };
        let prompts: [&[u32]; 2] = [
            &[1, 504, 3070, 314, 260, 2767, 282, 4649, 30, 216, 2],
            &[1, 9690, 28, 339, 2107, 30],
        ];
        let one = engine(m, 64, |_| {});
        let want: Vec<Vec<u32>> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| alone(&one, i as u64, p, 12))
            .collect();
        one.shutdown();
        // 3 KV heads: TP=2 splits them 2 + 1, TP=3 one each.
        for tp in [2, 3] {
            let e = engine_tp(m, tp, 64);
            let mut streams: Vec<_> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    e.submit(EngineRequest::new(
                        i as u64,
                        p.to_vec(),
                        SamplingParams::greedy(12),
                    ))
                    .unwrap()
                })
                .collect();
            for (w, s) in want.iter().zip(&mut streams) {
                assert_eq!(&collect(s), w, "tp={tp}");
            }
            e.shutdown();
        }
    }

    #[test]
    fn kv_moves_between_workers_of_different_tensor_parallel_sizes() {
        let Some(m) = model() else { return };
        let prompt: Vec<u32> = vec![1, 504, 3070, 314, 260, 2767, 282, 4649, 30, 216, 2];
        let solo = engine(m, 64, |_| {});
        let want = alone(&solo, 100, &prompt, 6);
        solo.shutdown();
        for (p_tp, d_tp) in [(2, 1), (1, 3), (3, 2)] {
            let p = engine_tp(m, p_tp, 64);
            let req = EngineRequest {
                id: 1,
                prompt: prompt.clone(),
                params: SamplingParams::greedy(6),
                mode: RequestMode::PrefillOnly {
                    pin_timeout: Duration::from_secs(60),
                },
            };
            let first = collect(&mut p.submit(req).unwrap());
            let d = engine_tp(m, d_tp, 64);
            let req = EngineRequest::new(1, prompt.clone(), SamplingParams::greedy(6));
            let mut s = hand_over(&p, &d, req, first[0]);
            assert_eq!(collect(&mut s), want, "prefill tp={p_tp}, decode tp={d_tp}");
            assert_eq!(
                d.checked_stats()
                    .wait_blocking()
                    .unwrap()
                    .prefill_tokens_computed,
                0
            );
            p.shutdown();
            d.shutdown();
        }
    }

    /// Tensor parallelism on a mixture of experts (the tiny Qwen2-MoE fixture, shared expert included),
    /// under each placement rule (`engine.expert_placement`): each rank holds the experts the rule gives
    /// it, the logits equal one rank's, and the backend's routing counts add the ranks' so every expert
    /// is counted once.
    #[test]
    fn expert_parallel_backend_matches_one_rank_and_counts_each_expert_once() {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/hf/tiny-qwen2-moe");
        let m = tandem_model::load(&dir, &tandem_model::LoadOptions::default()).unwrap();
        let bytes = 1 << 20;
        let mut one = CpuBackend::new(
            CpuLlama::new(m.config.clone(), m.weights.clone(), 1),
            4,
            bytes,
        );
        let prompt: Vec<u32> = (0..9).map(|i| (i * 37 + 5) % 512).collect();
        let mut batch = ForwardBatch::default();
        batch.push(&prompt, 0, vec![0, 1, 2], tandem_model::LogitsWanted::All);
        let mut want = Vec::new();
        one.forward(&batch, &mut want).unwrap();
        let mut want_counts = Vec::new();
        one.moe_expert_tokens(&mut want_counts);
        for rule in [ExpertPlacement::Contiguous, ExpertPlacement::RoundRobin] {
            // The rank holding expert x of 8 under the rule.
            let owner = |x: usize| match rule {
                ExpertPlacement::Contiguous => x / 4,
                ExpertPlacement::RoundRobin => x % 2,
            };
            let mut two =
                CpuBackend::tensor_parallel(&m.config, &m.weights, 2, rule, 2, 4, bytes).unwrap();
            let mut got = Vec::new();
            two.forward(&batch, &mut got).unwrap();
            assert_eq!(got, want, "{rule:?}");
            let mut counts = Vec::new();
            two.moe_expert_tokens(&mut counts);
            assert_eq!(counts, want_counts, "{rule:?}");
            let routed: u64 = counts.iter().flat_map(|l| &l.tokens).sum();
            assert_eq!(routed, 9 * 2 * 3, "9 rows, top-2, 3 MoE layers");
            // Each rank counted only the experts the rule placed on it.
            for (r, rank) in two.ranks.iter().enumerate() {
                for layer in rank.model.expert_tokens() {
                    for (x, &n) in layer.tokens.iter().enumerate() {
                        assert!(
                            owner(x) == r || n == 0,
                            "{rule:?}: rank {r} counted expert {x}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn abort_mid_generation_frees_blocks_on_cpu() {
        let Some(m) = model() else { return };
        let e = engine(m, 64, |_| {});
        let mut s = e
            .submit(EngineRequest::new(
                1,
                vec![1, 504, 3070, 314],
                SamplingParams::greedy(1000),
            ))
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
                .map(|(i, p)| e.submit(EngineRequest::new(i as u64, p.clone(), SamplingParams::greedy(4))).unwrap())
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
