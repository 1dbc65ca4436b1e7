//! One GEMM through cuBLASLt with a fused epilogue, for a linear layer's bias:
//! - `Bias`: forward, the bias row added while the product is still in registers, so
//!   `x @ wᵀ + b` writes its output once instead of a GEMM pass plus a read-modify-write pass;
//! - `BiasGrad`: backward, the weight gradient gᵀ·x with the bias gradient Σ_rows g summed
//!   from the same operand tiles, instead of a separate reduction over g;
//! - `BiasGelu`: forward of a GPT MLP's first layer, gelu_tanh(x @ wᵀ + b) with the
//!   pre-activation written beside it for backward (cuBLASLt's GELU_AUX_BIAS);
//! - `Dgelu`: backward, the product that is the GELU's output gradient multiplied by
//!   gelu'(pre) before it is stored (DGELU);
//! - `Plain`: no epilogue, for single products that would otherwise go to cuBLAS's
//!   `cublasGemmEx` with its default algorithm: here they get the timed choice below.
//!
//! The operand readings (transposes, leading dims) are cuda/matmul.rs's: the row-major (m, n)
//! output is computed as its column-major transpose (n, m) = bᵀ aᵀ. So the forward's bias (n)
//! runs along the column-major rows (cuBLASLt's BIAS epilogue), and the sums of a over k are
//! cuBLASLt's reduction of its second operand over k (the BGRADB epilogue). The workspace
//! is the cuBLAS block of this device's allocator (counted as `workspace`); calls are ordered
//! on the device's one stream, so the two libraries never use it at once.
//!
//! f16 and bf16 operands may write an f32 output (compute and scale f32): `BiasGrad` then sums
//! into an f32 vector, as cuBLASLt's bias vectors take the output's type.
//!
//! The heuristic's choice of algorithm is cached per problem (shape, readings, dtypes, the
//! operands', the epilogue vector's and the auxiliary matrix's alignments): asking for it
//! costs more host time than the launch. A problem cuBLASLt has no algorithm for answers
//! `Ok(false)` and the caller takes the plain path.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{LazyLock, Mutex};

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys::{
    cublasComputeType_t, cublasLtEpilogue_t, cublasLtHandle_t, cublasLtMatmulAlgo_t,
    cublasLtMatmulDescAttributes_t as DescAttr, cublasLtMatmulPreferenceAttributes_t as PrefAttr,
    cublasLtMatrixLayout_t, cudaDataType,
};

use super::CudaDevice;
use super::gemm_tune as tune;
use super::matmul::{Gemm, WORKSPACE_BYTES};
use crate::base::Result;

/// One cuBLASLt handle per device, created on first use and kept for the process.
struct Handle(cublasLtHandle_t);
// SAFETY: a cuBLASLt handle is not tied to a thread; calls through it are serialised by the
// device's stream order and the mutex around the table.
unsafe impl Send for Handle {}

static HANDLES: Mutex<Vec<(usize, Handle)>> = Mutex::new(Vec::new());

fn handle(d: &CudaDevice) -> Result<cublasLtHandle_t> {
    let mut set = HANDLES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, h)) = set.iter().find(|(o, _)| *o == d.ordinal()) {
        return Ok(h.0);
    }
    let h = lt::create_handle().map_err(|e| d.err("cublasLtCreate", e))?;
    set.push((d.ordinal(), Handle(h)));
    Ok(h)
}

/// The fused epilogue and the address of its vector.
#[derive(Clone, Copy)]
pub(super) enum Epilogue {
    /// n elements added to every output row.
    Bias(u64),
    /// m elements written: the sums of a over k.
    BiasGrad(u64),
    /// The bias (n), then GELU; the pre-activation (m, n) written at the second address.
    BiasGelu(u64, u64),
    /// The product times gelu'(pre), pre (m, n) at the address.
    Dgelu(u64),
    /// The product alone.
    Plain,
}

