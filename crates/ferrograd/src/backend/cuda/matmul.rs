//! Batched GEMM through cuBLAS (`cublasGemmStridedBatchedEx`). cuBLAS is column-major, so
//! the row-major (m, n) output is computed as its transpose: outᵀ = bᵀ aᵀ. Each operand
//! matrix may be row-major (column stride 1) or column-major (row stride 1): the transpose
//! flags absorb it, so `x @ w.T` needs no copy. Batch dims that step with one stride per
//! operand become one strided-batched call (stride 0 for a broadcast operand); other batch
//! layouts loop over the outer dims. Only a matrix that is neither (an expanded gradient, a
//! gapped view) is first copied into a contiguous temporary.
//!
//! `matmul_acc` passes a beta to cuBLAS, so the product is added into the output in the
//! same pass (out = a·b + beta·out). A single product goes to cuBLASLt instead
//! (cuda/gemm_lt.rs), whose algorithm is the fastest of its heuristic's candidates, timed once
//! per problem with beta 0 (an accumulating one takes that choice), where cuBLAS takes its
//! default one.
//!
//! f32 accumulates in f32 (TF32 tensor cores only when `allow_tf32()`), f64 in f64, f16 and
//! bf16 in f32, stored in their dtype or, for an f32 output, as the f32 sums (cuBLAS's
//! A/B = 16F or 16BF with C = 32F). cuBLAS's workspace is a block of this device's allocator, counted as
//! `workspace` and kept for the process.

use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublas::result as blas;
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cublasSetWorkspace_v2, cudaDataType,
};

use super::gemm_lt::Epilogue;
use super::{CudaBuffer, CudaDevice, allow_tf32, ptr};
use crate::backend::matmul::{Matmul, MatmulKernels};
use crate::backend::{BackendData, MatmulSpec, Storage, View};
use crate::base::{DType, Device, Layout};
use crate::base::{Error, Result};
use crate::memory::{Allocation, Category};

/// cuBLAS workspace per device (NVIDIA's recommendation for Hopper). The planner allocates
/// the same block when it plans for a GPU.
pub(crate) const WORKSPACE_BYTES: usize = 32 << 20;

/// `out = a @ b + beta·out`; beta = 0 does not read `out` (cuBLAS's contract).
pub(crate) fn matmul_acc(
    d: &CudaDevice,
    spec: &MatmulSpec,
    a: View,
    b: View,
    out: &Storage,
    beta: f64,
) -> Result<()> {
    // Dtypes and shapes were validated by the family (backend/matmul.rs).
    let dtype = a.storage.dtype();
    let ty = GemmType::of(dtype)?;
    let out_ty = OutType::of(out.dtype())?;
    check_cublas_sizes(spec)?;
    let MatmulSpec { batch, m, n, k } = *spec;
    if batch * m * n == 0 {
        return Ok(());
    }
    d.bind()?;
    if k == 0 {
        // An empty sum: the product is zero, so out = beta·out.
        if beta == 1.0 {
            return Ok(());
        }
        if beta != 0.0 {
            return Err(Error::invalid(
                "matmul_acc",
                "an empty product (k = 0) with a beta other than 0 or 1 is not supported on CUDA",
            ));
        }
        return d.memset_zero(ptr(out)?, out.len() * out.dtype().size_in_bytes());
    }
    if super::gemm_lt::plain_products() {
        let m = Matmul {
            spec: *spec,
            a,
            b,
            out,
            beta,
        };
        if single_lt(d, &m, Epilogue::Plain)? {
            return Ok(());
        }
    }
    ensure_workspace(d)?;
    let pa = Prepared::new(d, a)?;
    let pb = Prepared::new(d, b)?;
    let call = Gemm {
        ty,
        out_ty,
        m,
        n,
        k,
        a: pa.matrix()?,
        b: pb.matrix()?,
        out: ptr(out)?,
        beta,
    };
    run_batches(d, &call, &pa.view(a), &pb.view(b))
}

