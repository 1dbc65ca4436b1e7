//! The NCCL group: one process per GPU, collectives run by NCCL on a communication stream of
//! the group's own. Each collective first makes that stream wait for the compute stream (an
//! event, never a device-wide synchronisation), so it sees every kernel queued before it;
//! then either the compute stream waits for the collective at once (`all_reduce` and the
//! rest: "returned" means "ordered before any later kernel"), or, for `all_reduce_launch`,
//! only at `wait_launched`, so DDP's bucket reductions overlap the rest of backward.
//!
//! Tensors on the CPU (a logged loss, a rebuilt bucket order) are staged through the GPU and
//! copied back after the stream is synchronised. `NcclGroup::join` is the whole start of a
//! launched rank: rank 0 makes NCCL's unique id, the rendezvous hands it to every rank, each
//! joins the communicator on the GPU of its LOCAL_RANK.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::CudaStream;
use cudarc::nccl::{result as nccl, sys};

use super::group::{ProcessGroup, ReduceOp, check_buffer, check_root, check_split};
use super::launch_env::LaunchEnv;
use super::rendezvous::{NCCL_UNIQUE_ID_BYTES, share_unique_id};
use crate::autograd::no_grad;
use crate::backend::cuda::{self, CudaDevice};
use crate::base::{Error, Result};
use crate::tensor::{DType, Device, Tensor};

/// A communicator handle; NCCL allows calls on it from any thread, one at a time, which the
/// group's callers guarantee (collectives are issued in one order by one thread per rank).
struct Comm(sys::ncclComm_t);

// SAFETY: the handle is an opaque pointer that NCCL lets any thread use; see above.
unsafe impl Send for Comm {}
// SAFETY: as above.
unsafe impl Sync for Comm {}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: the communicator was created by ncclCommInitRank and is destroyed once.
        let _ = unsafe { nccl::comm_destroy(self.0) };
    }
}

pub struct NcclGroup {
    rank: usize,
    world: usize,
    device: &'static CudaDevice,
    comm: Comm,
    /// The communication stream; collectives are queued here, never on the compute stream.
    stream: Arc<CudaStream>,
    /// A collective was launched that the compute stream does not wait for yet.
    launched: AtomicBool,
}

/// A fresh unique id (rank 0 makes it, the rendezvous hands it to the others).
pub fn nccl_unique_id() -> Result<[u8; NCCL_UNIQUE_ID_BYTES]> {
    check_library()?;
    let id = nccl::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", e))?;
    Ok(id.internal.map(|c| c as u8))
}

fn check_library() -> Result<()> {
    // SAFETY: only probes for the shared library.
    if unsafe { sys::is_culib_present() } {
        return Ok(());
    }
    Err(Error::invalid(
        "NCCL",
        "libnccl was not found: install NCCL (libnccl.so.2) next to the CUDA driver, or train on one GPU without a launcher",
    ))
}

fn nccl_error(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::invalid(
        "NCCL",
        format!(
            "{what} failed: {e:?}; run with NCCL_DEBUG=INFO to see why (every rank must reach the same collectives in the same order)"
        ),
    )
}

impl NcclGroup {
    /// Joins the communicator of `world` ranks named by `id`, as `rank`, on GPU `ordinal`.
    /// Blocks until every rank has joined (NCCL's own bootstrap over the network).
    pub fn new(
        rank: usize,
        world: usize,
        ordinal: usize,
        id: [u8; NCCL_UNIQUE_ID_BYTES],
    ) -> Result<NcclGroup> {
        if world == 0 || rank >= world {
            return Err(Error::invalid(
                "NcclGroup::new",
                format!("rank {rank} is not in a group of {world} ranks"),
            ));
        }
        check_library()?;
        let device = cuda::device(ordinal)?;
        device.bind()?;
        let stream = device
            .stream()
            .context()
            .new_stream()
            .map_err(|e| device.err("create the communication stream", e))?;
        let id = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        let (n, r) = (to_c_int(world)?, to_c_int(rank)?);
        // SAFETY: `comm` is a valid out-pointer; NCCL fills it when every rank has joined.
        unsafe { nccl::comm_init_rank(&mut comm, n, id, r) }
            .map_err(|e| nccl_error("ncclCommInitRank", e))?;
        Ok(NcclGroup {
            rank,
            world,
            device,
            comm: Comm(comm),
            stream,
            launched: AtomicBool::new(false),
        })
    }

    /// This process's rank of a launched run (`ferrograd launch`, torchrun): NCCL's unique id
    /// shared through the rendezvous within `timeout`, the communicator joined on GPU
    /// LOCAL_RANK.
    pub fn join(env: &LaunchEnv, timeout: std::time::Duration) -> Result<NcclGroup> {
        // A machine without the GPU says so before anything waits on the other ranks.
        cuda::device(env.local_rank)?;
        let mine = if env.rank == 0 {
            Some(nccl_unique_id()?)
        } else {
            None
        };
        let id = share_unique_id(env, mine.as_ref(), timeout)?;
        NcclGroup::new(env.rank, env.world_size, env.local_rank, id)
    }

    /// The GPU this rank's collectives run on.
    pub fn device(&self) -> Device {
        Device::Cuda(self.device.ordinal())
    }

