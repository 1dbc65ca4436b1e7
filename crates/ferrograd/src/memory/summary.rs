//! `memory_summary`: the table PyTorch prints (same sections, columns and unit rules), plus
//! a section that ferrograd adds: allocated bytes by category.

use super::stats::{DeviceStats, Stat, StatArray};
use crate::base::CategoryBytes;
use crate::base::Device;

const RULE: usize = 75;

/// PyTorch's `_format_size`: the unit is chosen from `pref` (the section's `all` value) and
/// moves up only when `pref >= 768` of the next unit.
fn format_size_cell(mut sz: i64, mut pref: i64) -> String {
    let units = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut unit = units[0];
    for next in &units[1..] {
        if pref < 768 * 1024 {
            break;
        }
        unit = next;
        sz /= 1024;
        pref /= 1024;
    }
    format!("{sz:6} {unit}")
}

fn format_count_cell(mut cnt: i64, mut pref: i64) -> String {
    let units = [" ", "K", "M"];
    let mut unit = units[0];
    for next in &units[1..] {
        if pref < 750 * 1000 {
            break;
        }
        unit = next;
        cnt /= 1000;
        pref /= 1000;
    }
    format!("{cnt:7} {unit} ")
}

fn row(name: &str, s: &Stat, pref: &Stat, bytes: bool) -> String {
    let cell = |v: i64, p: i64| {
        if bytes {
            format_size_cell(v, p)
        } else {
            format_count_cell(v, p)
        }
    };
    format!(
        " {name:<21} | {} | {} | {} | {} ",
        cell(s.current, pref.current),
        cell(s.peak, pref.peak),
        cell(s.allocated, pref.allocated),
        cell(s.freed, pref.freed)
    )
}

fn section(lines: &mut Vec<String>, title: &str, a: &StatArray, bytes: bool, abbreviated: bool) {
    lines.push("-".repeat(RULE));
    lines.push(row(title, &a.all, &a.all, bytes));
    if !abbreviated {
        lines.push(row("      from large pool", &a.large_pool, &a.all, bytes));
        lines.push(row("      from small pool", &a.small_pool, &a.all, bytes));
    }
}

/// The summary table for one device.
pub fn memory_summary(
    device: Device,
    stats: &DeviceStats,
    categories: &CategoryBytes,
    abbreviated: bool,
) -> String {
    let mut lines = vec![
        "=".repeat(RULE),
        format!(
            " {:<16} ferrograd memory summary, device {:<19} ",
            "",
            device.to_string()
        ),
        "-".repeat(RULE),
        format!(
            "  {:9} OOMs: {:<17} | {:6} device-alloc retries: {:<8}",
            "", stats.num_ooms, "", stats.num_alloc_retries
        ),
        "=".repeat(RULE),
        "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ".into(),
    ];
    let byte_sections = [
        ("Allocated memory", &stats.allocated_bytes),
        ("Active memory", &stats.active_bytes),
        ("Requested memory", &stats.requested_bytes),
        ("Reserved memory", &stats.reserved_bytes),
        ("Non-releasable memory", &stats.inactive_split_bytes),
    ];
    for (title, a) in byte_sections {
        section(&mut lines, title, a, true, abbreviated);
    }
    let count_sections = [
        ("Allocations", &stats.allocation),
        ("Active allocs", &stats.active),
        ("Reserved segments", &stats.segment),
        ("Non-releasable allocs", &stats.inactive_split),
    ];
    for (title, a) in count_sections {
        section(&mut lines, title, a, false, abbreviated);
    }
    lines.push("=".repeat(RULE));
    lines.push(format!(" {:<21} | {:<48}", "Category", "Cur Usage"));
    lines.push("-".repeat(RULE));
    let total = categories.total() as i64;
    for (c, b) in categories.iter() {
        lines.push(format!(
            " {:<21} | {} {:<37}",
            c.name(),
            format_size_cell(b as i64, total),
            ""
        ));
    }
    lines.push("=".repeat(RULE));
    let body: Vec<String> = lines.iter().map(|l| format!("|{l:<RULE$}|")).collect();
    body.join("\n") + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_follow_pytorch_rules() {
        // 512 MiB prints as KiB because it is below 768 MiB.
        assert_eq!(format_size_cell(512 << 20, 512 << 20), "524288 KiB");
        assert_eq!(format_size_cell(0, 0), "     0 B  ");
        assert_eq!(format_count_cell(12, 12), "     12   ");
    }

    #[test]
    fn summary_lines_have_fixed_width() {
        let s = memory_summary(
            Device::Cpu,
            &DeviceStats::default(),
            &CategoryBytes::default(),
            false,
        );
        assert!(s.lines().all(|l| l.chars().count() == RULE + 2), "{s}");
        assert!(s.contains("Allocated memory"));
        assert!(s.contains("saved_activation"));
    }
}