/// m, n and k fit cuBLAS's 32-bit sizes.
fn check_cublas_sizes(s: &MatmulSpec) -> Result<()> {
    for v in [s.m, s.n, s.k] {
        i32::try_from(v).map_err(|_| {
            Error::invalid(
                "matmul",
                format!("a matrix dim of {v} exceeds cuBLAS's 32-bit sizes; split the product"),
            )
        })?;
    }
    Ok(())
}

// ---- types and workspace -------------------------------------------------------------------

/// cuBLAS data and compute types of one dtype; `wide` = alpha/beta are f64.
#[derive(Clone, Copy)]
pub(super) struct GemmType {
    pub(super) data: cudaDataType,
    pub(super) compute: cublasComputeType_t,
    wide: bool,
    size: usize,
}

impl GemmType {
    fn of(dtype: DType) -> Result<GemmType> {
        let f32_compute = if allow_tf32() {
            cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let (data, compute, wide) = match dtype {
            DType::F32 => (cudaDataType::CUDA_R_32F, f32_compute, false),
            DType::F64 => (
                cudaDataType::CUDA_R_64F,
                cublasComputeType_t::CUBLAS_COMPUTE_64F,
                true,
            ),
            DType::F16 => (
                cudaDataType::CUDA_R_16F,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                false,
            ),
            DType::BF16 => (
                cudaDataType::CUDA_R_16BF,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                false,
            ),
            dtype => {
                return Err(Error::UnsupportedDType {
                    op: "matmul",
                    dtype,
                    hint: "matmul needs floating-point tensors; convert with .to_dtype(DType::F32)",
                });
            }
        };
        Ok(GemmType {
            data,
            compute,
            wide,
            size: dtype.size_in_bytes(),
        })
    }
}

/// The cuBLAS data type and element size of a GEMM's output: the operands' type, or f32
/// for f16/bf16 operands (validated by the family).
#[derive(Clone, Copy)]
pub(super) struct OutType {
    pub(super) data: cudaDataType,
    pub(super) size: usize,
}

impl OutType {
    pub(super) fn of(dtype: DType) -> Result<OutType> {
        Ok(OutType {
            data: GemmType::of(dtype)?.data,
            size: dtype.size_in_bytes(),
        })
    }
}

/// Gives the device's cuBLAS handle a workspace from our allocator on first use, so its bytes
/// show up as `workspace` instead of hiding inside cuBLAS. Kept for the process: cuBLAS may
/// use it from any later call. Returns the block's address (cuBLASLt calls pass it too).
fn ensure_workspace(d: &CudaDevice) -> Result<u64> {
    static WORKSPACES: Mutex<Vec<(usize, Allocation)>> = Mutex::new(Vec::new());
    let mut set = WORKSPACES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, ws)) = set.iter().find(|(o, _)| *o == d.ordinal()) {
        return Ok(ws.addr());
    }
    // From the shared pools: a first GEMM inside a graph's pool would otherwise pin it.
    let ws = crate::memory::allocator(Device::Cuda(d.ordinal()))?.malloc_shared(
        WORKSPACE_BYTES,
        Category::Workspace,
        "cublas workspace",
    )?;
    // SAFETY: the block holds WORKSPACE_BYTES and stays allocated for the process (kept in
    // WORKSPACES); the handle is this device's, used only on its stream.
    unsafe {
        cublasSetWorkspace_v2(
            *d.blas().handle(),
            ws.addr() as *mut c_void,
            WORKSPACE_BYTES,
        )
    }
    .result()
    .map_err(|e| d.err("cublasSetWorkspace", e))?;
    let addr = ws.addr();
    set.push((d.ordinal(), ws));
    Ok(addr)
}

// ---- operands ---------------------------------------------------------------------------------

/// How cuBLAS reads one operand matrix: `trans` (column-major storage) and its leading
/// dimension.
#[derive(Clone, Copy)]
pub(super) struct Matrix {
    pub(super) trans: bool,
    pub(super) ld: i32,
}

