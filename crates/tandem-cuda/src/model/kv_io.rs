//! KV block I/O: one (layer, block) to and from the host through page-locked staging (the P/D
//! transfer), and block copies on the device.

use cudarc::driver::result as drv_result;

use super::CudaLlama;
use crate::error::CudaError;

impl CudaLlama {
    pub(super) fn block_addr(&self, layer: usize, block: u32) -> u64 {
        let layer_elems = (self.layout.num_blocks + 1) * self.layout.block_elems();
        self.kv.at(
            layer * layer_elems + block as usize * self.layout.block_elems(),
            self.layout.dtype.size(),
        )
    }

    /// Copies one (layer, block) of KV to the host (`out.len() == kv_layout().block_bytes()`),
    /// through page-locked staging (a DMA at bus speed, then a memcpy).
    pub fn export_block(&self, layer: usize, block: u32, out: &mut [u8]) -> Result<(), CudaError> {
        self.check_block(layer, block, out.len())?;
        self.ctx.bind_to_thread()?;
        let mut st = self.kv_staging.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the range is inside the KV allocation (checked above) and the staging buffer holds
        // a block; the copy is complete before the buffer is read or reused (synchronised).
        unsafe {
            drv_result::memcpy_dtoh_async(
                st.bytes_mut(out.len()),
                self.block_addr(layer, block),
                self.stream.cu_stream(),
            )
        }?;
        self.stream.synchronize()?;
        out.copy_from_slice(st.bytes(out.len()));
        Ok(())
    }

    /// Overwrites one (layer, block) of KV with bytes from `export_block` of an equal layout, through
    /// the same page-locked staging.
    pub fn import_block(&mut self, layer: usize, block: u32, data: &[u8]) -> Result<(), CudaError> {
        self.check_block(layer, block, data.len())?;
        self.ctx.bind_to_thread()?;
        let mut st = self.kv_staging.lock().unwrap_or_else(|e| e.into_inner());
        st.bytes_mut(data.len()).copy_from_slice(data);
        // SAFETY: as in export_block; the staging buffer is not touched until the copy is done.
        unsafe {
            drv_result::memcpy_htod_async(
                self.block_addr(layer, block),
                st.bytes(data.len()),
                self.stream.cu_stream(),
            )
        }?;
        self.stream.synchronize()?;
        Ok(())
    }

    /// Starts the bulk export of every layer of `blocks` (see [`crate::kv_bulk`]); returns once enqueued.
    pub fn export_kv(
        &mut self,
        blocks: &[u32],
    ) -> Result<Box<dyn tandem_engine::KvExport>, CudaError> {
        self.export_into(blocks, None)
    }

    /// Starts the bulk export of every layer of `blocks` into `dest`, a slice of [`Self::kv_staging`]
    /// (device memory a zero-copy transport reads); returns once enqueued.
    pub fn export_kv_staged(
        &mut self,
        blocks: &[u32],
        dest: tandem_engine::StagingSlice,
    ) -> Result<Box<dyn tandem_engine::KvExport>, CudaError> {
        self.export_into(blocks, Some(dest))
    }

    fn export_into(
        &mut self,
        blocks: &[u32],
        dest: Option<tandem_engine::StagingSlice>,
    ) -> Result<Box<dyn tandem_engine::KvExport>, CudaError> {
        let layout = self.layout;
        let (kv, stride) = (self.kv.ptr, self.layer_stride_bytes());
        self.mover
            .export(&layout, |l| kv + (l * stride) as u64, blocks, dest)
    }

    /// `bytes` of device memory for zero-copy KV transfers (see [`crate::kv_bulk`]).
    pub fn kv_staging(
        &self,
        bytes: usize,
    ) -> Result<std::sync::Arc<tandem_engine::KvStaging>, CudaError> {
        self.mover.staging(bytes)
    }

    /// Enqueues the bulk import of one layer's `blocks` from `data` (blocks back to back).
    pub fn import_kv(
        &mut self,
        layer: usize,
        blocks: &[u32],
        data: tandem_engine::HostBuf,
    ) -> Result<(), CudaError> {
        let base = self.layer_base(layer)?;
        let layout = self.layout;
        self.mover.import(&self.stream, &layout, base, blocks, data)
    }

    /// Enqueues the bulk import of one layer's `blocks` from this GPU's staging memory.
    pub fn import_kv_staged(
        &mut self,
        layer: usize,
        blocks: &[u32],
        src: tandem_engine::StagedLayer,
    ) -> Result<(), CudaError> {
        let base = self.layer_base(layer)?;
        let layout = self.layout;
        self.mover
            .import_staged(&self.stream, &layout, base, blocks, src)
    }

    /// Device address of `layer`'s cache, checked.
    fn layer_base(&self, layer: usize) -> Result<u64, CudaError> {
        if layer >= self.layout.n_layers {
            return Err(CudaError::Batch(format!(
                "KV import of layer {layer} outside {} layers",
                self.layout.n_layers
            )));
        }
        Ok(self.kv.ptr + (layer * self.layer_stride_bytes()) as u64)
    }

    /// Orders every bulk import so far before the next step (the compute stream waits; the host
    /// does not).
    pub fn import_fence(&mut self) -> Result<(), CudaError> {
        self.mover.fence(&self.stream)
    }

    /// The page-locked pool P/D transports stage KV through.
    pub fn host_pool(&self) -> std::sync::Arc<dyn tandem_engine::HostPool> {
        self.mover.pool()
    }

    /// Bytes between consecutive layers of the cache (`num_blocks` blocks plus the padding block).
    fn layer_stride_bytes(&self) -> usize {
        (self.layout.num_blocks + 1) * self.layout.block_bytes()
    }

    /// Copies a block across all layers on the device.
    pub fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        for l in 0..self.layout.n_layers {
            self.check_block(l, src, self.layout.block_bytes())?;
            self.check_block(l, dst, self.layout.block_bytes())?;
            // SAFETY: both ranges are whole blocks inside the KV allocation.
            unsafe {
                drv_result::memcpy_dtod_async(
                    self.block_addr(l, dst),
                    self.block_addr(l, src),
                    self.layout.block_bytes(),
                    self.stream.cu_stream(),
                )
            }?;
        }
        self.stream.synchronize()?;
        Ok(())
    }

    pub(super) fn check_block(
        &self,
        layer: usize,
        block: u32,
        len: usize,
    ) -> Result<(), CudaError> {
        if layer >= self.layout.n_layers
            || block as usize >= self.layout.num_blocks
            || len != self.layout.block_bytes()
        {
            return Err(CudaError::Batch(format!(
                "KV block access layer {layer} block {block} of {len} bytes outside {:?}",
                self.layout
            )));
        }
        Ok(())
    }
}
