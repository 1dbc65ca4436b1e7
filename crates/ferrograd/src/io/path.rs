//! Output paths checked before any work starts: a run that would train for an hour and then
//! fail to write its result is refused up front, with the path and what to do.
//!
//! `check_output_path` accepts a path whose folder exists and is writable (probed by creating
//! and removing a file there) and whose target is absent or a regular file. Anything else — a
//! folder, a device such as `/dev/null`, a pipe, a socket — is refused: saving renames a new
//! file over the target, which would replace a device node with a regular file.

use std::ffi::OsString;
use std::fs::{self, OpenOptions};
use std::path::Path;

use crate::base::{Error, Result};

/// Refuses a path the state cannot be written to, before anything is computed.
pub fn check_output_path(path: &Path) -> Result<()> {
    let refuse = |detail: String| Error::OutputPath {
        path: path.display().to_string(),
        detail,
    };
    let Some(name) = path.file_name() else {
        return Err(refuse(
            "it names no file; give a path like run/state.safetensors".into(),
        ));
    };
    check_target(path, &refuse)?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    match fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(refuse(format!(
                "{} is not a folder; save into an existing folder",
                dir.display()
            )));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(refuse(format!(
                "the folder {} does not exist; create it first (mkdir -p {}) or save elsewhere",
                dir.display(),
                dir.display()
            )));
        }
        Err(e) => {
            return Err(refuse(format!(
                "cannot read the folder {} ({e}); save into a folder you can write to",
                dir.display()
            )));
        }
    }
    let mut probe = OsString::from(".");
    probe.push(name);
    probe.push(format!(".{}.probe.tmp", std::process::id()));
    let probe = dir.join(probe);
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
        .map_err(|e| {
            refuse(format!(
                "cannot create files in {} ({e}); save into a folder you can write to",
                dir.display()
            ))
        })?;
    let _ = fs::remove_file(&probe);
    Ok(())
}

/// The target itself: absent, or a regular file (through symlinks).
fn check_target(path: &Path, refuse: &dyn Fn(String) -> Error) -> Result<()> {
    let meta = match fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        // The folder check below names the cause (a missing or unreadable folder).
        Err(_) => return Ok(()),
    };
    if meta.is_dir() {
        return Err(refuse(format!(
            "it is a folder; name a file inside it, e.g. {}",
            path.join("state.safetensors").display()
        )));
    }
    if !meta.is_file() {
        return Err(refuse(
            "it is not a regular file (a device, pipe or socket) and saving would replace it; name a regular file"
                .into(),
        ));
    }
    Ok(())
}