impl Epilogue {
    /// cuBLASLt's epilogue, its vector (bias) and auxiliary matrix addresses where it has
    /// them, and the call's row in the kernel times.
    fn lt(self) -> (cublasLtEpilogue_t, Option<u64>, Option<u64>, &'static str) {
        use cublasLtEpilogue_t::*;
        match self {
            Epilogue::Bias(v) => (CUBLASLT_EPILOGUE_BIAS, Some(v), None, "gemm+bias"),
            Epilogue::BiasGrad(v) => (CUBLASLT_EPILOGUE_BGRADB, Some(v), None, "gemm+bias grad"),
            Epilogue::BiasGelu(v, aux) => (
                CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
                Some(v),
                Some(aux),
                "gemm+bias+gelu",
            ),
            Epilogue::Dgelu(aux) => (CUBLASLT_EPILOGUE_DGELU, None, Some(aux), "gemm+dgelu"),
            Epilogue::Plain => (CUBLASLT_EPILOGUE_DEFAULT, None, None, "gemm (lt)"),
        }
    }
}

/// What a problem is for the algorithm cache: everything the heuristic saw.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    device: usize,
    epilogue: u32,
    data: i32,
    out_data: i32,
    compute: i32,
    dims: [usize; 3],
    trans: [bool; 2],
    lds: [i32; 2],
    aligns: [u32; 4],
    /// The epilogue vector's and auxiliary matrix's alignments (0 without one). The
    /// heuristic reads those pointers' values to decide the alignment an algorithm may
    /// assume (cuBLASLt's documentation of the aux pointer says so), so an algorithm is only
    /// reused for pointers aligned as the ones it was chosen for.
    vector_align: u32,
    aux_align: u32,
}

impl Key {
    /// The problem as the stored choices name it: every field but the device, as numbers.
    fn problem(&self) -> String {
        let k = self;
        let numbers: [i64; tune::PROBLEM_FIELDS] = [
            i64::from(k.epilogue),
            i64::from(k.data),
            i64::from(k.out_data),
            i64::from(k.compute),
            k.dims[0] as i64,
            k.dims[1] as i64,
            k.dims[2] as i64,
            i64::from(k.trans[0]),
            i64::from(k.trans[1]),
            i64::from(k.lds[0]),
            i64::from(k.lds[1]),
            i64::from(k.aligns[0]),
            i64::from(k.aligns[1]),
            i64::from(k.aligns[2]),
            i64::from(k.aligns[3]),
            i64::from(k.vector_align),
            i64::from(k.aux_align),
        ];
        numbers.map(|n| n.to_string()).join(" ")
    }
}

static ALGOS: LazyLock<Mutex<HashMap<Key, cublasLtMatmulAlgo_t>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// The largest power of two (at most 256) that divides a device address: cuBLASLt's
/// heuristic assumes 256-byte operands unless told otherwise.
fn alignment(addr: u64) -> u32 {
    if addr == 0 {
        256
    } else {
        (1u64 << addr.trailing_zeros().min(8)) as u32
    }
}

/// Owns the descriptors of one call; destroys them on every path out.
struct Descriptors {
    desc: cudarc::cublaslt::sys::cublasLtMatmulDesc_t,
    layouts: Vec<cublasLtMatrixLayout_t>,
    pref: Option<cudarc::cublaslt::sys::cublasLtMatmulPreference_t>,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each handle was created by this struct's owner and is destroyed once here.
        unsafe {
            for l in &self.layouts {
                let _ = lt::destroy_matrix_layout(*l);
            }
            if let Some(p) = self.pref {
                let _ = lt::destroy_matmul_pref(p);
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

impl Descriptors {
    /// The heuristic's answers (up to `wanted`) under this problem's preference, once
    /// `heuristic` has made it; empty before, or when it has none.
    fn candidates(&self, handle: cublasLtHandle_t, wanted: usize) -> Vec<cublasLtMatmulAlgo_t> {
        let Some(pref) = self.pref else {
            return Vec::new();
        };
        let layouts = [self.layouts[0], self.layouts[1], self.layouts[2]];
        // SAFETY: every descriptor is live (owned by `self`).
        unsafe { tune::candidates(handle, self.desc, layouts, pref, wanted, WORKSPACE_BYTES) }
    }
}

/// Sets one attribute of a descriptor from a plain value.
fn set_desc<T>(d: &CudaDevice, desc: &Descriptors, attr: DescAttr, value: &T) -> Result<()> {
    // SAFETY: `desc.desc` is live; the value is read for its size during the call.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc.desc,
            attr,
            value as *const T as *const c_void,
            std::mem::size_of::<T>(),
        )
    }
    .map_err(|e| d.err("cublasLtMatmulDescSetAttribute", e))
}

/// Whether single products go through cuBLASLt (`Epilogue::Plain`, the timed choice of
/// algorithm; beta != 0 too, accumulating in place) rather than cuBLAS's default one: on
/// unless `FERROGRAD_GEMM_LT=0` (read once), which gives the cuBLAS path back for comparison.
pub(super) fn plain_products() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| plain_products_from(std::env::var("FERROGRAD_GEMM_LT").ok().as_deref()))
}

