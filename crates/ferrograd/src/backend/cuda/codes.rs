//! The one table of integer codes that launchers pass to kernels: dtype codes (DT_*) and the
//! op codes of the unary (U_*), binary (B_*) and reduce (R_*) kernels. Rust uses the consts;
//! the kernels get them as a `#define` block generated from the same table and prepended to
//! every NVRTC source (before kernels/prelude.cuh), so the two sides cannot drift. A unit test
//! checks that every code a .cu/.cuh file names is in the table and that none defines its own.

/// Declares each code as a Rust const and lists them all in `TABLE`.
macro_rules! codes {
    ($($name:ident = $value:expr),* $(,)?) => {
        $(pub(crate) const $name: i32 = $value;)*
        /// (name, value) of every code.
        pub(crate) const TABLE: &[(&str, i32)] = &[$((stringify!($name), $value)),*];
    };
}

codes! {
    // dtype codes (`load_f64` / `store_f64` in prelude.cuh)
    DT_F32 = 0,
    DT_F64 = 1,
    DT_F16 = 2,
    DT_BF16 = 3,
    DT_I64 = 4,
    DT_U8 = 5,
    // unary ops (elementwise.cu)
    U_NEG = 0,
    U_EXP = 1,
    U_LOG = 2,
    U_SQRT = 3,
    U_TANH = 4,
    U_SIGMOID = 5,
    U_RELU = 6,
    U_GELU_TANH = 7,
    U_GELU_ERF = 8,
    U_ABS = 9,
    U_ADD_SCALAR = 10,
    U_MUL_SCALAR = 11,
    U_POW_SCALAR = 12,
    U_STEP = 13,
    U_CLAMP = 14,
    // binary ops (elementwise.cu)
    B_ADD = 0,
    B_SUB = 1,
    B_MUL = 2,
    B_DIV = 3,
    B_POW = 4,
    B_MAXIMUM = 5,
    B_ADD_SCALED = 6,
    B_ASSIGN = 7,
    B_RELU_BACKWARD = 8,
    B_TANH_BACKWARD = 9,
    B_SIGMOID_BACKWARD = 10,
    B_GELU_TANH_BACKWARD = 11,
    B_GELU_ERF_BACKWARD = 12,
    B_EQ = 13,
    // reductions (reduce.cu)
    R_SUM = 0,
    R_MAX = 1,
    R_MIN = 2,
    R_ARGMAX = 3,
}

/// The `#define` block of every code, prepended to each kernel source.
pub(crate) fn header() -> String {
    let mut s = String::from("// generated from backend/cuda/codes.rs\n");
    for (name, value) in TABLE {
        s.push_str(&format!("#define {name} {value}\n"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel source, by file name.
    const SOURCES: &[(&str, &str)] = &[
        ("prelude.cuh", include_str!("kernels/prelude.cuh")),
        ("elementwise.cu", include_str!("kernels/elementwise.cu")),
        ("reduce.cu", include_str!("kernels/reduce.cu")),
        ("rows.cu", include_str!("kernels/rows.cu")),
        ("loss.cu", include_str!("kernels/loss.cu")),
        ("index.cu", include_str!("kernels/index.cu")),
        ("optim.cu", include_str!("kernels/optim.cu")),
        (
            "attention_common.cuh",
            include_str!("kernels/attention_common.cuh"),
        ),
        ("attention.cu", include_str!("kernels/attention.cu")),
        ("attention_f32.cu", include_str!("kernels/attention_f32.cu")),
    ];

    /// Identifiers shaped like codes (DT_X, U_X, B_X, R_X) in a source, comments included.
    fn code_names(src: &str) -> Vec<&str> {
        src.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| {
                ["DT_", "U_", "B_", "R_"].iter().any(|p| {
                    w.starts_with(p)
                        && w.len() > p.len()
                        && w[p.len()..]
                            .chars()
                            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
                })
            })
            .collect()
    }

    #[test]
    fn every_code_a_kernel_names_is_in_the_table() {
        for (file, src) in SOURCES {
            for name in code_names(src) {
                assert!(
                    TABLE.iter().any(|(n, _)| *n == name),
                    "{file} uses {name}, which backend/cuda/codes.rs does not define"
                );
            }
        }
    }

    #[test]
    fn no_kernel_file_defines_a_code_or_a_second_prelude() {
        for (file, src) in SOURCES {
            for (name, _) in TABLE {
                assert!(
                    !src.contains(&format!("#define {name} ")),
                    "{file} defines {name}: codes come from the generated header only"
                );
            }
            if *file != "prelude.cuh" {
                for own in [
                    "typedef long long i64",
                    "f16_to_f32(u16",
                    "struct Strided {",
                ] {
                    assert!(!src.contains(own), "{file} redefines prelude item `{own}`");
                }
            }
        }
    }

    #[test]
    fn codes_are_unique_within_a_family() {
        for prefix in ["DT_", "U_", "B_", "R_"] {
            let mut values: Vec<i32> = TABLE
                .iter()
                .filter(|(n, _)| n.starts_with(prefix))
                .map(|&(_, v)| v)
                .collect();
            let count = values.len();
            values.sort_unstable();
            values.dedup();
            assert_eq!(values.len(), count, "duplicate {prefix} code");
        }
    }

    #[test]
    fn header_defines_every_code_once() {
        let h = header();
        for (name, value) in TABLE {
            assert_eq!(h.matches(&format!("#define {name} {value}\n")).count(), 1);
        }
    }
}
