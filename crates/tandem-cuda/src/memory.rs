//! Device and page-locked host allocations owned by the model, freed on drop.

use std::sync::Arc;

use cudarc::driver::{result as drv_result, CudaContext};

use crate::error::CudaError;

/// An owned device allocation, freed on drop.
pub(crate) struct DeviceBuf {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) ptr: u64,
    pub(crate) bytes: usize,
}

impl DeviceBuf {
    pub(crate) fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DeviceBuf, CudaError> {
        ctx.bind_to_thread()?;
        // SAFETY: a plain cuMemAlloc of a non-zero size in the bound context.
        let ptr = unsafe { drv_result::malloc_sync(bytes.max(16)) }?;
        Ok(DeviceBuf {
            ctx: ctx.clone(),
            ptr,
            bytes,
        })
    }

    /// Device address `elems` elements of `size` bytes into the buffer.
    pub(crate) fn at(&self, elems: usize, size: usize) -> u64 {
        debug_assert!(elems * size <= self.bytes);
        self.ptr + (elems * size) as u64
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: ptr came from cuMemAlloc in this context and is freed once.
            if let Err(e) = unsafe { drv_result::free_sync(self.ptr) } {
                tracing::warn!(error = %e, "cuMemFree failed");
            }
        }
    }
}

/// Page-locked host memory for staging logits: device-to-host copies into pageable memory go
/// through the driver's own small staging buffer at a fraction of the bus speed.
pub(crate) struct PinnedBuf {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) ptr: *mut f32,
    pub(crate) len: usize,
}

// SAFETY: the buffer is plain host memory owned by one model, which is moved between threads but
// never shared.
unsafe impl Send for PinnedBuf {}

impl PinnedBuf {
    pub(crate) fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<PinnedBuf, CudaError> {
        ctx.bind_to_thread()?;
        // SAFETY: cuMemHostAlloc of len floats, no flags (cached, readable by the CPU at full speed).
        let ptr = unsafe { drv_result::malloc_host(len * 4, 0) }? as *mut f32;
        Ok(PinnedBuf {
            ctx: ctx.clone(),
            ptr,
            len,
        })
    }

    pub(crate) fn slice_mut(&mut self, start: usize, n: usize) -> &mut [f32] {
        assert!(start + n <= self.len);
        // SAFETY: in bounds of the allocation; &mut self makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), n) }
    }

    pub(crate) fn slice(&self, start: usize, n: usize) -> &[f32] {
        assert!(start + n <= self.len);
        // SAFETY: in bounds of the allocation.
        unsafe { std::slice::from_raw_parts(self.ptr.add(start), n) }
    }

    /// The first `n` bytes, writable.
    pub(crate) fn bytes_mut(&mut self, n: usize) -> &mut [u8] {
        assert!(n <= self.len * 4);
        // SAFETY: in bounds of the allocation; &mut self makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, n) }
    }

    /// The first `n` bytes.
    pub(crate) fn bytes(&self, n: usize) -> &[u8] {
        assert!(n <= self.len * 4);
        // SAFETY: in bounds of the allocation.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, n) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by cuMemHostAlloc and freed once.
            if let Err(e) = unsafe { drv_result::free_host(self.ptr as *mut std::ffi::c_void) } {
                tracing::warn!(error = %e, "cuMemFreeHost failed");
            }
        }
    }
}

/// Floats per slot of the logits staging buffer (two slots: copy one while the other fills).
pub(crate) const STAGING_CHUNK: usize = 2 << 20;

/// bf16 bytes per element.
pub(crate) const BF16: usize = 2;

pub(crate) fn bf16_bits(v: f32) -> u16 {
    half::bf16::from_f32(v).to_bits()
}