fn plain_products_from(setting: Option<&str>) -> bool {
    !matches!(setting, Some("0" | "off" | "false"))
}

/// cuBLASLt's names for the product's operand, output and compute types (the f32-scaled
/// ones).
fn lt_types(g: &Gemm) -> Option<(cudaDataType, cudaDataType, cublasComputeType_t)> {
    use cudarc::cublas::sys::{cublasComputeType_t as Blas, cudaDataType as BlasData};
    let lt_data = |d: BlasData| match d {
        BlasData::CUDA_R_32F => Some(cudaDataType::CUDA_R_32F),
        BlasData::CUDA_R_16F => Some(cudaDataType::CUDA_R_16F),
        BlasData::CUDA_R_16BF => Some(cudaDataType::CUDA_R_16BF),
        _ => None,
    };
    let compute = match g.ty.compute {
        Blas::CUBLAS_COMPUTE_32F => cublasComputeType_t::CUBLAS_COMPUTE_32F,
        Blas::CUBLAS_COMPUTE_32F_FAST_TF32 => cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        _ => return None,
    };
    Some((lt_data(g.ty.data)?, lt_data(g.out_ty.data)?, compute))
}

/// `out (m, n) = a @ b + beta·out` for one product (no batch; beta != 0 only without an
/// epilogue: C is the output, read in place) with f32 scaling (f32, f16 and bf16 data; an f32
/// output for half operands) and the epilogue; its vector holds contiguous elements of the
/// output's dtype.
/// `ws` is the device's workspace block. Ok(false): not for cuBLASLt (f64), or it has no
/// algorithm for it; nothing was queued.
pub(super) fn gemm_epilogue(
    d: &CudaDevice,
    g: &Gemm,
    (a, b): (u64, u64),
    ws: u64,
    epilogue: Epilogue,
) -> Result<bool> {
    let handle = handle(d)?;
    let op = |trans: bool| {
        if trans {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    };
    let Some((data, out_data, compute)) = lt_types(g) else {
        return Ok(false);
    };
    let desc = lt::create_matmul_desc(compute, cudaDataType::CUDA_R_32F)
        .map_err(|e| d.err("cublasLtMatmulDescCreate", e))?;
    let mut ds = Descriptors {
        desc,
        layouts: Vec::with_capacity(3),
        pref: None,
    };
    // Column-major: first operand bᵀ (n × k), second aᵀ (k × m), output (n × m).
    set_desc(
        d,
        &ds,
        DescAttr::CUBLASLT_MATMUL_DESC_TRANSA,
        &op(g.b.trans),
    )?;
    set_desc(
        d,
        &ds,
        DescAttr::CUBLASLT_MATMUL_DESC_TRANSB,
        &op(g.a.trans),
    )?;
    let (kind, vector, aux, name) = epilogue.lt();
    set_desc(d, &ds, DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE, &kind)?;
    if let Some(v) = vector {
        let v = v as *const c_void;
        set_desc(d, &ds, DescAttr::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &v)?;
    }
    if let Some(aux) = aux {
        // The auxiliary matrix is laid out as the output: column-major (n, m), ld n. cuBLASLt
        // wants it 16-byte aligned and ld a multiple of 8 (cuda/matmul.rs checks both first).
        let aux = aux as *const c_void;
        let ld = g.n as i64;
        set_desc(
            d,
            &ds,
            DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
            &aux,
        )?;
        set_desc(d, &ds, DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld)?;
    }
    let (m, n, k) = (g.m as u64, g.n as u64, g.k as u64);
    let stored =
        |trans: bool, rows: u64, cols: u64| if trans { (cols, rows) } else { (rows, cols) };
    let (ar, ac) = stored(g.b.trans, n, k);
    let (br, bc) = stored(g.a.trans, k, m);
    for (ty, rows, cols, ld) in [
        (data, ar, ac, g.b.ld as i64),
        (data, br, bc, g.a.ld as i64),
        (out_data, n, m, g.n as i64),
    ] {
        let l = lt::create_matrix_layout(ty, rows, cols, ld)
            .map_err(|e| d.err("cublasLtMatrixLayoutCreate", e))?;
        ds.layouts.push(l);
    }
    let aligns = [
        alignment(b),
        alignment(a),
        alignment(g.out),
        alignment(g.out),
    ];
    let key = Key {
        device: d.ordinal(),
        epilogue: kind as u32,
        data: g.ty.data as i32,
        out_data: g.out_ty.data as i32,
        compute: g.ty.compute as i32,
        dims: [g.m, g.n, g.k],
        trans: [g.a.trans, g.b.trans],
        lds: [g.a.ld, g.b.ld],
        aligns,
        vector_align: vector.map_or(0, alignment),
        aux_align: aux.map_or(0, alignment),
    };
    let cached = ALGOS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&key)
        .copied();
    let (one, beta) = (1f32, g.beta as f32);
    let (desc, [la, lb, lc]) = (ds.desc, [ds.layouts[0], ds.layouts[1], ds.layouts[2]]);
    let launch = |algo: &cublasLtMatmulAlgo_t| {
        // SAFETY: the operand and output addresses and leading dims come from layouts of live
        // device blocks validated by the matmul family (as for cuBLAS in matmul.rs); the
        // epilogue's vector holds n (bias) or m (bias gradient) elements of the output's
        // dtype; the workspace block holds WORKSPACE_BYTES and lives for the process; alpha
        // and beta are f32 host scalars alive for the call.
        unsafe {
            lt::matmul(
                handle,
                desc,
                &one as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                b as *const c_void,
                la,
                a as *const c_void,
                lb,
                g.out as *const c_void,
                lc,
                g.out as *mut c_void,
                lc,
                algo,
                ws as *mut c_void,
                WORKSPACE_BYTES,
                d.stream().cu_stream() as *mut _,
            )
        }
        .map_err(|e| d.err("cublasLtMatmul", e))
    };
    let label = || {
        format!(
            "{name} {}x{}x{} {:?}->{:?}",
            g.m, g.n, g.k, g.ty.data, g.out_ty.data
        )
    };
    // An accumulating call reads its output, so its candidates are never timed on it: it
    // takes the choice of the same product with beta 0 (the algorithm does not depend on
    // beta), stored or met earlier in this process, else the heuristic's first answer, which
    // it does not keep for a later beta-0 call that may time them.
    let accumulates = g.beta != 0.0;
    let algo = match cached {
        Some(algo) => algo,
        None => {
            let found = choose(
                d,
                handle,
                &mut ds,
                &key,
                (kind, vector),
                accumulates,
                &launch,
                &label,
            )?;
            let Some(algo) = found else {
                return Ok(false);
            };
            if accumulates {
                algo
            } else {
                let mut algos = ALGOS.lock().unwrap_or_else(|e| e.into_inner());
                *algos.entry(key).or_insert(algo)
            }
        }
    };
    super::timing::timed(d, label, || launch(&algo))?;
    Ok(true)
}

