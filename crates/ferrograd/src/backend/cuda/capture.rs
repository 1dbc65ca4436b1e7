//! CUDA graphs on one device: stream capture of the compute stream, and the page-locked
//! staging that uploads made during a capture replay from (backend/capture.rs says what a
//! capture may do).
//!
//! An upload from pageable memory cannot be recorded (the driver copies it at once, and the
//! source is gone by the replay). During a capture, `copy_to_device` instead copies the bytes
//! into page-locked host memory owned by the graph and records a copy from there: every
//! replay uploads the same bytes, in stream order, so a block that the captured step reuses
//! receives its contents exactly when the eager step wrote them. The staging is reserved
//! before the capture starts (no host allocation while recording); a capture that uploads
//! more fails with an error and runs eagerly instead.

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, PinnedHostSlice};

use super::CudaDevice;
use crate::backend::capture::{self, Capture, GraphExec};
use crate::base::Device;
use crate::base::{Error, Result};
use crate::memory::{Allocation, Category};

/// Page-locked bytes for the uploads of one capture. A step's uploads are tables of
/// addresses and a few constants: kilobytes.
const STAGING_BYTES: usize = 4 << 20;

/// The staging of the capture in progress: the page-locked buffer and how much is used.
pub(crate) struct Staging {
    buf: PinnedHostSlice<u8>,
    base: *mut u8,
    used: usize,
}

// SAFETY: `base` points into `buf`, which is owned alongside it and only touched under the
// device's capture lock.
unsafe impl Send for Staging {}

impl Staging {
    fn new(d: &CudaDevice) -> Result<Staging> {
        // SAFETY: the bytes are written before any recorded copy reads them (`stage`).
        let mut buf = unsafe { d.context().alloc_pinned::<u8>(STAGING_BYTES) }
            .map_err(|e| d.err("reserving page-locked staging for a capture", e))?;
        let base = buf
            .as_mut_ptr()
            .map_err(|e| d.err("page-locked staging", e))?;
        Ok(Staging { buf, base, used: 0 })
    }

    /// Copies `bytes` into fresh staging (16-byte aligned), returning the staged slice.
    fn stage(&mut self, bytes: &[u8]) -> Result<&[u8]> {
        let at = self.used.next_multiple_of(16);
        let end = at + bytes.len();
        if end > self.buf.len() {
            return Err(Error::invalid(
                "graph capture",
                format!(
                    "the captured work uploads more than {} MiB from the host; run it without CUDA graphs",
                    STAGING_BYTES >> 20
                ),
            ));
        }
        // SAFETY: at..end lies inside the buffer (checked above) and no recorded copy reads
        // these bytes before the capture ends; nothing else aliases them.
        let staged = unsafe {
            let dst = self.base.add(at);
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len());
            std::slice::from_raw_parts(dst, bytes.len())
        };
        self.used = end;
        Ok(staged)
    }
}

/// A recorded graph and the staging its copies read.
struct CudaGraphExec {
    graph: CudaGraph,
    ordinal: usize,
    _staging: Staging,
}

impl GraphExec for CudaGraphExec {
    fn launch(&self) -> Result<()> {
        self.graph.launch().map_err(|e| Error::DeviceUnavailable {
            device: crate::base::Device::Cuda(self.ordinal),
            reason: format!("launching a CUDA graph failed: {e:?}"),
        })
    }
}

// SAFETY: the graph is only launched from the thread that owns the trainer; cudarc's
// `CudaGraph` holds raw driver handles that the driver allows using from any thread when
// calls are serialised, which `&self` launches through one owner are.
unsafe impl Send for CudaGraphExec {}

impl CudaDevice {
    /// Whether this device's stream is being recorded.
    pub(crate) fn is_capturing(&self) -> bool {
        self.staging().is_some()
    }

