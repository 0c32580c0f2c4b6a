//! Dependencies point one way (ARCHITECTURE.md): each top-level module of
//! `src/` imports only modules of a lower layer. Read from the source, so a
//! new upward import fails here with the line that makes it.

use std::collections::BTreeMap;
use std::path::Path;

/// Every top-level module and its layer; a module may import only modules
/// of a strictly lower layer.
const LAYERS: &[(&str, u32)] = &[
    // Shared vocabulary: imports nothing of the crate.
    ("key", 0),
    ("clock", 0),
    ("metrics", 0),
    // The pure algorithms; telemetry's vocabulary and setup (stores name
    // their spans with it).
    ("algorithm", 1),
    // Which policy a rate limit service descriptor gets: plain data.
    ("descriptors", 1),
    ("telemetry", 1),
    // Where state lives, and the request/answer every layer speaks.
    ("store", 2),
    ("headers", 2),
    ("identity", 2),
    // Wrappers and data built on stores.
    ("failover", 3),
    ("policy", 3),
    ("hotkeys", 3),
    ("mitigation", 3),
    ("limiter", 4),
    ("config", 4),
    ("middleware", 5),
    // Envoy's rate limit service: the limiter behind gRPC.
    ("rls", 5),
    ("api", 6),
    ("server", 7),
];