/// The algorithm for a problem met for the first time in this process: with tuning on, the
/// choice stored by an earlier run (`report` always times), else (outside a capture, for a
/// call that does not accumulate into its output) the timed choice among the heuristic's
/// answers on this call's operands, stored for the next run; with tuning off, or a new
/// problem met inside a capture or accumulating, the heuristic's first answer. None when it
/// has none.
#[allow(clippy::too_many_arguments)]
fn choose(
    d: &CudaDevice,
    handle: cublasLtHandle_t,
    ds: &mut Descriptors,
    key: &Key,
    epilogue: (cublasLtEpilogue_t, Option<u64>),
    accumulates: bool,
    launch: &dyn Fn(&cublasLtMatmulAlgo_t) -> Result<()>,
    label: &dyn Fn() -> String,
) -> Result<Option<cublasLtMatmulAlgo_t>> {
    let mode = tune::mode();
    let problem = key.problem();
    if mode == tune::Mode::On
        && let Some(i) = tune::stored(d, &problem)
    {
        let found = heuristic(d, handle, ds, key.aligns, tune::MAX_CANDIDATES)?;
        return Ok(found.get(i).or(found.first()).copied());
    }
    let timing = mode != tune::Mode::Off && !d.is_capturing() && !accumulates;
    let wanted = if timing { tune::MAX_CANDIDATES } else { 1 };
    let found = heuristic(d, handle, ds, key.aligns, wanted)?;
    if !timing || found.len() < 2 {
        return Ok(found.first().copied());
    }
    let times = tune::time_each(d, &found, launch)?;
    let chosen = tune::choice(&times);
    tune::store(d, &problem, chosen);
    if mode == tune::Mode::Report {
        let plain = if epilogue.0 == cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT {
            None
        } else {
            fastest_without_epilogue(d, handle, ds, epilogue, launch)?
        };
        eprintln!("{}", tune::report_line(&label(), &times, chosen, plain));
    }
    Ok(Some(found[chosen]))
}