    fn staging(&self) -> std::sync::MutexGuard<'_, Option<Staging>> {
        self.capture.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// During a capture: stages `bytes` and records their copy to `ptr`. None when not
    /// capturing (the caller copies as usual).
    pub(crate) fn record_upload(&self, ptr: u64, bytes: &[u8]) -> Option<Result<()>> {
        let mut st = self.staging();
        let staging = st.as_mut()?;
        Some(staging.stage(bytes).and_then(|staged| {
            // SAFETY: the destination holds bytes.len() bytes; the staged source lives as
            // long as the graph that replays this copy.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(ptr, staged, self.stream().cu_stream())
            }
            .map_err(|e| self.err("recording an upload", e))
        }))
    }

    /// A device buffer holding `words`, for a kernel of the step to read. Outside a capture:
    /// a temporary, uploaded in stream order. During one: a block of the shared pools (so
    /// no other captured work ever used it), written at once, whose free is deferred until
    /// the graph is gone (backend/capture.rs: a block from outside the pool freed during the
    /// capture); the graph rewrites it before each replay (`capture::note_derived_buffer`).
    pub(crate) fn step_buffer(&self, words: &[i64], origin: &'static str) -> Result<Allocation> {
        let alloc = crate::memory::allocator(Device::Cuda(self.ordinal()))?;
        if !self.is_capturing() {
            let block = alloc.malloc(words.len() * 8, Category::Temporary, origin)?;
            self.copy_to_device(block.addr(), bytemuck::cast_slice(words))?;
            return Ok(block);
        }
        let block = alloc.malloc_shared(words.len() * 8, Category::Temporary, origin)?;
        // SAFETY: the block holds the words; the copy is synchronous (not recorded) and no
        // queued work reads the block yet.
        unsafe { cudarc::driver::result::memcpy_htod_sync(block.addr(), words) }
            .map_err(|e| self.err("writing a step buffer", e))?;
        Ok(block)
    }

    /// The address of the running capture's dropout seed (made on first use, 0 at first, so
    /// the captured step draws the keys it was given), or 0 when not capturing: a replay
    /// rewrites it, and every dropout kernel of the step draws with its key ^ seed.
    pub(crate) fn dropout_seed(&self) -> Result<u64> {
        if !self.is_capturing() {
            return Ok(0);
        }
        capture::step_seed(|| {
            // Dropped at once: a block from outside the pool stays until the graph goes.
            Ok(self.step_buffer(&[0], "dropout_seed")?.addr())
        })
    }

    /// The error for reading the device back (or waiting for it) while capturing.
    pub(crate) fn refuse_wait(&self, what: &str) -> Result<()> {
        if self.is_capturing() {
            return Err(Error::invalid(
                "graph capture",
                format!(
                    "{what} waits for the device, which a captured step cannot do; \
                     run this step without CUDA graphs"
                ),
            ));
        }
        Ok(())
    }
}

impl Capture for CudaDevice {
    fn begin_capture(&self) -> Result<()> {
        self.bind()?;
        let staging = Staging::new(self)?;
        // Relaxed: the allocator may reserve a segment (cuMemAlloc) while recording.
        self.stream()
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|e| self.err("beginning a stream capture", e))?;
        *self.staging() = Some(staging);
        Ok(())
    }

    fn end_capture(&self) -> Result<Box<dyn GraphExec>> {
        let staging = self
            .staging()
            .take()
            .ok_or_else(|| Error::invalid("graph capture", "no capture is running"))?;
        let graph = self
            .stream()
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(|e| self.err("ending a stream capture", e))?
            .ok_or_else(|| Error::invalid("graph capture", "the captured step queued no work"))?;
        Ok(Box::new(CudaGraphExec {
            graph,
            ordinal: self.ordinal(),
            _staging: staging,
        }))
    }

    fn abandon_capture(&self) {
        if self.staging().take().is_some() {
            // Ends the recording; the partial graph (if any) is dropped at once.
            let _ = self.stream().end_capture(CUgraphInstantiate_flags(0));
        }
    }
}