/// The code of a file without its `#[cfg(test)]` items and its comments.
fn code(text: &str) -> String {
    let mut rest = text;
    let mut kept = String::new();
    while let Some(at) = rest.find("#[cfg(test)]") {
        kept.push_str(&rest[..at]);
        let item = &rest[at + "#[cfg(test)]".len()..];
        // The item ends at its first `;` if that comes before any `{`,
        // else at the brace that closes its first `{`.
        let end = match (item.find(';'), item.find('{')) {
            (Some(semi), Some(open)) if semi < open => semi + 1,
            (Some(semi), None) => semi + 1,
            (_, Some(open)) => {
                let mut depth = 0;
                let mut end = item.len();
                for (i, c) in item[open..].char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = open + i + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                end
            }
            (None, None) => item.len(),
        };
        rest = &item[end..];
    }
    kept.push_str(rest);
    kept.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `crate::<module>` paths in `code`, each with the line it starts on.
fn imports(code: &str) -> Vec<(String, String)> {
    let ident = |s: &str| -> String {
        s.trim()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let line_of = |at: usize| -> String {
        let start = code[..at].rfind('\n').map_or(0, |i| i + 1);
        let end = code[at..].find('\n').map_or(code.len(), |i| at + i);
        code[start..end].trim().to_owned()
    };
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(found) = code[from..].find("crate::") {
        let at = from + found;
        let rest = &code[at + "crate::".len()..];
        from = at + "crate::".len();
        if let Some(group) = rest.strip_prefix('{') {
            // `use crate::{a, b::{c, d}}`: the first name of each top-level
            // item of the group, which may span lines.
            let mut depth = 0;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.push((ident(&item), line_of(at)));
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                if depth == 0 || item.is_empty() {
                    item.push(c);
                }
            }
            if !ident(&item).is_empty() {
                out.push((ident(&item), line_of(at)));
            }
        } else {
            out.push((ident(rest), line_of(at)));
        }
    }
    out.retain(|(name, _)| !name.is_empty());
    out
}

fn visit(dir: &Path, files: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            visit(&path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
}

#[test]
fn every_module_imports_only_lower_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let layer: BTreeMap<&str, u32> = LAYERS.iter().copied().collect();
    let mut files = Vec::new();
    visit(&src, &mut files);
    let mut seen = std::collections::BTreeSet::new();
    let mut upward = Vec::new();
    for file in files {
        let rel = file.strip_prefix(&src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_owned();
        let test_code =
            rel.ends_with("tests.rs") || rel.components().any(|c| c.as_os_str() == "tests");
        if top == "lib" || top == "main" || test_code {
            continue;
        }
        let Some(&own) = layer.get(top.as_str()) else {
            panic!("module {top} ({}) has no layer in LAYERS", rel.display());
        };
        seen.insert(top.clone());
        for (dep, line) in imports(&code(&std::fs::read_to_string(&file).unwrap())) {
            if dep == top {
                continue;
            }
            let Some(&theirs) = layer.get(dep.as_str()) else {
                panic!("{}: imports unknown module {dep}: {line}", rel.display());
            };
            if theirs >= own {
                upward.push(format!(
                    "{} (layer {own}) imports {dep} (layer {theirs}): {line}",
                    rel.display()
                ));
            }
        }
    }
    assert!(
        upward.is_empty(),
        "imports that point up:\n{}",
        upward.join("\n")
    );
    let listed: std::collections::BTreeSet<String> =
        LAYERS.iter().map(|(m, _)| (*m).to_owned()).collect();
    assert_eq!(seen, listed, "LAYERS lists modules that do not exist");
}

/// Inside `algorithm/`, the same one way: `limit.rs` imports nothing of
/// the crate; `decision.rs` only the clock's unit; each algorithm's module
/// only them (and the clock); only `mod.rs` ties the algorithms together.
#[test]
fn each_algorithm_imports_only_the_shared_vocabulary() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/algorithm");
    let mut files = Vec::new();
    visit(&dir, &mut files);
    let mut wrong = Vec::new();
    for file in files {
        let rel = file
            .strip_prefix(&dir)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        if rel == "mod.rs" || rel.ends_with("tests.rs") {
            continue;
        }
        let code = code(&std::fs::read_to_string(&file).unwrap());
        let allowed_crate: &[&str] = match rel.as_str() {
            "limit.rs" => &[],
            _ => &["clock"],
        };
        for (dep, line) in imports(&code) {
            if !allowed_crate.contains(&dep.as_str()) {
                wrong.push(format!("{rel}: {line}"));
            }
        }
        for line in code.lines().filter(|l| l.contains("super::")) {
            let ok = match rel.as_str() {
                "limit.rs" => false,
                "decision.rs" => false,
                _ => line.contains("super::limit") || line.contains("super::decision"),
            };
            if !ok {
                wrong.push(format!("{rel}: {}", line.trim()));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports beyond the vocabulary:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_check_reads_imports_as_written() {
    let found = imports(
        "use crate::algorithm::{Limit, Window};\nuse crate::{\n    key::BucketKey,\n    store::{Check, Store},\n};\nlet x = crate::metrics::X;",
    );
    let names: Vec<&str> = found.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["algorithm", "key", "store", "metrics"]);
    assert_eq!(found[1].1, "use crate::{");
    assert_eq!(
        code("use crate::a;\n// crate::b\n#[cfg(test)]\nuse crate::c;"),
        "use crate::a;"
    );
}

/// A store that holds another store is a `Layer`: the one blanket
/// `impl Store` forwards readiness, slot owners and the backend's name, so
/// a wrapper written by hand as a `Store` over an inner store (the way one
/// forgets a question and breaks `/readyz`) is refused here.
#[test]
fn every_store_wrapper_is_a_layer() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    visit(&src, &mut files);
    let mut by_hand = Vec::new();
    let mut layers = 0;
    for file in files {
        let code = code(&std::fs::read_to_string(&file).unwrap());
        for line in code.lines() {
            let line = line.trim();
            if line.starts_with("impl<") && line.contains("> Layer for ") {
                layers += 1;
            }
            // `impl<S: Store> Store for X<S>`, with or without bounds.
            let generic_store = line.starts_with("impl<")
                && line.contains(": Store")
                && line.contains("> Store for ");
            if generic_store && !line.contains("for Arc<S>") && !line.contains("for L ") {
                by_hand.push(format!("{}: {line}", file.display()));
            }
        }
    }
    assert!(
        by_hand.is_empty(),
        "wrappers that are Stores by hand, not Layers:\n{}",
        by_hand.join("\n")
    );
    assert!(layers >= 6, "only {layers} layers found");
}
