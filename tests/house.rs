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

/// The layers of the library, lowest first; a module may import (`crate::…`) only from its own
/// layer and the ones before it: the import graph between modules has no circle. The command
/// line (`src/cli/`) is a binary of its own, above everything.
const LAYERS: &[&[&str]] = &[
    &["cpu_features", "rng", "names"],
    &["error"],
    &["geometry", "timing", "integrity"],
    &["plan"],
    &["exec"],
    &["pool"],
    &["kvcacheio", "blocks"],
    &["tools"],
];

/// The names the crate root re-exports, by the module they come from.
const ROOT_NAMES: &[(&str, &str)] = &[
    ("Result", "error"),
    ("TransferError", "error"),
    ("IoBackend", "names"),
    ("LayerMap", "geometry"),
    ("Layout", "names"),
    ("PoolKind", "names"),
    ("Profile", "names"),
    ("Device", "exec"),
    ("Completion", "exec"),
    ("ExecutorKind", "exec"),
    ("BackendKind", "exec"),
    ("Capabilities", "plan"),
    ("Op", "plan"),
    ("Plan", "plan"),
    ("Request", "plan"),
];

fn layer_of(module: &str) -> Option<usize> {
    let module = ROOT_NAMES.iter().find(|(n, _)| *n == module).map_or(module, |(_, m)| m);
    LAYERS.iter().position(|l| l.contains(&module)).or_else(|| {
        let pool = ["DevicePool", "DevicePoolConfig", "Hold", "HostPool", "HostPoolConfig", "LayerLoads", "Pipeline"];
        let more = ["SharedDevicePool", "SharedHostPool", "Ticket", "Transfer"];
        (pool.contains(&module) || more.contains(&module)).then(|| layer_of("pool")).flatten()
    })
}

/// The `crate::…` paths of a file's code (comments and the test module at its end left out).
fn crate_paths(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let l = line.trim_start();
        if l.starts_with("#[cfg(test)]") {
            break;
        }
        if l.starts_with("//") {
            continue;
        }
        let code = l.split("//").next().unwrap_or("");
        for (i, _) in code.match_indices("crate::") {
            let rest = &code[i + "crate::".len()..];
            let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            if !name.is_empty() {
                out.push((n + 1, name));
            }
        }
    }
    out
}

#[test]
fn layers_import_only_from_their_own_layer_and_below() {
    for file in rust_files(&src()) {
        let rel = file.strip_prefix(src()).expect("under src");
        let top = rel.components().next().expect("a component").as_os_str().to_string_lossy().trim_end_matches(".rs").to_string();
        if top == "lib" || top == "cli" {
            continue;
        }
        let own = layer_of(&top).unwrap_or_else(|| panic!("{}: module `{top}` is in no layer of LAYERS", file.display()));
        let text = std::fs::read_to_string(&file).expect("readable");
        for (line, name) in crate_paths(&text) {
            let Some(theirs) = layer_of(&name) else { continue };
            assert!(
                theirs <= own,
                "{}:{line}: `{top}` (layer {own}) imports `{name}` (layer {theirs}): an import from a higher layer",
                file.display()
            );
        }
    }
}

/// Executor types (`CpuExecutor`, `CudaBuffer`, …) are named inside `src/exec/` only: everything
/// above reaches an executor through `Device` and `Buffer`.
#[test]
fn no_backend_type_is_named_outside_exec() {
    let backends = ["cpu::", "cuda::", "wgpu::"];
    let types = ["CpuBuffer", "CpuExecutor", "CudaBuffer", "CudaExecutor", "WgpuBuffer", "WgpuExecutor"];
    for file in rust_files(&src()) {
        if file.starts_with(src().join("exec")) {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("readable");
        for (n, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            let code = code.split("//").next().unwrap_or("");
            for word in types.iter().chain(backends.iter().filter(|_| code.contains("exec::"))) {
                let hit = code.match_indices(word).any(|(i, _)| !code[..i].chars().last().is_some_and(|c| c.is_alphanumeric() || c == '_'));
                assert!(!hit, "{}:{}: names a backend type outside src/exec ({word}): {line}", file.display(), n + 1);
            }
        }
    }
}

/// Lengths of the functions in a (rustfmt-formatted) file: `(first line, name, lines)`, from the
/// `fn` line to its closing brace, which rustfmt puts on a line of its own at the `fn`'s indent.
fn function_lengths(text: &str) -> Vec<(usize, String, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let code = line.trim_start();
        if code.starts_with("//") {
            continue;
        }
        let indent = line.len() - code.len();
        let words =
            ["fn ", "pub fn ", "pub(crate) fn ", "pub(super) fn ", "unsafe fn ", "pub unsafe fn ", "pub(crate) unsafe fn ", "const fn "];
        let Some(rest) = words.iter().find_map(|w| code.strip_prefix(w)) else { continue };
        let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        if name.is_empty() || code.ends_with(';') || code.ends_with('}') {
            continue; // a macro's `fn $name`, a declaration, or a one-line function
        }
        let end = (i + 1..lines.len()).find(|&j| {
            let l = lines[j];
            l.len() > indent && l[..indent].trim().is_empty() && l[indent..].starts_with('}')
        });
        if let Some(end) = end {
            out.push((i + 1, name, end - i + 1));
        }
    }
    out
}

/// No function over 80 lines in the library, the command line or the Python bindings: a longer
/// one does several things, and is split by what its parts do.
#[test]
fn no_function_over_80_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut long = Vec::new();
    for file in rust_files(&src()).into_iter().chain(rust_files(&root.join("python").join("src"))) {
        let text = std::fs::read_to_string(&file).expect("readable");
        for (line, name, n) in function_lengths(&text) {
            if n > 80 {
                long.push(format!("{}:{line} {name}: {n} lines", file.display()));
            }
        }
    }
    assert!(long.is_empty(), "functions over 80 lines (split them by what their parts do):\n{}", long.join("\n"));
    // The rule can see a long function: this one's own shape.
    let sample = format!("fn long() {{\n{}}}\n", "    let x = 1;\n".repeat(81));
    assert_eq!(function_lengths(&sample), vec![(1, "long".to_string(), 83)]);
}

/// The Python files of the project (the package, its tests, scripts, examples).
fn python_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return out };
    for entry in entries {
        let p = entry.expect("dir entry").path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if p.is_dir() && !name.starts_with('.') && name != "target" && name != "__pycache__" {
            out.extend(python_files(&p));
        } else if p.extension().is_some_and(|e| e == "py") {
            out.push(p);
        }
    }
    out
}

/// No Python file past 700 lines either: the L3 store was once a 1,200-line room of mixins.
#[test]
fn no_python_file_over_700_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files: Vec<PathBuf> = ["python", "scripts", "examples"].iter().flat_map(|d| python_files(&root.join(d))).collect();
    assert!(files.iter().any(|f| f.ends_with("python/hicache_io/storage.py")), "the rule sees the package");
    for file in files {
        let lines = std::fs::read_to_string(&file).expect("readable").lines().count();
        assert!(lines <= 700, "{} has {lines} lines: split it by concern", file.display());
    }
}
