//! The shape of the source tree, checked: backends import the shared core and never the
//! dispatcher, and no source file grows past what one reader holds (they are split by concern).

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("readable source dir") {
        let p = entry.expect("dir entry").path();
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
    out.sort();
    out
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// `use` lines of the backends name the core (`Executor`, `Ticket`, `Stream`, `Bindings`,
/// `ChecksumBinding`, `AutoSlot`, `ExecutorKind`, `host`, `settle`) and never the dispatcher
/// (`Device`, `Buffer`, `Completion`, its files `device`, `completion`, `run`, `fault`,
/// `calibrate`): the import graph has no loop between them.
#[test]
fn backends_never_import_the_dispatcher() {
    let dispatcher = ["Device", "Buffer", "Completion", "device::", "completion::", "run::", "fault::", "calibrate::"];
    for backend in ["cpu", "wgpu", "cuda"] {
        for file in rust_files(&src().join("exec").join(backend)) {
            let text = std::fs::read_to_string(&file).expect("readable");
            for (n, line) in text.lines().enumerate() {
                let l = line.trim_start();
                if !(l.starts_with("use super") || l.starts_with("use crate::exec") || l.starts_with("pub use super")) {
                    continue;
                }
                for word in dispatcher {
                    let hit = l.match_indices(word).any(|(i, _)| {
                        let before = l[..i].chars().last();
                        let after = l[i + word.len()..].chars().next();
                        !before.is_some_and(|c| c.is_alphanumeric() || c == '_') && !after.is_some_and(|c| c.is_alphanumeric() || c == '_')
                    });
                    assert!(!hit, "{}:{}: a backend imports the dispatcher ({word}): {line}", file.display(), n + 1);
                }
            }
        }
    }
}

/// No source file past 700 lines: a file that long holds several concerns and is split into a
/// folder of them.
#[test]
fn no_source_file_over_700_lines() {
    for file in rust_files(&src()) {
        let lines = std::fs::read_to_string(&file).expect("readable").lines().count();
        assert!(lines <= 700, "{} has {lines} lines: split it by concern", file.display());
    }
}
