//! The failure matrix (`docs/failure-matrix.md`) names the test that builds each
//! counterexample. A name that no longer exists (renamed, deleted, never written) turns the
//! matrix into a claim nobody checks, so this test reads the matrix and asserts that every
//! cited test function exists where the matrix says, that every simulator fault it cites is a
//! `Fault` variant of `crates/sealpost-sim/src/stats.rs`, and that every mutant it cites is
//! a mutant name of `crates/sealpost-sim/src/protocol.rs`. It reads files only: no database,
//! no broker.

use std::path::{Path, PathBuf};

/// The workspace root: this crate is `crates/sealpost-cli`.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the workspace root")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// Characters of a path token (`crates/sealpost-cli/tests/loops.rs`).
fn path_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '/')
}

/// Characters of a Rust identifier.
fn ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Every `PATH::NAME` in `text`, as (PATH, NAME): PATH is the run of path characters before
/// the `::`, NAME the identifier after it. Chains (`a::b::c`) give one pair per `::`.
fn double_colon_pairs(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = text[from..].find("::") {
        let at = from + i;
        let before: String = text[..at]
            .chars()
            .rev()
            .take_while(|&c| path_char(c))
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        let after: String = text[at + 2..]
            .chars()
            .take_while(|&c| ident_char(c))
            .collect();
        if !before.is_empty() && !after.is_empty() {
            out.push((before, after));
        }
        from = at + 2;
    }
    out
}

/// The test references: pairs whose path is a Rust file.
fn test_refs(matrix: &str) -> Vec<(String, String)> {
    double_colon_pairs(matrix)
        .into_iter()
        .filter(|(p, _)| p.ends_with(".rs"))
        .collect()
}

/// The files a reference's path may mean: a path with a directory is relative to the
/// workspace root; a bare file name is looked for in every crate's `tests/` and `src/`.
fn candidates(path: &str) -> Vec<PathBuf> {
    let root = root();
    if path.contains('/') {
        return vec![root.join(path)];
    }
    let mut out = Vec::new();
    let crates = std::fs::read_dir(root.join("crates")).expect("the workspace's crates/");
    for c in crates {
        let c = c.expect("a crates/ entry").path();
        for dir in ["tests", "src"] {
            let f = c.join(dir).join(path);
            if f.is_file() {
                out.push(f);
            }
        }
    }
    out.sort();
    out
}

/// Whether `source` defines `fn name` (followed by `(` or `<`, so `fn name_longer` does
/// not count).
fn defines_fn(source: &str, name: &str) -> bool {
    let needle = format!("fn {name}");
    source.match_indices(&needle).any(|(i, _)| {
        let next = source[i + needle.len()..].chars().next();
        matches!(next, Some('(') | Some('<'))
    })
}

/// The variants of `pub enum Fault { ... }` in the simulator's stats.
fn fault_variants() -> Vec<String> {
    let stats = read(&root().join("crates/sealpost-sim/src/stats.rs"));
    let start = stats
        .find("pub enum Fault {")
        .expect("stats.rs defines `pub enum Fault`");
    let body = &stats[start..];
    let end = body.find("\n}").expect("the end of `enum Fault`");
    body[..end]
        .lines()
        .skip(1)
        .map(str::trim)
        .filter(|l| !l.starts_with("//") && l.ends_with(','))
        .map(|l| l.trim_end_matches(',').to_string())
        .collect()
}

/// The mutant names cited as ``mutant `NAME` `` or ``mutants `A`, `B` and `C` ``.
fn cited_mutants(matrix: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, m) in matrix.match_indices("mutant") {
        let mut rest = &matrix[i + m.len()..];
        rest = rest.strip_prefix('s').unwrap_or(rest);
        let Some(mut rest) = rest.strip_prefix(" `") else {
            continue;
        };
        while let Some(end) = rest.find('`') {
            out.push(rest[..end].to_string());
            rest = &rest[end + 1..];
            match [", `", " and `"]
                .iter()
                .find_map(|sep| rest.strip_prefix(*sep))
            {
                Some(next) => rest = next,
                None => break,
            }
        }
    }
    out
}

#[test]
fn the_parser_reads_references_as_the_matrix_writes_them() {
    let text = "`crates/sealpost-cli/tests/loops.rs::a_b` and `gate.rs::c`; \
                `sealpost_core::inbox::idempotency_key`, simulator `Fault::AckLost`";
    assert_eq!(
        test_refs(text),
        vec![
            (
                "crates/sealpost-cli/tests/loops.rs".to_string(),
                "a_b".to_string()
            ),
            ("gate.rs".to_string(), "c".to_string()),
        ]
    );
    let pairs = double_colon_pairs(text);
    assert!(pairs.contains(&("Fault".to_string(), "AckLost".to_string())));
    assert!(defines_fn("async fn a_b() {}", "a_b"));
    assert!(defines_fn("fn a_b<T>() {}", "a_b"));
    assert!(
        !defines_fn("fn a_b_c() {}", "a_b"),
        "a longer name is another function"
    );
    assert_eq!(
        cited_mutants("(mutant `m-1` caught); mutants `m-2`, `m-3` and `m-4` caught; mutants"),
        ["m-1", "m-2", "m-3", "m-4"]
    );
}

