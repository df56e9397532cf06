//! A later stage: its layers of the model and its share of the KV pool, answering the requests of its
//! worker's link ([`serve_stage`], run by `tandem stage`).

use std::net::TcpListener;
use std::time::Duration;

use tandem_model::{
    CpuLlama, ForwardBatch, KvCache, LlamaWeights, ModelConfig, ModelError, ModelIdentity,
    Partition,
};

use crate::link::{StageHandler, StageHello, StageServer};
use crate::{hello, PipelineError};

/// Why a stage refused or failed one request of its link; its message reaches the worker in the link's
/// `Error` frame.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// A block or forward request reached the stage before any worker sized its pool.
    #[error("the stage's KV pool is not sized")]
    Unsized,
    /// The worker asked for a pool with no blocks or blocks of no tokens.
    #[error("a KV pool of {num_blocks} blocks of {block_size} tokens")]
    EmptyPool {
        /// Tokens per block asked for.
        block_size: usize,
        /// Blocks asked for.
        num_blocks: usize,
    },
    /// The layer belongs to another stage.
    #[error("layer {layer} is not on stage {stage} (layers {layers:?})")]
    ForeignLayer {
        /// The global layer asked for.
        layer: usize,
        /// This stage's index.
        stage: usize,
        /// This stage's global layers.
        layers: std::ops::Range<usize>,
    },
    /// The block id is beyond the pool.
    #[error("block {block} beyond the pool of {num_blocks}")]
    BlockOutOfRange {
        /// The block asked for.
        block: u32,
        /// Blocks in the pool.
        num_blocks: usize,
    },
    /// The stage's layers failed on the batch.
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// One later stage's model and KV, answering its link's requests.
struct StageModel {
    model: CpuLlama,
    kv: Option<KvCache>,
    model_id: ModelIdentity,
    stage: usize,
    stages: usize,
}

impl StageModel {
    fn kv(&self) -> Result<&KvCache, StageError> {
        self.kv.as_ref().ok_or(StageError::Unsized)
    }

    fn kv_mut(&mut self) -> Result<&mut KvCache, StageError> {
        self.kv.as_mut().ok_or(StageError::Unsized)
    }

    /// The stage-local index of global `layer`, and a bounds check of `block`.
    fn locate(&self, layer: usize, block: u32) -> Result<usize, StageError> {
        let layers = &self.model.partition().layers;
        if !layers.contains(&layer) {
            return Err(StageError::ForeignLayer {
                layer,
                stage: self.stage,
                layers: layers.clone(),
            });
        }
        let nb = self.kv()?.layout().num_blocks;
        if block as usize >= nb {
            return Err(StageError::BlockOutOfRange {
                block,
                num_blocks: nb,
            });
        }
        Ok(layer - layers.start)
    }
}

impl StageHandler for StageModel {
    type Error = StageError;

    fn hello(&self) -> StageHello {
        let (bs, nb) = self.kv.as_ref().map_or((0, 0), |kv| {
            (kv.layout().block_size, kv.layout().num_blocks)
        });
        hello(
            self.model.config(),
            &self.model_id,
            self.model.partition(),
            self.stage,
            self.stages,
            bs,
            nb,
        )
    }

    fn size_pool(&mut self, block_size: usize, num_blocks: usize) -> Result<(), StageError> {
        if block_size == 0 || num_blocks == 0 {
            return Err(StageError::EmptyPool {
                block_size,
                num_blocks,
            });
        }
        let layout = self.model.kv_layout(block_size, num_blocks);
        tracing::info!(
            stage = self.stage,
            num_blocks,
            block_size,
            "stage KV cache allocated"
        );
        self.kv = Some(KvCache::new(layout));
        Ok(())
    }

    fn forward(
        &mut self,
        batch: &ForwardBatch,
        hidden_in: &[f32],
        out: &mut Vec<f32>,
    ) -> Result<(), StageError> {
        let kv = self.kv.as_mut().ok_or(StageError::Unsized)?;
        self.model
            .forward_stage(batch, kv, Some(hidden_in), out)
            .map_err(StageError::from)
    }

    fn block_bytes(&self) -> usize {
        self.kv.as_ref().map_or(0, |kv| kv.layout().block_bytes())
    }

    fn export_block(&self, layer: usize, block: u32, out: &mut [u8]) -> Result<(), StageError> {
        let l = self.locate(layer, block)?;
        self.kv()?.export_block(l, block, out);
        Ok(())
    }

    fn import_block(&mut self, layer: usize, block: u32, data: &[u8]) -> Result<(), StageError> {
        let l = self.locate(layer, block)?;
        self.kv_mut()?.import_block(l, block, data);
        Ok(())
    }

    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), StageError> {
        let first = self.model.partition().layers.start;
        self.locate(first, src)?;
        self.locate(first, dst)?;
        self.kv_mut()?.copy_block(src, dst);
        Ok(())
    }
}

/// Hosts stage `stage` (≥ 1) of `stages` on `listener`: builds that stage's layers of the model and serves
/// its worker's link until shut down (only a worker proving `key`, when set). The KV pool is sized by the
/// first worker that connects.
#[allow(clippy::too_many_arguments)]
pub fn serve_stage(
    config: &ModelConfig,
    weights: &LlamaWeights,
    identity: &ModelIdentity,
    stage: usize,
    stages: usize,
    threads: usize,
    listener: TcpListener,
    io: Duration,
    key: Option<tandem_kv::ClusterKey>,
) -> Result<StageServer, PipelineError> {
    if stage == 0 {
        return Err(PipelineError::Config(
            "stage 0 runs inside the worker; a stage server hosts stages 1 and later".into(),
        ));
    }
    let part = Partition::stage(config, stage, stages)?;
    let layers = part.layers.clone();
    let model = CpuLlama::partitioned(config.clone(), weights, threads, part, None)?;
    let handler = StageModel {
        model,
        kv: None,
        model_id: identity.clone(),
        stage,
        stages,
    };
    let server =
        StageServer::start(listener, handler, io, key).map_err(|source| PipelineError::Link {
            stage,
            addr: "listener".into(),
            source,
        })?;
    tracing::info!(stage, stages, ?layers, addr = %server.addr(), "pipeline stage serving");
    Ok(server)
}
