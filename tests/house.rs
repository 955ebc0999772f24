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

/// Files under `dir`, build folders (`target`, `__pycache__`) and hidden ones left out.
fn project_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return out };
    for entry in entries {
        let p = entry.expect("dir entry").path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if p.is_dir() && !name.starts_with('.') && name != "target" && name != "__pycache__" {
            out.extend(project_files(&p));
        } else if p.is_file() {
            out.push(p);
        }
    }
    out
}

/// The Python files of the project (the package, its tests, scripts, examples).
fn python_files(dir: &Path) -> Vec<PathBuf> {
    project_files(dir).into_iter().filter(|p| p.extension().is_some_and(|e| e == "py")).collect()
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

/// The module a source file is, as path segments under `src/` (`mod.rs`: its folder's).
fn module_of(file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src()).expect("under src");
    let mut segs: Vec<String> = rel.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    let last = segs.pop().expect("a file name");
    if last != "mod.rs" {
        segs.push(last.trim_end_matches(".rs").to_string());
    }
    segs
}

/// The file of module `segs`, where it has one.
fn module_file(segs: &[String]) -> Option<PathBuf> {
    let base = segs.iter().fold(src(), |p, s| p.join(s));
    [base.with_extension("rs"), base.join("mod.rs")].into_iter().find(|p| !segs.is_empty() && p.is_file())
}

/// The paths a `use` tree names, braces expanded (`a::{b, c::d}` is `a::b` and `a::c::d`).
fn use_paths(tree: &str) -> Vec<String> {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else { return vec![tree.to_string()] };
    let (prefix, inner) = (&tree[..open], &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())]);
    let (mut parts, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts.iter().filter(|p| !p.trim().is_empty()).flat_map(|p| use_paths(p)).map(|p| format!("{prefix}{p}")).collect()
}

/// The module files a file's `use` declarations import from (before its test module): each path
/// followed from the file's module (`super`, `self`) or the crate root (`crate`) as far as it
/// names module files; `use super::*` imports the parent. A module's imports of its own
/// descendants are not edges: it holds them (as its `mod` lines do), and re-exports them.
fn import_edges(file: &Path) -> Vec<(PathBuf, String)> {
    let text = std::fs::read_to_string(file).expect("readable");
    let own = module_of(file);
    let mut statements = Vec::new();
    let mut open: Option<String> = None;
    for line in text.lines() {
        let l = line.trim_start();
        if l.starts_with("#[cfg(test)]") {
            break;
        }
        let l = l.split("//").next().unwrap_or("");
        let l = l.strip_prefix("pub ").or_else(|| l.strip_prefix("pub(crate) ")).or_else(|| l.strip_prefix("pub(super) ")).unwrap_or(l);
        match open.as_mut() {
            Some(s) => s.push_str(l),
            None if l.starts_with("use ") => open = Some(l["use ".len()..].to_string()),
            None => continue,
        }
        if open.as_ref().is_some_and(|s| s.contains(';')) {
            statements.push(open.take().unwrap_or_default().trim_end_matches(';').to_string());
        }
    }
    let mut out = Vec::new();
    for stmt in &statements {
        for path in use_paths(stmt) {
            let segs: Vec<&str> = path.split("::").map(str::trim).collect();
            let mut at: Vec<String> = match segs.first() {
                Some(&"crate") => Vec::new(),
                Some(&"super") | Some(&"self") => own.clone(),
                _ => continue, // an extern crate's or a local name's path
            };
            let mut rest = &segs[usize::from(segs[0] == "crate" || segs[0] == "self")..];
            while rest.first() == Some(&"super") {
                at.pop();
                rest = &rest[1..];
            }
            for seg in rest {
                let mut next = at.clone();
                next.push(seg.to_string());
                if module_file(&next).is_none() {
                    break;
                }
                at = next;
            }
            if at.starts_with(&own) {
                continue; // itself, or a module it holds
            }
            if let Some(f) = module_file(&at) {
                out.push((f, path.clone()));
            }
        }
    }
    out
}

/// A circle of imports among `files`, if any: the files on it, in order.
fn import_circle(files: &[PathBuf]) -> Option<Vec<String>> {
    let edges: Vec<Vec<usize>> =
        files.iter().map(|f| import_edges(f).into_iter().filter_map(|(t, _)| files.iter().position(|g| *g == t)).collect()).collect();
    // Depth-first, marking files on the current path (1) and done (2).
    fn visit(v: usize, edges: &[Vec<usize>], mark: &mut [u8], path: &mut Vec<usize>) -> Option<Vec<usize>> {
        mark[v] = 1;
        path.push(v);
        for &w in &edges[v] {
            if mark[w] == 1 {
                let from = path.iter().position(|&x| x == w).unwrap_or(0);
                return Some(path[from..].iter().copied().chain([w]).collect());
            }
            if mark[w] == 0 {
                if let Some(c) = visit(w, edges, mark, path) {
                    return Some(c);
                }
            }
        }
        path.pop();
        mark[v] = 2;
        None
    }
    let mut mark = vec![0u8; files.len()];
    (0..files.len())
        .find_map(|v| if mark[v] == 0 { visit(v, &edges, &mut mark, &mut Vec::new()) } else { None })
        .map(|c| c.into_iter().map(|i| files[i].strip_prefix(src()).unwrap_or(&files[i]).display().to_string()).collect())
}