/// The cuBLAS reading of a (rows, cols) matrix with strides (rs, cs), if there is one:
/// row-major needs unit column steps and rows at least `cols` apart; column-major the
/// transpose. A dim of size 1 never steps, so its stride does not matter.
fn matrix_form(rows: usize, cols: usize, rs: isize, cs: isize) -> Option<Matrix> {
    let fit = |ld: isize, min: usize| -> Option<i32> {
        (ld >= min.max(1) as isize).then(|| i32::try_from(ld).ok())?
    };
    if cols == 1 || cs == 1 {
        let ld = if rows > 1 { rs } else { cols as isize };
        if let Some(ld) = fit(ld, cols) {
            return Some(Matrix { trans: false, ld });
        }
    }
    if rows == 1 || rs == 1 {
        let ld = if cols > 1 { cs } else { rows as isize };
        if let Some(ld) = fit(ld, rows) {
            return Some(Matrix { trans: true, ld });
        }
    }
    None
}

/// The trailing (rows, cols, row stride, col stride) of a rank >= 2 layout.
fn last2(l: &Layout) -> (usize, usize, isize, isize) {
    let r = l.rank();
    (
        l.shape()[r - 2],
        l.shape()[r - 1],
        l.strides()[r - 2],
        l.strides()[r - 1],
    )
}

/// An operand as cuBLAS will read it: the caller's view, or a contiguous copy of its
/// matrices when cuBLAS cannot read them as they are.
struct Prepared {
    copy: Option<Storage>,
    layout: Layout,
}

/// The shape of the contiguous copy cuBLAS needs of an operand, or None when it reads the
/// operand as it is. Broadcast batch dims stay broadcast (one copy of the matrix, stride 0
/// after); only the distinct matrices are copied. The planner asks the same question to
/// count the copy's bytes when it plans for a GPU.
pub(crate) fn operand_copy_shape(l: &Layout) -> Option<Vec<usize>> {
    let (rows, cols, rs, cs) = last2(l);
    if matrix_form(rows, cols, rs, cs).is_some() {
        return None;
    }
    let r = l.rank();
    Some(
        l.shape()
            .iter()
            .zip(l.strides())
            .enumerate()
            .map(|(i, (&n, &s))| if i < r - 2 && s == 0 { 1 } else { n })
            .collect(),
    )
}

impl Prepared {
    fn new(d: &CudaDevice, v: View) -> Result<Prepared> {
        let Some(compact) = operand_copy_shape(v.layout) else {
            return Ok(Prepared {
                copy: None,
                layout: v.layout.clone(),
            });
        };
        let shape = v.layout.shape();
        let src = Layout::new(
            compact.clone(),
            v.layout.strides().to_vec(),
            v.layout.offset(),
        );
        let dst = Layout::contiguous(&compact);
        let numel = dst.numel();
        let dtype = v.storage.dtype();
        let bytes = numel * dtype.size_in_bytes();
        let tmp = Storage::new(
            Device::Cuda(d.ordinal()),
            dtype,
            numel,
            Category::Temporary,
            "matmul operand copy",
            |addr| Ok(BackendData::Cuda(CudaBuffer { ptr: addr, bytes })),
        )?;
        super::elementwise::copy(
            d,
            View {
                storage: v.storage,
                layout: &src,
            },
            View {
                storage: &tmp,
                layout: &dst,
            },
        )?;
        Ok(Prepared {
            copy: Some(tmp),
            layout: dst.broadcast_to(shape)?,
        })
    }

    fn view<'a>(&'a self, orig: View<'a>) -> View<'a> {
        View {
            storage: self.copy.as_ref().unwrap_or(orig.storage),
            layout: &self.layout,
        }
    }

    fn matrix(&self) -> Result<Matrix> {
        let (rows, cols, rs, cs) = last2(&self.layout);
        matrix_form(rows, cols, rs, cs).ok_or_else(|| {
            Error::invalid(
                "matmul",
                format!("operand layout {:?} is not readable by cuBLAS", self.layout),
            )
        })
    }
}

// ---- batches ----------------------------------------------------------------------------------

