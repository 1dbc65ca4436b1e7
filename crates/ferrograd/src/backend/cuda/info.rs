//! What `ferrograd info` reports about the CUDA side: driver and library versions, devices
//! and their memory. Works (and says so plainly) on machines without a GPU or driver.

use super::device::{device, device_count, driver_present};

/// One GPU as seen at start-up.
#[derive(Clone, Debug)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    pub arch: &'static str,
    pub total_bytes: u64,
    pub free_bytes: u64,
}

#[derive(Clone, Debug)]
pub struct CudaInfo {
    /// e.g. "13.0"; None without a driver.
    pub driver_version: Option<String>,
    pub nvrtc_version: Option<String>,
    pub cublas_version: Option<String>,
    pub devices: Vec<GpuInfo>,
    /// Why nothing more is known, when that is the case.
    pub note: Option<String>,
    /// Where compiled kernels are kept between runs (None: the cache is off).
    pub kernel_cache: Option<KernelCacheInfo>,
}

/// The kernel cache's folder and what it holds.
#[derive(Clone, Debug)]
pub struct KernelCacheInfo {
    pub dir: std::path::PathBuf,
    pub modules: usize,
    pub bytes: u64,
    /// GEMM problems whose cuBLASLt algorithm an earlier run chose by timing (any GPU).
    pub gemm_choices: usize,
}

fn kernel_cache() -> Option<KernelCacheInfo> {
    let dir = super::kernel_cache::default_dir()?;
    let (modules, bytes) = super::kernel_cache::contents(&dir);
    let gemm_choices = super::gemm_tune::stored_in(&dir);
    Some(KernelCacheInfo {
        dir,
        modules,
        bytes,
        gemm_choices,
    })
}

fn driver_version() -> Option<String> {
    let mut v = 0;
    // SAFETY: the driver library is present (checked by the caller); v is a valid out-pointer.
    let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    (r == cudarc::driver::sys::CUresult::CUDA_SUCCESS)
        .then(|| format!("{}.{}", v / 1000, (v % 1000) / 10))
}

pub(super) fn nvrtc_version() -> Option<String> {
    // SAFETY: probes for the library before calling into it.
    unsafe {
        if !cudarc::nvrtc::sys::is_culib_present() {
            return None;
        }
        let (mut major, mut minor) = (0, 0);
        let r = cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor);
        (r == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then(|| format!("{major}.{minor}"))
    }
}

fn cublas_version(ordinal: usize) -> Option<String> {
    let d = device(ordinal).ok()?;
    let mut v = 0;
    // SAFETY: the handle is live for the process; v is a valid out-pointer.
    let r = unsafe { cudarc::cublas::sys::cublasGetVersion_v2(*d.blas().handle(), &mut v) };
    (r == cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
        .then(|| format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100))
}

/// Everything `info` prints about CUDA.
pub fn cuda_info() -> CudaInfo {
    if !driver_present() {
        return CudaInfo {
            driver_version: None,
            nvrtc_version: nvrtc_version(),
            cublas_version: None,
            devices: Vec::new(),
            note: Some("no CUDA driver found (libcuda is not loadable): GPU devices are unavailable, the CPU works".into()),
            kernel_cache: kernel_cache(),
        };
    }
    let count = device_count();
    let devices: Vec<GpuInfo> = (0..count)
        .filter_map(|i| {
            let d = device(i).ok()?;
            let (free, total) = d.mem_info().ok()?;
            Some(GpuInfo {
                ordinal: i,
                name: d.name(),
                arch: d.arch(),
                total_bytes: total as u64,
                free_bytes: free as u64,
            })
        })
        .collect();
    let note =
        (count == 0).then(|| "the CUDA driver is present but reports no devices".to_string());
    CudaInfo {
        driver_version: driver_version(),
        nvrtc_version: nvrtc_version(),
        cublas_version: if count > 0 { cublas_version(0) } else { None },
        devices,
        note,
        kernel_cache: kernel_cache(),
    }
}
