//! Human-readable byte sizes, as PyTorch's allocator prints them (`format_size`).

/// `n <= 1024` → "n bytes"; `<= 1 MiB` → KiB; `<= 1 GiB` → MiB; else GiB, two decimals.
pub fn format_size(n: u64) -> String {
    const KIB: f64 = 1024.0;
    let x = n as f64;
    if n <= 1024 {
        format!("{n} bytes")
    } else if n <= 1 << 20 {
        format!("{:.2} KiB", x / KIB)
    } else if n <= 1 << 30 {
        format!("{:.2} MiB", x / (KIB * KIB))
    } else {
        format!("{:.2} GiB", x / (KIB * KIB * KIB))
    }
}

#[cfg(test)]
mod tests {
    use super::format_size;

    #[test]
    fn sizes_match_pytorch_format() {
        assert_eq!(format_size(1000), "1000 bytes");
        assert_eq!(format_size(2048), "2.00 KiB");
        assert_eq!(format_size(20 << 20), "20.00 MiB");
        assert_eq!(format_size(3 << 30), "3.00 GiB");
    }
}
