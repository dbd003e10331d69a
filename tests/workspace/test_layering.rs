//! The dependency rule of docs/architecture.md: the library's top-level
//! modules form layers, and a module uses only modules of lower layers (test
//! code excepted: a test may use anything). Read from the sources: every
//! `crate::<module>` path outside comments and outside `#[cfg(test)]`
//! modules, which sit at the end of their files.

use std::collections::BTreeSet;
use std::path::Path;

/// The layers, lowest first; the same table as docs/architecture.md.
const LAYERS: &[&[&str]] = &[
    &["clock", "limiter", "protocol", "stable_hash"],
    &["client", "metrics", "rules"],
    &["store"],
    &["engine"],
    &["server"],
    &["cluster", "droplet", "envoy"],
    &["observability"],
    &["app"],
    &["cli"],
];

fn layer_of(module: &str) -> usize {
    LAYERS
        .iter()
        .position(|layer| layer.contains(&module))
        .unwrap_or_else(|| {
            panic!("module `{module}` is in no layer: add it to LAYERS and to docs/architecture.md")
        })
}

/// The non-test source lines of `path` (a file, or every `.rs` file below a
/// directory), comments left out.
fn code_lines(path: &Path, lines: &mut Vec<(String, String)>) {
    if path.is_dir() {
        let mut entries: Vec<_> = std::fs::read_dir(path)
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .collect();
        entries.sort();
        for entry in entries {
            code_lines(&entry, lines);
        }
        return;
    }
    if path.extension().and_then(|e| e.to_str()) != Some("rs")
        || path.file_name().and_then(|n| n.to_str()) == Some("tests.rs")
    {
        return;
    }
    let text = std::fs::read_to_string(path).unwrap();
    for line in text.lines() {
        let code = line.trim_start();
        if code.starts_with("#[cfg(test)]") {
            break;
        }
        if code.starts_with("//") {
            continue;
        }
        lines.push((path.display().to_string(), line.to_string()));
    }
}

/// The crate modules `lines` use.
fn used_modules(lines: &[(String, String)]) -> BTreeSet<(String, String)> {
    let mut used = BTreeSet::new();
    for (file, line) in lines {
        let mut rest = line.as_str();
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let module: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            used.insert((module, file.clone()));
        }
    }
    used
}

#[test]
fn modules_depend_only_on_lower_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut modules: Vec<String> = std::fs::read_dir(&src)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter_map(|path| {
            let name = path.file_stem()?.to_str()?.to_string();
            let module = path.is_dir() || path.extension()? == "rs";
            (module && name != "lib" && name != "main").then_some(name)
        })
        .collect();
    modules.sort();
    let mut violations = Vec::new();
    for module in &modules {
        let layer = layer_of(module);
        let mut lines = Vec::new();
        let dir = src.join(module);
        let path = if dir.is_dir() {
            dir
        } else {
            src.join(format!("{module}.rs"))
        };
        code_lines(&path, &mut lines);
        for (used, file) in used_modules(&lines) {
            if used != *module && layer_of(&used) >= layer {
                violations.push(format!("{file}: `{module}` uses `{used}`"));
            }
        }
    }
    assert!(
        violations.is_empty(),
        "modules using modules of their own or a higher layer:\n{}",
        violations.join("\n")
    );
}
