//! The crate's layers hold: a top-level module may import only modules listed before it in
//! the tour at the top of `src/lib.rs` (the one place the order is written). The test reads
//! every `crate::<module>` path in the source (use lines and inline paths, comments skipped)
//! and fails naming each offending line. A cycle between two modules always contains such an
//! upward import, so no cycle can pass.

use std::fs;
use std::path::{Path, PathBuf};

/// One import that points up the declared order.
#[derive(Debug, PartialEq)]
struct Violation {
    file: String,
    line: usize,
    from: String,
    to: String,
}

/// The layer order: the modules named in the tour lines `//! N. `module` — ...` of lib.rs.
fn declared_order(lib_rs: &str) -> Vec<String> {
    lib_rs
        .lines()
        .filter_map(|l| l.strip_prefix("//! "))
        .filter_map(|l| {
            let (num, rest) = l.split_once(". `")?;
            num.trim().parse::<usize>().ok()?;
            Some(rest.split_once('`')?.0.to_string())
        })
        .collect()
}

/// The modules lib.rs declares (`pub mod name;` / `mod name;`).
fn declared_modules(lib_rs: &str) -> Vec<String> {
    lib_rs
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            Some(l.strip_prefix("mod ")?.strip_suffix(';')?.to_string())
        })
        .collect()
}

/// The modules `text` names through `crate::<module>`, per line, comments skipped. A group
/// import `crate::{a, b}` counts as each module it names.
fn crate_paths(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let inner = group.split('}').next().unwrap_or("");
                for part in inner.split(',') {
                    let name = part.trim().split("::").next().unwrap_or("").trim();
                    if !name.is_empty() {
                        found.push((i + 1, name.to_string()));
                    }
                }
                continue;
            }
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                found.push((i + 1, name));
            }
        }
    }
    found
}

/// Upward imports of module `from` in one file.
fn check_file(order: &[String], from: &str, file: &str, text: &str) -> Vec<Violation> {
    let rank = |m: &str| order.iter().position(|o| o == m);
    let Some(own) = rank(from) else {
        return vec![Violation {
            file: file.to_string(),
            line: 0,
            from: from.to_string(),
            to: "(module missing from the tour in lib.rs)".to_string(),
        }];
    };
    crate_paths(text)
        .into_iter()
        .filter(|(_, to)| rank(to).is_some_and(|r| r > own))
        .map(|(line, to)| Violation {
            file: file.to_string(),
            line,
            from: from.to_string(),
            to,
        })
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("source folder readable").flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a source file belongs to (None for lib.rs).
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    if first == "lib.rs" {
        return None;
    }
    Some(first.trim_end_matches(".rs").to_string())
}

#[test]
fn every_module_imports_only_modules_below_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let lib = fs::read_to_string(src.join("lib.rs")).expect("lib.rs readable");
    let order = declared_order(&lib);
    let mut modules = declared_modules(&lib);
    let mut listed = order.clone();
    modules.sort();
    listed.sort();
    assert_eq!(
        listed, modules,
        "the tour in lib.rs must list every top-level module exactly once"
    );

    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut violations = Vec::new();
    for file in &files {
        let Some(from) = module_of(&src, file) else {
            continue;
        };
        let text = fs::read_to_string(file).expect("source file readable");
        let name = file
            .strip_prefix(&src)
            .unwrap_or(file)
            .display()
            .to_string();
        violations.extend(check_file(&order, &from, &name, &text));
    }
    let report: Vec<String> = violations
        .iter()
        .map(|v| {
            format!(
                "src/{}:{}: `{}` imports `{}`, which comes after it in lib.rs's order",
                v.file, v.line, v.from, v.to
            )
        })
        .collect();
    assert!(report.is_empty(), "upward imports:\n{}", report.join("\n"));
}

#[test]
fn the_check_catches_an_upward_import_and_so_any_cycle() {
    let order: Vec<String> = ["base", "memory", "backend"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    // memory ↔ backend: the memory side of the cycle is the upward import.
    let text = "//! memory\nuse crate::base::Result;\nuse crate::backend::Storage;\n";
    assert_eq!(
        check_file(&order, "memory", "memory/x.rs", text),
        vec![Violation {
            file: "memory/x.rs".into(),
            line: 3,
            from: "memory".into(),
            to: "backend".into()
        }]
    );
    // Inline paths and group imports count; comments do not.
    let inline = "fn f() { crate::backend::synchronize(); } // crate::backend in a comment\n";
    assert_eq!(check_file(&order, "memory", "m.rs", inline).len(), 1);
    let group = "use crate::{base::Error, backend::View};\n";
    assert_eq!(check_file(&order, "memory", "m.rs", group).len(), 1);
    assert!(check_file(&order, "backend", "b.rs", text).is_empty());
    // A module the tour forgets is reported too.
    assert_eq!(check_file(&order, "nn", "nn/x.rs", "").len(), 1);
}

#[test]
fn the_tour_is_read_from_numbered_lines() {
    let lib =
        "//! Intro\n//! 1. `base` — plain data\n//! 2. `memory` — bytes\n//! - `x` not a layer\n";
    assert_eq!(declared_order(lib), vec!["base", "memory"]);
    assert_eq!(
        declared_modules("pub mod base;\nmod memory;\npub use base::Error;\n"),
        vec!["base", "memory"]
    );
}
