//! A fresh, empty folder for one test, removed when dropped: shared by the library's file
//! tests and the command-line tests (included by path). Not a test by itself.
#![allow(dead_code)]

use std::path::PathBuf;

pub struct TestDir(PathBuf);

impl TestDir {
    /// `<temp>/ferrograd-<name>-<pid>`, emptied first.
    pub fn new(name: &str) -> TestDir {
        let dir = std::env::temp_dir().join(format!("ferrograd-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TestDir(dir)
    }
    pub fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }
    /// `path` as a command-line argument.
    pub fn arg(&self, file: &str) -> String {
        self.path(file).to_str().unwrap().to_string()
    }
    /// Names of the files in the folder, sorted.
    pub fn files(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
