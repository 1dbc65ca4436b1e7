//! One GPU: its context, compute stream, cuBLAS handle and compiled kernel modules.
//! Devices are created on first use and live for the process. Every entry point binds the
//! context to the calling thread first (rayon and test threads call in from anywhere).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, result};
use cudarc::nvrtc::Ptx;

use super::kernel_cache;

use crate::base::Device;
use crate::base::{Error, Result};

pub struct CudaDevice {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    arch: &'static str,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    /// The staging of the stream capture in progress (None when not capturing).
    pub(super) capture: Mutex<Option<super::capture::Staging>>,
}

static ALLOW_TF32: AtomicBool = AtomicBool::new(false);

/// Whether f32 GEMMs may use TF32 tensor cores (off by default, as in PyTorch).
pub fn allow_tf32() -> bool {
    ALLOW_TF32.load(Ordering::Relaxed)
}

/// `torch.backends.cuda.matmul.allow_tf32 = ...`
pub fn set_allow_tf32(allow: bool) {
    ALLOW_TF32.store(allow, Ordering::Relaxed);
}

/// Module `key`'s source compiled by NVRTC for `arch` ("sm_90a"), as PTX text (to read, or
/// assemble elsewhere); the error names the module and says what NVRTC said.
pub(crate) fn compile_ptx(key: &str, src: &str, arch: &str) -> std::result::Result<String, String> {
    let ptx = nvrtc_compile(key, src, arch, Output::Ptx)?;
    String::from_utf8(until_nul(ptx))
        .map_err(|_| format!("'{key}' for {arch}: NVRTC's PTX is not text"))
}

/// Module `key`'s source compiled by NVRTC for `arch` into machine code (a cubin, which the
/// driver loads as it is): the driver's translation of PTX took about 100 s for all of them
/// on a fresh H100 even on 16 threads, NVRTC about 5.
pub(crate) fn compile_cubin(
    key: &str,
    src: &str,
    arch: &str,
) -> std::result::Result<Vec<u8>, String> {
    nvrtc_compile(key, src, arch, Output::Cubin)
}

/// NVRTC's text (its PTX, its log) up to the NUL that ends it.
fn until_nul(bytes: impl IntoIterator<Item = u8>) -> Vec<u8> {
    bytes.into_iter().take_while(|&b| b != 0).collect()
}

/// What `nvrtc_compile` returns.
enum Output {
    Ptx,
    Cubin,
}

/// One NVRTC compile with `nvrtc_options(arch)`, its PTX or machine code; the error carries
/// NVRTC's log.
fn nvrtc_compile(
    key: &str,
    src: &str,
    arch: &str,
    output: Output,
) -> std::result::Result<Vec<u8>, String> {
    use cudarc::nvrtc::{result as nv, sys};
    let fail = |what: &str| format!("'{key}' for {arch}: {what}");
    let src = std::ffi::CString::new(src).map_err(|_| fail("the source holds a NUL"))?;
    let prog = nv::create_program(&src, None).map_err(|e| fail(&format!("{e:?}")))?;
    // Destroys the program on every path out.
    struct Program(sys::nvrtcProgram);
    impl Drop for Program {
        fn drop(&mut self) {
            // SAFETY: made by create_program above and destroyed only here.
            let _ = unsafe { nv::destroy_program(self.0) };
        }
    }
    let prog = Program(prog);
    // SAFETY: prog is live; the options are plain strings without NULs.
    if let Err(e) = unsafe { nv::compile_program(prog.0, &nvrtc_options(arch)) } {
        // SAFETY: prog is live; the log is NUL-terminated.
        let log = unsafe { nv::get_program_log(prog.0) }
            .map(|l| String::from_utf8_lossy(&until_nul(l.iter().map(|&c| c as u8))).into_owned())
            .unwrap_or_default();
        return Err(fail(&format!("{e:?}\n{log}")));
    }
    let (size_of, get): (unsafe fn(_, _) -> _, unsafe fn(_, _) -> _) = match output {
        Output::Ptx => (sys::nvrtcGetPTXSize, sys::nvrtcGetPTX),
        Output::Cubin => (sys::nvrtcGetCUBINSize, sys::nvrtcGetCUBIN),
    };
    let mut size = 0usize;
    // SAFETY: prog is compiled; size is a valid out-pointer, then the buffer holds size bytes.
    unsafe {
        size_of(prog.0, &mut size)
            .result()
            .map_err(|e| fail(&format!("no output: {e:?}")))?;
        let mut out = vec![0u8; size];
        get(prog.0, out.as_mut_ptr().cast())
            .result()
            .map_err(|e| fail(&format!("no output: {e:?}")))?;
        Ok(out)
    }
}