/// The one element step through `shape` (row-major) when a single stride walks it, if any
/// (size-1 dims never step; an all-broadcast walk has step 0).
fn single_step(shape: &[usize], strides: &[isize]) -> Option<i64> {
    let mut step: Option<isize> = None;
    let mut extent = 1isize;
    for (&n, &s) in shape.iter().zip(strides).rev() {
        if n == 1 {
            continue;
        }
        match step {
            None => step = Some(s),
            Some(st) if s == st * extent => {}
            Some(_) => return None,
        }
        extent *= n as isize;
    }
    let s = step.unwrap_or(0);
    (s >= 0).then_some(s as i64)
}

/// One GEMM shape with its operand readings and output address.
pub(super) struct Gemm {
    /// The operands' types and the compute type.
    pub(super) ty: GemmType,
    pub(super) out_ty: OutType,
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) a: Matrix,
    pub(super) b: Matrix,
    pub(super) out: u64,
    /// Scale of the output's previous values (0: not read).
    pub(super) beta: f64,
}

/// The batch dims split into outer dims (looped) and the longest inner run that both
/// operands step through with one stride each (one strided-batched call per outer index).
fn run_batches(d: &CudaDevice, g: &Gemm, a: &View, b: &View) -> Result<()> {
    let nb = a.layout.rank() - 2;
    let shape = &a.layout.shape()[..nb];
    let (sa, sb) = (&a.layout.strides()[..nb], &b.layout.strides()[..nb]);
    let inner = |j: usize| {
        Some((
            single_step(&shape[j..], &sa[j..])?,
            single_step(&shape[j..], &sb[j..])?,
        ))
    };
    let split = (0..=nb).find(|&j| inner(j).is_some()).unwrap_or(nb);
    let (step_a, step_b) = inner(split).unwrap_or((0, 0));
    let count: usize = shape[split..].iter().product();
    let outer = |l: &Layout, s: &[isize]| {
        Layout::new(shape[..split].to_vec(), s[..split].to_vec(), l.offset())
    };
    let (oa, ob) = (outer(a.layout, sa), outer(b.layout, sb));
    let (base_a, base_b) = (ptr(a.storage)?, ptr(b.storage)?);
    let size = g.ty.size as u64;
    let out_size = g.out_ty.size as u64;
    for (i, (offa, offb)) in oa.offsets().zip(ob.offsets()).enumerate() {
        let batch = Batch {
            a: base_a + offa as u64 * size,
            b: base_b + offb as u64 * size,
            out: g.out + (i * count * g.m * g.n) as u64 * out_size,
            step_a,
            step_b,
            count,
        };
        gemm_batched(d, g, &batch)?;
    }
    Ok(())
}

/// `count` products with operands `step_*` elements apart and outputs packed.
struct Batch {
    a: u64,
    b: u64,
    out: u64,
    step_a: i64,
    step_b: i64,
    count: usize,
}

/// A GEMM's row in the kernel times: its shape and operand transposes.
fn gemm_name(g: &Gemm, count: usize) -> String {
    let t = |m: Matrix| if m.trans { "T" } else { "N" };
    format!(
        "gemm {}x{}x{} {}{} x{count} {:?}->{:?}",
        g.m,
        g.n,
        g.k,
        t(g.a),
        t(g.b),
        g.ty.data,
        g.out_ty.data
    )
}

