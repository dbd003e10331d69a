//! The shape rule of issue 13 for the cluster's code: no file in
//! `src/cluster/` (its submodules included) over 800 lines, so that each
//! holds one job a newcomer can read at once (docs/cluster.md, "The code").

use std::path::{Path, PathBuf};

/// The most lines a file in `src/cluster/` may have.
const CLUSTER_FILE_LINES_MAX: usize = 800;

fn rust_files(dir: &Path, files: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, files);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            files.push(path);
        }
    }
}

#[test]
fn no_cluster_file_is_over_800_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cluster");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    assert!(files.len() > 20, "found only {files:?} under {root:?}");
    let mut too_long: Vec<String> = files
        .iter()
        .filter_map(|path| {
            let lines = std::fs::read_to_string(path).unwrap().lines().count();
            (lines > CLUSTER_FILE_LINES_MAX).then(|| format!("{} ({lines} lines)", path.display()))
        })
        .collect();
    too_long.sort();
    assert!(
        too_long.is_empty(),
        "files in src/cluster/ over {CLUSTER_FILE_LINES_MAX} lines (split them by job, or move their tests to a file of their own): {too_long:?}"
    );
}