/// No import circle among the files of the cpu executor and of the op layer: what two files
/// both need goes to a leaf both import (`exec/cpu/raw.rs`: the span loop; `kvcacheio/catalogue/
/// spec.rs`: the catalogue's records), never one into the other and back.
#[test]
fn no_import_circle_in_cpu_executor_or_ops() {
    for dir in [src().join("exec").join("cpu"), src().join("kvcacheio")] {
        let files = rust_files(&dir);
        assert!(files.len() > 3, "the rule sees {}", dir.display());
        if let Some(circle) = import_circle(&files) {
            panic!("an import circle: {} (move what they share to a leaf module)", circle.join(" -> "));
        }
    }
    // The rule sees a circle: `copy` and `checksums` importing each other, as they once did.
    let cpu = src().join("exec").join("cpu");
    assert!(import_edges(&cpu.join("copy.rs")).iter().any(|(t, _)| t.ends_with("checksums.rs")), "copy imports checksums");
    assert!(import_edges(&cpu.join("checksums.rs")).iter().all(|(t, _)| !t.ends_with("copy.rs")));
    assert_eq!(use_paths("super::{a, b::{c, d}}"), ["super::a", "super::b::c", "super::b::d"]);
}

/// The Rust tests' files (`tests/`, `tests/common/` included).
fn test_files() -> Vec<PathBuf> {
    rust_files(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests"))
}

/// One builder of pool pairs for the Rust tests: `tests/common`'s `pools`, never one per file.
#[test]
fn one_pools_builder_in_tests() {
    let common = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("common");
    let mut found = Vec::new();
    for file in test_files() {
        let text = std::fs::read_to_string(&file).expect("readable");
        for (n, line) in text.lines().enumerate() {
            let code = line.trim_start();
            let defines = ["fn pools(", "fn pools<"].iter().any(|w| code.starts_with(w) || code.contains(&format!(" {w}")));
            if defines && !code.starts_with("//") {
                found.push((file.starts_with(&common), format!("{}:{}", file.display(), n + 1)));
            }
        }
    }
    let elsewhere: Vec<&String> = found.iter().filter(|(c, _)| !c).map(|(_, at)| at).collect();
    assert!(elsewhere.is_empty(), "a `fn pools` outside tests/common (use common::pools): {elsewhere:?}");
    assert!(found.iter().any(|(c, _)| *c), "the rule sees tests/common's builder");
}

/// No Rust test function (a `#[test]` or a helper) over 100 lines: a longer one checks several
/// things, and is split into helpers by what its parts check.
#[test]
fn no_test_function_over_100_lines() {
    let mut long = Vec::new();
    for file in test_files() {
        let text = std::fs::read_to_string(&file).expect("readable");
        for (line, name, n) in function_lengths(&text) {
            if n > 100 {
                long.push(format!("{}:{line} {name}: {n} lines", file.display()));
            }
        }
    }
    assert!(long.is_empty(), "test functions over 100 lines (split them into helpers):\n{}", long.join("\n"));
}

/// Text files under `dir` (binaries, such as the built module, and build folders left out).
fn text_files(dir: &Path) -> Vec<(PathBuf, String)> {
    project_files(dir).into_iter().filter_map(|p| std::fs::read_to_string(&p).ok().map(|t| (p, t))).collect()
}

/// The local L3 store's object footer is one file's format: its magic is spelled in
/// `python/src/local_io.rs` only (which writes, reads and checks it; the scrub calls it).
#[test]
fn local_footer_spelled_in_one_file() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let magic = ["HIO", "LOC01"].concat(); // not spelled here, so that this file is no exception
    let owner = root.join("python").join("src").join("local_io.rs");
    let files: Vec<(PathBuf, String)> = ["python", "src"].iter().flat_map(|d| text_files(&root.join(d))).collect();
    let spelled: Vec<&PathBuf> = files.iter().filter(|(_, t)| t.contains(&magic)).map(|(p, _)| p).collect();
    assert_eq!(spelled, [&owner], "the local store's footer magic is spelled outside python/src/local_io.rs");
}
