//! A later stage: its layers of the model and its share of the KV pool, answering the requests of its
//! worker's link ([`serve_stage`], run by `tandem stage`).

use std::net::TcpListener;
use std::time::Duration;

use tandem_engine::DeviceSampling;
use tandem_model::{ForwardBatch, ModelError, ModelIdentity, Partition};

use crate::link::{StageHandler, StageHello, StageServer};
use crate::model::StageModel;
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
    /// The stage's device failed (a GPU's driver, kernels or memory).
    #[error("stage device: {0}")]
    Device(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// Token draws were asked of a stage that returns logits (not the last, or not on a GPU).
    #[error("this stage does not draw tokens on its device")]
    NoDeviceSampling,
}

/// One later stage's model, answering its link's requests.
struct Hosted {
    model: Box<dyn StageModel>,
    model_id: ModelIdentity,
    stage: usize,
    stages: usize,
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
        self.model.size_pool(block_size, num_blocks)?;
        tracing::info!(
            stage = self.stage,
            num_blocks,
            block_size,
            "stage KV cache allocated"
        );
        Ok(())
    }

    fn forward(
        &mut self,
        batch: &ForwardBatch,
        hidden_in: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), StageError> {
        self.model.forward(batch, Some(hidden_in), out)
    }

    fn forward_sampled(
        &mut self,
        batch: &ForwardBatch,
        hidden_in: &[u8],
        rows: &[DeviceSampling],
        out: &mut Vec<u32>,
    ) -> Result<(), StageError> {
        self.model
            .forward_sampled(batch, Some(hidden_in), rows, out)
    }

    fn block_bytes(&self) -> usize {
        self.model.pool().map_or(0, |l| l.block_bytes())
    }

    fn export_blocks(
        &mut self,
        layer: usize,
        blocks: &[u32],
        out: &mut [u8],
    ) -> Result<(), StageError> {
        let l = self.locate(layer, blocks)?;
        self.model.export_blocks(l, blocks, out)
    }

    fn import_blocks(
        &mut self,
        layer: usize,
        blocks: &[u32],
        data: &[u8],
    ) -> Result<(), StageError> {
        let l = self.locate(layer, blocks)?;
        self.model.import_blocks(l, blocks, data)
    }

    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), StageError> {
        let first = self.model.partition().layers.start;
        self.locate(first, &[src, dst])?;
        self.model.copy_block(src, dst)
    }
}

/// Hosts stage `stage` (≥ 1) of `stages` on `listener`: serves `model` (that stage's layers, on any
/// device) to its worker's link until shut down (only a worker proving `key`, when set). The KV pool is
/// sized by the first worker that connects.
pub fn serve_stage(
    model: Box<dyn StageModel>,
    identity: &ModelIdentity,
    stage: usize,
    stages: usize,
    listener: TcpListener,
    io: Duration,
    key: Option<tandem_kv::ClusterKey>,
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