/// Issues one batch run, in pieces of at most i32::MAX products.
fn gemm_batched(d: &CudaDevice, g: &Gemm, bt: &Batch) -> Result<()> {
    let op = |m: Matrix| {
        if m.trans {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    };
    let (one32, beta32, one64, beta64) = (1f32, g.beta as f32, 1f64, g.beta);
    let (alpha, beta): (*const c_void, *const c_void) = if g.ty.wide {
        (&one64 as *const f64 as _, &beta64 as *const f64 as _)
    } else {
        (&one32 as *const f32 as _, &beta32 as *const f32 as _)
    };
    let (size, out_size) = (g.ty.size as u64, g.out_ty.size as u64);
    let out_step = (g.m * g.n) as i64;
    let mut start = 0usize;
    while start < bt.count {
        let count = (bt.count - start).min(i32::MAX as usize);
        let at = |base: u64, step: i64| base + (start as i64 * step) as u64 * size;
        let out_at = bt.out + (start as i64 * out_step) as u64 * out_size;
        // SAFETY: the operand addresses, leading dimensions and steps come from layouts that
        // address live device blocks (validated by the matmul family); the
        // output is a contiguous block of batch·m·n elements; alpha/beta are host scalars of
        // the compute type, alive for the call. m, n, k fit in i32 (check_cublas_sizes).
        super::timing::timed(
            d,
            || gemm_name(g, count),
            || {
                unsafe {
                    blas::gemm_strided_batched_ex(
                        *d.blas().handle(),
                        op(g.b),
                        op(g.a),
                        g.n as i32,
                        g.m as i32,
                        g.k as i32,
                        alpha,
                        at(bt.b, bt.step_b) as *const c_void,
                        g.ty.data,
                        g.b.ld,
                        bt.step_b,
                        at(bt.a, bt.step_a) as *const c_void,
                        g.ty.data,
                        g.a.ld,
                        bt.step_a,
                        beta,
                        out_at as *mut c_void,
                        g.out_ty.data,
                        g.n as i32,
                        out_step,
                        count as i32,
                        g.ty.compute,
                        cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
                .map_err(|e| d.err("cublasGemmStridedBatchedEx", e))
            },
        )?;
        start += count;
    }
    Ok(())
}

/// Whether cuBLASLt may take `aux` as a GELU epilogue's auxiliary matrix of rows n wide: its
/// leading dimension (n) a multiple of 8, as cuBLASLt documents for that matrix, and its
/// address 16-byte aligned (so every call sees the same alignment). Elsewhere the product and
/// the elementwise GELU run apart.
fn aux_fits(aux: u64, n: usize) -> bool {
    aux.is_multiple_of(16) && n.is_multiple_of(8)
}

impl MatmulKernels for CudaDevice {
    fn matmul(&self, m: &Matmul) -> Result<()> {
        matmul_acc(self, &m.spec, m.a, m.b, m.out, m.beta)
    }
    fn matmul_bias(&self, m: &Matmul, bias: View) -> Result<()> {
        if !matmul_bias_fused(self, m, &bias)? {
            self.matmul(m)?;
            crate::backend::matmul::add_bias_rows(m, bias)?;
        }
        Ok(())
    }
    fn matmul_row_sums(&self, m: &Matmul, sums: &Storage) -> Result<bool> {
        single_lt(self, m, Epilogue::BiasGrad(ptr(sums)?))
    }
    fn fuses_row_sums(&self) -> bool {
        crate::backend::matmul::bias_grad_epilogue()
    }
    fn matmul_bias_gelu(&self, m: &Matmul, bias: View, pre: &Storage) -> Result<()> {
        let aux = ptr(pre)?;
        let fused = match contiguous_addr(&bias)? {
            Some(b) if aux_fits(aux, m.spec.n) => single_lt(self, m, Epilogue::BiasGelu(b, aux))?,
            _ => false,
        };
        if !fused {
            crate::backend::matmul::bias_gelu_composed(self, m, bias, pre)?;
        }
        Ok(())
    }
    fn matmul_dgelu(&self, m: &Matmul, pre: View) -> Result<()> {
        let fused = match contiguous_addr(&pre)? {
            Some(aux) if aux_fits(aux, m.spec.n) => single_lt(self, m, Epilogue::Dgelu(aux))?,
            _ => false,
        };
        if !fused {
            crate::backend::matmul::dgelu_composed(self, m, pre)?;
        }
        Ok(())
    }
    fn out_row_align(&self, dtype: DType) -> usize {
        out_row_align(dtype)
    }
    fn fuses_gelu_epilogues(&self) -> bool {
        true
    }
}

/// A single (unbatched) product with a contiguous bias through cuBLASLt's BIAS epilogue;
/// false when it does not apply (batched, f64, a strided bias, no algorithm), nothing queued.
fn matmul_bias_fused(d: &CudaDevice, m: &Matmul, bias: &View) -> Result<bool> {
    match contiguous_addr(bias)? {
        Some(addr) => single_lt(d, m, Epilogue::Bias(addr)),
        None => Ok(false),
    }
}

/// The address of a view's first element when its elements are contiguous (row-major).
fn contiguous_addr(v: &View) -> Result<Option<u64>> {
    if !v.layout.is_contiguous() {
        return Ok(None);
    }
    let size = v.storage.dtype().size_in_bytes() as u64;
    Ok(Some(ptr(v.storage)? + v.layout.offset() as u64 * size))
}

/// One product of `m` through cuBLASLt with `epilogue`; false when it does not apply
/// (batched, empty, f64, no algorithm), nothing queued.
fn single_lt(d: &CudaDevice, m: &Matmul, epilogue: Epilogue) -> Result<bool> {
    let MatmulSpec {
        batch,
        m: rows,
        n,
        k,
    } = m.spec;
    // Only a plain product accumulates into its output (beta != 0, read as C in place).
    let accumulates = m.beta != 0.0;
    if batch != 1 || rows * n * k == 0 || (accumulates && !matches!(epilogue, Epilogue::Plain)) {
        return Ok(false);
    }
    let ty = GemmType::of(m.a.storage.dtype())?;
    let out_ty = OutType::of(m.out.dtype())?;
    if ty.wide {
        // f64: cuBLASLt's epilogues scale in f32 only.
        return Ok(false);
    }
    check_cublas_sizes(&m.spec)?;
    d.bind()?;
    let ws = ensure_workspace(d)?;
    let pa = Prepared::new(d, m.a)?;
    let pb = Prepared::new(d, m.b)?;
    let (va, vb) = (pa.view(m.a), pb.view(m.b));
    let size = ty.size as u64;
    let at = |v: &View| -> Result<u64> { Ok(ptr(v.storage)? + v.layout.offset() as u64 * size) };
    let call = Gemm {
        ty,
        out_ty,
        m: rows,
        n,
        k,
        a: pa.matrix()?,
        b: pb.matrix()?,
        out: ptr(m.out)?,
        beta: m.beta,
    };
    super::gemm_lt::gemm_epilogue(d, &call, (at(&va)?, at(&vb)?), ws, epilogue)
}

/// 128-byte rows: the alignment cuBLAS's fast kernels (TMA loads and stores) want of N and K.
pub(crate) fn out_row_align(dtype: DType) -> usize {
    128 / dtype.size_in_bytes().max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matrix_forms() {
        // Row-major (4, 3) with padded rows.
        let m = matrix_form(4, 3, 5, 1).unwrap();
        assert!(!m.trans && m.ld == 5);
        // Its transpose view (3, 4) is column-major.
        let t = matrix_form(3, 4, 1, 5).unwrap();
        assert!(t.trans && t.ld == 5);
        // Single row / column: any stride of the size-1 dim.
        assert_eq!(matrix_form(1, 7, 0, 1).unwrap().ld, 7);
        assert!(matrix_form(7, 1, 1, 0).is_some());
        // Expanded (stride 0 within the matrix) or gapped both ways: copy.
        assert!(matrix_form(4, 3, 0, 1).is_none());
        assert!(matrix_form(4, 3, 6, 2).is_none());
        assert!(matrix_form(4, 3, 2, 1).is_none()); // overlapping rows
    }

    #[test]
    fn single_steps() {
        assert_eq!(single_step(&[2, 3], &[3 * 20, 20]), Some(20));
        assert_eq!(single_step(&[2, 3], &[0, 0]), Some(0));
        assert_eq!(single_step(&[2, 3], &[20, 0]), None);
        assert_eq!(single_step(&[2, 1, 3], &[60, 999, 20]), Some(20));
        assert_eq!(single_step(&[], &[]), Some(0));
    }
}
