//! A later stage: its layers of the model and its share of the KV pool, answering the requests of its
//! worker's link ([`serve_stage`], run by `tandem stage`).

use std::net::TcpListener;
use std::time::Duration;

use tandem_kv::ClusterKey;

use tandem_engine::{LayerBlocks, StageError, StageInput, StageModel, StageOutput};
use tandem_model::{KvLayout, LayerExpertTokens, ModelIdentity, Partition};

use crate::link::{StageHandler, StageHello, StageServer};
use crate::{hello, PipelineError};

/// One later stage's model, answering its link's requests.
struct Hosted {
    model: Box<dyn StageModel>,
    model_id: ModelIdentity,
    stage: usize,
    stages: usize,
    /// The whole model's KV budget in bytes: the largest pool a worker may size here.
    kv_cache_memory: usize,
}

impl Hosted {
    /// The stage-local index of global `layer`, and a bounds check of `blocks`.
    fn locate(&self, layer: usize, blocks: &[u32]) -> Result<usize, StageError> {
        let layers = &self.model.partition().layers;
        if !layers.contains(&layer) {
            return Err(StageError::ForeignLayer {
                layer,
                stage: self.stage,
                layers: layers.clone(),
            });
        }
        let nb = self.model.pool().ok_or(StageError::Unsized)?.num_blocks;
        if let Some(&block) = blocks.iter().find(|&&b| b as usize >= nb) {
            return Err(StageError::BlockOutOfRange {
                block,
                num_blocks: nb,
            });
        }
        Ok(layer - layers.start)
    }
}

impl StageHandler for Hosted {
    type Error = StageError;

    fn hello(&self) -> StageHello {
        let (bs, nb) = self
            .model
            .pool()
            .map_or((0, 0), |l| (l.block_size, l.num_blocks));
        let mut h = hello(
            &*self.model,
            &self.model_id,
            self.model.partition(),
            (self.stage, self.stages),
            (bs, nb),
        );
        h.samples = self.model.samples_on_device();
        h
    }

    fn size_pool(&mut self, block_size: usize, num_blocks: usize) -> Result<(), StageError> {
        if block_size == 0 || num_blocks == 0 {
            return Err(StageError::EmptyPool {
                block_size,
                num_blocks,
            });
        }
        // Measured against the whole model's KV, as the worker's budget sized its pool
        // (`KvLayout::for_budget`), so a stage given its worker's budget accepts exactly that pool;
        // saturating in u128, since two usizes from the wire and the bytes per token overflow even that.
        let per_token = KvLayout::for_budget(self.model.config(), 1, 0, self.model.kv_dtype())
            .bytes_per_token();
        let needs = (num_blocks as u128)
            .saturating_mul(block_size as u128)
            .saturating_mul(per_token as u128);
        if needs > self.kv_cache_memory as u128 {
            return Err(StageError::PoolTooLarge {
                block_size,
                num_blocks,
                needs,
                budget: self.kv_cache_memory,
            });
        }
        self.model.size_pool(block_size, num_blocks)?;
        tracing::info!(
            stage = self.stage,
            num_blocks,
            block_size,
            "stage KV cache allocated"
        );
        Ok(())
    }

    fn forward(&mut self, input: StageInput, output: StageOutput) -> Result<(), StageError> {
        self.model.forward(input, output)
    }

    fn block_bytes(&self) -> usize {
        self.model.pool().map_or(0, |l| l.block_bytes())
    }

    fn export_blocks(&mut self, at: LayerBlocks, out: &mut [u8]) -> Result<(), StageError> {
        let local = LayerBlocks::new(self.locate(at.layer, at.blocks)?, at.blocks);
        self.model.export_blocks(local, out)
    }

    fn import_blocks(&mut self, at: LayerBlocks, data: &[u8]) -> Result<(), StageError> {
        let local = LayerBlocks::new(self.locate(at.layer, at.blocks)?, at.blocks);
        self.model.import_blocks(local, data)
    }

    fn expert_tokens(&self, out: &mut Vec<LayerExpertTokens>) {
        self.model.moe_expert_tokens(out);
    }

    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), StageError> {
        let first = self.model.partition().layers.start;
        self.locate(first, &[src, dst])?;
        self.model.copy_block(src, dst)
    }
}

/// How a stage server serves its link: set by its operator, never by the worker that connects.
#[derive(Clone)]
pub struct StageServing {
    /// Bounds each frame read or write after a request's first frame.
    pub io: Duration,
    /// The whole model's KV budget in bytes, as the worker's `kv_cache_memory`: the largest pool a
    /// worker's hello may size here (the stage allocates its layers' share of it).
    pub kv_cache_memory: usize,
    /// The cluster secret a worker must prove, if any.
    pub key: Option<ClusterKey>,
    /// Mutual TLS on the link: only a worker with a certificate from the cluster's CA connects.
    pub tls: Option<std::sync::Arc<tandem_kv::ClusterTls>>,
}

/// Hosts stage `stage` (≥ 1) of `stages` on `listener`: serves `model` (that stage's layers, on any
/// device) to its worker's link until shut down (only a worker proving `serving.key`, when set). The KV
/// pool is sized by the first worker that connects, within `serving.kv_cache_memory`.
pub fn serve_stage(
    model: Box<dyn StageModel>,
    identity: &ModelIdentity,
    stage: usize,
    stages: usize,
    listener: TcpListener,
    serving: StageServing,
) -> Result<StageServer, PipelineError> {
    if stage == 0 {
        return Err(PipelineError::Config(
            "stage 0 runs inside the worker; a stage server hosts stages 1 and later".into(),
        ));
    }
    let part = Partition::stage(model.config(), stage, stages)?;
    if &part != model.partition() {
        return Err(PipelineError::Config(format!(
            "stage {stage} of {stages} holds layers {:?}, the model given holds {:?}",
            part.layers,
            model.partition().layers
        )));
    }
    let layers = part.layers;
    let handler = Hosted {
        model,
        model_id: identity.clone(),
        stage,
        stages,
        kv_cache_memory: serving.kv_cache_memory,
    };
    let server = StageServer::start_tls(listener, handler, serving.io, serving.key, serving.tls)
        .map_err(|source| PipelineError::Link {
            stage,
            addr: "listener".into(),
            source,
        })?;
    tracing::info!(stage, stages, ?layers, addr = %server.addr(), "pipeline stage serving");
    Ok(server)
}