    /// Runs `launch` on the communication stream after everything queued on the compute
    /// stream; the compute stream waits for it now (`wait`) or at `wait_launched`.
    fn collective(
        &self,
        name: &str,
        wait: bool,
        launch: impl FnOnce(sys::cudaStream_t) -> std::result::Result<(), nccl::NcclError>,
    ) -> Result<()> {
        self.device.bind()?;
        let compute = self.device.stream();
        self.stream
            .join(compute)
            .map_err(|e| self.device.err("order the communication stream", e))?;
        launch(self.stream.cu_stream() as sys::cudaStream_t).map_err(|e| nccl_error(name, e))?;
        if wait {
            self.join_compute()
        } else {
            self.launched.store(true, Ordering::Release);
            Ok(())
        }
    }

    /// The compute stream waits for everything queued on the communication stream.
    fn join_compute(&self) -> Result<()> {
        self.launched.store(false, Ordering::Release);
        self.device
            .stream()
            .join(&self.stream)
            .map_err(|e| self.device.err("order the compute stream", e))
    }

    /// The address of a tensor's first element on this group's GPU.
    fn address(&self, op: &'static str, t: &Tensor) -> Result<*mut std::ffi::c_void> {
        if t.device() != self.device() {
            return Err(Error::DeviceMismatch {
                op,
                a: t.device(),
                b: self.device(),
            });
        }
        let base = cuda::ptr(t.storage())?;
        let offset = t.layout().offset() * t.dtype().size_in_bytes();
        Ok((base + offset as u64) as *mut std::ffi::c_void)
    }

    /// A CPU tensor's collective: run on a GPU copy, then copied back once finished.
    fn staged(&self, x: &Tensor, run: impl FnOnce(&Tensor) -> Result<()>) -> Result<()> {
        let _g = no_grad();
        let on_gpu = x.to_device(self.device())?;
        run(&on_gpu)?;
        x.copy_(&on_gpu.to_device(Device::Cpu)?)
    }

    fn all_reduce_with(&self, x: &Tensor, op: ReduceOp, wait: bool) -> Result<()> {
        check_buffer("all_reduce", "buffer", x)?;
        if x.device() == Device::Cpu {
            return self.staged(x, |g| self.all_reduce_with(g, op, true));
        }
        let p = self.address("all_reduce", x)?;
        let (n, dt, comm) = (x.numel(), nccl_dtype(x.dtype())?, self.comm.0);
        self.collective("ncclAllReduce", wait, |s| {
            // SAFETY: p holds n elements of dt on this group's GPU, in place.
            unsafe { nccl::all_reduce(p, p, n, dt, nccl_op(op), comm, s) }.map(|_| ())
        })
    }
}

fn to_c_int(n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| Error::invalid("NCCL", format!("{n} ranks are too many")))
}

fn nccl_dtype(d: DType) -> Result<sys::ncclDataType_t> {
    Ok(match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        other => {
            return Err(Error::UnsupportedDType {
                op: "NCCL collective",
                dtype: other,
                hint: "collectives carry floating-point tensors",
            });
        }
    })
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
    }
}

impl ProcessGroup for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn backend_name(&self) -> &'static str {
        "nccl"
    }

    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<()> {
        self.all_reduce_with(x, op, true)
    }

    fn all_reduce_launch(&self, x: &Tensor, op: ReduceOp) -> Result<()> {
        self.all_reduce_with(x, op, false)
    }

    fn wait_launched(&self) -> Result<()> {
        if self.launched.load(Ordering::Acquire) {
            self.join_compute()?;
        }
        Ok(())
    }

    fn broadcast(&self, x: &Tensor, root: usize) -> Result<()> {
        check_buffer("broadcast", "buffer", x)?;
        check_root("broadcast", root, self.world)?;
        if x.device() == Device::Cpu {
            return self.staged(x, |g| self.broadcast(g, root));
        }
        let p = self.address("broadcast", x)?;
        let (n, dt, comm) = (x.numel(), nccl_dtype(x.dtype())?, self.comm.0);
        let root = to_c_int(root)?;
        self.collective("ncclBroadcast", true, |s| {
            // SAFETY: p holds n elements of dt on this group's GPU, in place.
            unsafe { nccl::broadcast(p, p, n, dt, root, comm, s) }.map(|_| ())
        })
    }

    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()> {
        check_split("reduce_scatter", input, output, self.world)?;
        let src = self.address("reduce_scatter", input)?;
        let dst = self.address("reduce_scatter", output)?;
        let (n, dt, comm) = (output.numel(), nccl_dtype(output.dtype())?, self.comm.0);
        self.collective("ncclReduceScatter", true, |s| {
            // SAFETY: src holds world·n elements, dst n, both of dt on this group's GPU.
            unsafe { nccl::reduce_scatter(src, dst, n, dt, nccl_op(op), comm, s) }.map(|_| ())
        })
    }

    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        check_split("all_gather", output, input, self.world)?;
        let src = self.address("all_gather", input)?;
        let dst = self.address("all_gather", output)?;
        let (n, dt, comm) = (input.numel(), nccl_dtype(input.dtype())?, self.comm.0);
        self.collective("ncclAllGather", true, |s| {
            // SAFETY: src holds n elements, dst world·n, both of dt on this group's GPU.
            unsafe { nccl::all_gather(src, dst, n, dt, comm, s) }.map(|_| ())
        })
    }

    fn barrier(&self) -> Result<()> {
        let one = Tensor::from_vec_as(vec![1.0f32], &[1], DType::F32, self.device())?;
        self.all_reduce(&one, ReduceOp::Sum)?;
        self.device.synchronize()
    }
}