/// For the report: the fastest time of the same product with no epilogue (None where it
/// could not be had). Leaves the descriptor's epilogue and vector as it found them.
fn fastest_without_epilogue(
    d: &CudaDevice,
    handle: cublasLtHandle_t,
    ds: &Descriptors,
    (epilogue, vector): (cublasLtEpilogue_t, Option<u64>),
    launch: &dyn Fn(&cublasLtMatmulAlgo_t) -> Result<()>,
) -> Result<Option<f32>> {
    let set_vector = |ds: &Descriptors, v: *const c_void| {
        set_desc(d, ds, DescAttr::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &v)
    };
    let plain = cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT;
    // With a bias vector still set the heuristic offers nothing for the plain product.
    let probe = (|| {
        set_desc(d, ds, DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE, &plain)?;
        if vector.is_some() {
            set_vector(ds, std::ptr::null())?;
        }
        tune::time_each(d, &ds.candidates(handle, tune::MAX_CANDIDATES), launch)
    })();
    set_desc(d, ds, DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
    if let Some(v) = vector {
        set_vector(ds, v as *const c_void)?;
    }
    Ok(probe
        .ok()
        .and_then(|times| times.get(tune::fastest(&times)).copied().flatten()))
}

/// The heuristic's answers (up to `wanted`, best guess first) for the described problem; empty
/// when it has none.
fn heuristic(
    d: &CudaDevice,
    handle: cublasLtHandle_t,
    ds: &mut Descriptors,
    aligns: [u32; 4],
    wanted: usize,
) -> Result<Vec<cublasLtMatmulAlgo_t>> {
    let pref = lt::create_matmul_pref().map_err(|e| d.err("cublasLtMatmulPreferenceCreate", e))?;
    ds.pref = Some(pref);
    let set = |attr: PrefAttr, ptr: *const c_void, size: usize| {
        // SAFETY: `pref` is live; the value is read for its size during the call.
        unsafe { lt::set_matmul_pref_attribute(pref, attr, ptr, size) }
            .map_err(|e| d.err("cublasLtMatmulPreferenceSetAttribute", e))
    };
    let ws = WORKSPACE_BYTES as u64;
    set(
        PrefAttr::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
        tune::ptr(&ws),
        8,
    )?;
    let attrs = [
        PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
        PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
        PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
    ];
    for (attr, align) in attrs.into_iter().zip(&aligns) {
        set(attr, tune::ptr(align), 4)?;
    }
    Ok(ds.candidates(handle, wanted))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_products_take_cublaslt_unless_turned_off() {
        assert!(plain_products_from(None));
        assert!(plain_products_from(Some("1")));
        for off in ["0", "off", "false"] {
            assert!(!plain_products_from(Some(off)), "{off}");
        }
    }

    /// The stored choices' file names a problem by PROBLEM_FIELDS numbers; a key that wrote
    /// another count would never be read back.
    #[test]
    fn a_problem_is_named_by_as_many_numbers_as_the_stored_choices_read() {
        let key = Key {
            device: 3,
            epilogue: cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BGRADB as u32,
            data: 14,
            out_data: 0,
            compute: 68,
            dims: [3072, 768, 8192],
            trans: [true, false],
            lds: [3072, 768],
            aligns: [256, 256, 16, 16],
            vector_align: 256,
            aux_align: 0,
        };
        let problem = key.problem();
        assert_eq!(problem.split(' ').count(), tune::PROBLEM_FIELDS);
        assert!(
            problem.contains(" 3072 768 8192 1 0 3072 768 256 256 16 16 256 0"),
            "{problem}"
        );
        // The device is not part of it: a choice holds for every GPU of the model.
        assert!(!problem.starts_with("3 "));
    }
}