#[test]
fn every_test_fault_and_mutant_the_failure_matrix_cites_exists() {
    let matrix = read(&root().join("docs/failure-matrix.md"));
    let refs = test_refs(&matrix);
    let pairs = double_colon_pairs(&matrix);
    let faults: Vec<&String> = pairs
        .iter()
        .filter(|(p, _)| p == "Fault")
        .map(|(_, n)| n)
        .collect();
    // Negative space: a parser that finds nothing would pass every matrix.
    assert!(
        refs.len() >= 10,
        "only {} test references found",
        refs.len()
    );
    assert!(faults.len() >= 5, "only {} faults found", faults.len());

    let mut wrong = Vec::new();
    for (path, name) in &refs {
        let files = candidates(path);
        if files.is_empty() {
            wrong.push(format!(
                "`{path}::{name}`: no file {path} (bare names are looked for in crates/*/tests/ and crates/*/src/)"
            ));
            continue;
        }
        if !files.iter().any(|f| defines_fn(&read(f), name)) {
            let shown: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
            wrong.push(format!("`{path}::{name}`: no `fn {name}` in {shown:?}"));
        }
    }
    let variants = fault_variants();
    assert!(variants.len() >= 20, "enum Fault read as {variants:?}");
    for f in &faults {
        if !variants.contains(f) {
            wrong.push(format!(
                "`Fault::{f}`: not a variant of crates/sealpost-sim/src/stats.rs"
            ));
        }
    }
    let protocol = read(&root().join("crates/sealpost-sim/src/protocol.rs"));
    for m in cited_mutants(&matrix) {
        if !protocol.contains(&format!("=> \"{m}\"")) {
            wrong.push(format!(
                "mutant `{m}`: not a mutant name of crates/sealpost-sim/src/protocol.rs"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "docs/failure-matrix.md cites what does not exist:\n{}",
        wrong.join("\n")
    );
}

/// The README's code blocks marked `<!-- from PATH -->` and the text each one shows: the
/// fenced block that follows the marker.
fn readme_blocks(readme: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut lines = readme.lines();
    while let Some(line) = lines.next() {
        let Some(path) = line
            .trim()
            .strip_prefix("<!-- from ")
            .and_then(|r| r.strip_suffix(" -->"))
        else {
            continue;
        };
        let fence = lines.next().unwrap_or_default();
        assert!(
            fence.starts_with("```"),
            "README: `<!-- from {path} -->` must be followed by a code fence, found {fence:?}"
        );
        let body: Vec<&str> = lines
            .by_ref()
            .take_while(|l| !l.starts_with("```"))
            .collect();
        out.push((path.to_string(), body.join("\n")));
    }
    out
}

/// The lines of `source` between `// README:start NAME` and `// README:end NAME` markers,
/// each region dedented by its first line's indentation, in the order they appear.
fn marked_regions(source: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current: Option<Vec<&str>> = None;
    for line in source.lines() {
        let t = line.trim();
        if t.starts_with("// README:start") {
            current = Some(Vec::new());
        } else if t.starts_with("// README:end") {
            let region = current.take().expect("README:end without README:start");
            let indent = region.first().map_or(0, |l| l.len() - l.trim_start().len());
            let dedented: Vec<&str> = region
                .iter()
                .map(|l| {
                    if l.len() >= indent {
                        &l[indent..]
                    } else {
                        l.trim_start()
                    }
                })
                .collect();
            out.push(dedented.join("\n"));
        } else if let Some(r) = current.as_mut() {
            r.push(line);
        }
    }
    out
}

/// The README's examples are the compiled example files, not prose that can drift: every
/// block marked `<!-- from PATH -->` is, line for line, a `README:start`/`README:end` region
/// of PATH (which `cargo test --all-targets` and clippy compile).
#[test]
fn the_readme_examples_are_the_compiled_example_files() {
    let root = root();
    let blocks = readme_blocks(&read(&root.join("README.md")));
    assert!(
        blocks.len() >= 2,
        "the README shows at least the enqueue and dispatch examples"
    );
    for (path, body) in blocks {
        let source = read(&root.join(&path));
        let regions = marked_regions(&source);
        assert!(
            regions.iter().any(|r| r.trim_end() == body.trim_end()),
            "README block from {path} is not a README:start/README:end region of that file; \
             copy the region again (dedented) or mark it in the file"
        );
    }
}