/// The options every module is compiled with besides its architecture.
const NVRTC_FLAGS: &str = "--std=c++17";

/// Every option NVRTC is given for `arch`: what `nvrtc_compile` passes and what a cached
/// module's name hashes.
fn nvrtc_options(arch: &str) -> [String; 2] {
    [format!("--gpu-architecture={arch}"), NVRTC_FLAGS.into()]
}

/// NVRTC's version ("13.0"), part of every cached module's name.
fn nvrtc_version() -> &'static str {
    static VERSION: OnceLock<String> = OnceLock::new();
    VERSION.get_or_init(|| super::info::nvrtc_version().unwrap_or_else(|| "unknown".into()))
}

/// Where module `key` (from `src`, for `arch`) lies in the kernel cache folder `dir`: its name
/// hashes every option NVRTC is given and NVRTC's version, so a file written without a GPU
/// (`fill_kernel_cache`) is the one a GPU of that architecture reads.
pub(crate) fn cached_module(
    dir: &std::path::Path,
    key: &str,
    src: &str,
    arch: &str,
) -> std::path::PathBuf {
    kernel_cache::file_for(dir, key, src, &nvrtc_options(arch), nvrtc_version())
}

type Registry = Mutex<HashMap<usize, &'static CudaDevice>>;

fn registry() -> &'static Registry {
    static REG: OnceLock<Registry> = OnceLock::new();
    REG.get_or_init(|| Mutex::new(HashMap::new()))
}

fn unavailable(ordinal: usize, reason: impl Into<String>) -> Error {
    Error::DeviceUnavailable {
        device: Device::Cuda(ordinal),
        reason: reason.into(),
    }
}

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only probes for the shared library; nothing is called through it.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Number of visible GPUs (0 when there is no driver).
pub fn device_count() -> usize {
    if !driver_present() {
        return 0;
    }
    CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .unwrap_or(0)
}

/// GPU `ordinal`, initialised on first use.
pub fn device(ordinal: usize) -> Result<&'static CudaDevice> {
    let mut reg = registry().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(d) = reg.get(&ordinal) {
        return Ok(d);
    }
    let d: &'static CudaDevice = Box::leak(Box::new(CudaDevice::open(ordinal)?));
    reg.insert(ordinal, d);
    crate::memory::register_device_memory(Device::Cuda(ordinal), super::memory::CudaMemory::of(d));
    Ok(d)
}

fn arch_name(major: i32, minor: i32) -> &'static str {
    // Compute capability 9.0 (H100, H200) compiles for sm_90a, the architecture-specific
    // target that admits Hopper's warpgroup MMA (the attention forward uses it); its PTX
    // runs on 9.0 devices only, which is what this context is.
    if (major, minor) == (9, 0) {
        return "sm_90a";
    }
    // NVRTC wants a 'static name; leaking one short string per distinct GPU kind is fine.
    Box::leak(format!("sm_{major}{minor}").into_boxed_str())
}

impl CudaDevice {
    fn open(ordinal: usize) -> Result<CudaDevice> {
        if !driver_present() {
            return Err(unavailable(
                ordinal,
                "no CUDA driver was found on this machine (libcuda is not loadable); use --device cpu",
            ));
        }
        let count = device_count();
        if ordinal >= count {
            return Err(unavailable(
                ordinal,
                format!(
                    "this machine has {count} CUDA device(s); use cuda:0..cuda:{}",
                    count.saturating_sub(1)
                ),
            ));
        }
        // SAFETY: probes only.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(unavailable(
                ordinal,
                "libnvrtc was not found: install the CUDA toolkit's NVRTC library",
            ));
        }
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(unavailable(
                ordinal,
                "libcublas was not found: install the CUDA toolkit's cuBLAS library",
            ));
        }
        let drv = |e: cudarc::driver::DriverError| {
            unavailable(ordinal, format!("CUDA driver error: {e:?}"))
        };
        let ctx = CudaContext::new(ordinal).map_err(drv)?;
        let stream = ctx.new_stream().map_err(drv)?;
        let blas = CudaBlas::new(Arc::clone(&stream))
            .map_err(|e| unavailable(ordinal, format!("cuBLAS: {e:?}")))?;
        let (major, minor) = ctx.compute_capability().map_err(drv)?;
        Ok(CudaDevice {
            ordinal,
            ctx,
            stream,
            blas,
            arch: arch_name(major, minor),
            modules: Mutex::new(HashMap::new()),
            capture: Mutex::new(None),
        })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    pub fn blas(&self) -> &CudaBlas {
        &self.blas
    }
    /// e.g. "sm_90"
    pub fn arch(&self) -> &'static str {
        self.arch
    }
    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "unknown".into())
    }

    /// Binds this device's context to the calling thread.
    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.err("bind context", e))
    }

    pub(crate) fn err(&self, what: &str, e: impl std::fmt::Debug) -> Error {
        Error::DeviceUnavailable {
            device: Device::Cuda(self.ordinal),
            reason: format!("{what} failed: {e:?}"),
        }
    }

    /// A kernel from module `key` (compiled from `src` by NVRTC on first use).
    pub fn function(
        &self,
        key: &'static str,
        src: &'static str,
        name: &str,
    ) -> Result<CudaFunction> {
        self.bind()?;
        let module = {
            let mut mods = self.modules.lock().unwrap_or_else(|e| e.into_inner());
            match mods.get(key) {
                Some(m) => Arc::clone(m),
                None => {
                    let m = self.load_module(key, src)?;
                    mods.insert(key, Arc::clone(&m));
                    m
                }
            }
        };
        module
            .load_function(name)
            .map_err(|e| self.err(&format!("loading kernel {name}"), e))
    }

    /// Loads every module of `modules` (key, source) this device has not loaded yet, on
    /// `threads` threads: NVRTC's compile (or the kernel cache's read) and the driver's
    /// translation to machine code run side by side, where first use loads one module at a
    /// time under the module lock. Returns how many it loaded; the first error, if any.
    pub(crate) fn load_modules(
        &self,
        modules: &[(&'static str, &'static str)],
        threads: usize,
    ) -> Result<usize> {
        let (next, loaded) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let first_error: Mutex<Option<Error>> = Mutex::new(None);
        let is_loaded = |key: &str| {
            let mods = self.modules.lock().unwrap_or_else(|e| e.into_inner());
            mods.contains_key(key)
        };
        let worker = || -> Result<()> {
            self.bind()?;
            while let Some(&(key, src)) = modules.get(next.fetch_add(1, Ordering::Relaxed)) {
                if is_loaded(key) {
                    continue;
                }
                let m = self.load_module(key, src)?;
                let mut mods = self.modules.lock().unwrap_or_else(|e| e.into_inner());
                mods.entry(key).or_insert(m);
                loaded.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        };
        std::thread::scope(|s| {
            for _ in 0..threads.clamp(1, modules.len().max(1)) {
                s.spawn(|| {
                    if let Err(e) = worker() {
                        let mut first = first_error.lock().unwrap_or_else(|e| e.into_inner());
                        first.get_or_insert(e);
                    }
                });
            }
        });
        match first_error.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(e) => Err(e),
            None => Ok(loaded.into_inner()),
        }
    }

    /// Module `key` loaded into this device's context: its machine code from the kernel cache
    /// (written by an earlier process, or by `fill_kernel_cache` anywhere) or from NVRTC. A
    /// cached file the driver refuses is forgotten and the module compiled afresh.
    fn load_module(&self, key: &'static str, src: &'static str) -> Result<Arc<CudaModule>> {
        let compile = || {
            compile_cubin(key, src, self.arch).map_err(|e| Error::DeviceUnavailable {
                device: Device::Cuda(self.ordinal),
                reason: format!("compiling kernels failed: {e}"),
            })
        };
        let file = kernel_cache::default_dir().map(|dir| cached_module(&dir, key, src, self.arch));
        let found = kernel_cache::image_or_compile(file.as_deref(), compile)?;
        match self.ctx.load_module(Ptx::from_binary(found.image)) {
            Ok(m) => Ok(m),
            Err(_) if found.from_disk => {
                if let Some(f) = &file {
                    kernel_cache::forget(f);
                }
                self.ctx
                    .load_module(Ptx::from_binary(compile()?))
                    .map_err(|e| self.err("loading module", e))
            }
            Err(e) => Err(self.err("loading module", e)),
        }
    }

    /// A 1-D launch covering `n` threads in blocks of 256.
    pub fn grid_1d(n: usize) -> LaunchConfig {
        let blocks = n.div_ceil(256).clamp(1, 65_535 * 32) as u32;
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    pub fn memset_zero(&self, ptr: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        super::timing::timed(
            self,
            || "memset".into(),
            || {
                // SAFETY: ptr..ptr+bytes is a live block handed out by this device's allocator.
                unsafe { result::memset_d8_async(ptr, 0, bytes, self.stream.cu_stream()) }
                    .map_err(|e| self.err("memset", e))
            },
        )
    }

    /// Copies host bytes to `ptr` and waits (the host buffer is borrowed).
    pub fn copy_to_device(&self, ptr: u64, bytes: &[u8]) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        self.bind()?;
        if let Some(recorded) = self.record_upload(ptr, bytes) {
            return recorded;
        }
        // No wait for the device: from pageable host memory (a Vec, never registered here)
        // the driver copies the bytes into its own staging buffer before returning, so the
        // source may go away at once, and the copy stays in stream order with the kernels.
        super::timing::timed(
            self,
            || "copy to device".into(),
            || {
                // SAFETY: the destination block holds at least bytes.len() bytes; the source
                // is pageable, consumed before the call returns (see above).
                unsafe { result::memcpy_htod_async(ptr, bytes, self.stream.cu_stream()) }
                    .map_err(|e| self.err("copy to device", e))
            },
        )
    }

    /// Copies `len` bytes at `ptr` to the host.
    pub fn copy_to_host(&self, ptr: u64, len: usize) -> Result<Vec<u8>> {
        let mut out = vec![0u8; len];
        if len == 0 {
            return Ok(out);
        }
        self.bind()?;
        self.refuse_wait("reading values back to the host")?;
        // SAFETY: the source block holds len bytes; we synchronize before reading `out`.
        super::timing::timed(
            self,
            || "copy to host (synchronising)".into(),
            || {
                unsafe { result::memcpy_dtoh_async(&mut out[..], ptr, self.stream.cu_stream()) }
                    .map_err(|e| self.err("copy to host", e))?;
                self.synchronize()
            },
        )?;
        Ok(out)
    }

    pub fn synchronize(&self) -> Result<()> {
        self.refuse_wait("synchronising with the device")?;
        let t0 = std::time::Instant::now();
        let r = self
            .stream
            .synchronize()
            .map_err(|e| self.err("synchronize", e));
        super::timing::count_wait(t0.elapsed().as_nanos() as u64);
        r
    }

    /// (free, total) bytes as the driver reports them.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        result::mem_get_info().map_err(|e| self.err("cuMemGetInfo", e))
    }
}
