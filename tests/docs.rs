//! The documentation stays true to the tree: every relative link leads to a
//! file (and a heading, where it names one), every test a page cites by
//! name exists, every repository path it names is there, and the README
//! stays short enough to read in one sitting.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Directories that hold generated or local state, not the project.
const SKIPPED: [&str; 5] = ["target", ".git", ".stack", "results", "node_modules"];

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if !SKIPPED.contains(&name.as_str()) {
                walk(&path, out);
            }
        } else {
            out.push(path);
        }
    }
}

fn files() -> Vec<PathBuf> {
    let mut out = Vec::new();
    walk(root(), &mut out);
    out.sort();
    out
}

/// The Markdown pages a reader meets.
fn pages() -> Vec<PathBuf> {
    files()
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect()
}

/// A page's text outside fenced code blocks, line by line.
fn prose(text: &str) -> Vec<&str> {
    let mut fenced = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            out.push(line);
        }
    }
    out
}

/// The anchors GitHub gives a page's headings: lower case, punctuation
/// dropped, spaces as hyphens, repeats numbered.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in prose(text) {
        let Some(title) = line.strip_prefix('#') else {
            continue;
        };
        let title = title.trim_start_matches('#').trim();
        let slug: String = title
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let mut unique = slug.clone();
        let mut n = 0;
        while out.contains(&unique) {
            n += 1;
            unique = format!("{slug}-{n}");
        }
        out.insert(unique);
    }
    out
}

/// The targets of a line's inline links, `[text](target)`.
fn link_targets(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        rest = &rest[at + 2..];
        if let Some(end) = rest.find(')') {
            out.push(rest[..end].to_owned());
            rest = &rest[end..];
        }
    }
    out
}

#[test]
fn every_relative_link_in_the_docs_leads_to_a_file_and_heading() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let here = page.parent().unwrap();
        for line in prose(&text) {
            for target in link_targets(line) {
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (file, anchor) = match target.split_once('#') {
                    Some((file, anchor)) => (file, Some(anchor)),
                    None => (target.as_str(), None),
                };
                let path = if file.is_empty() {
                    page.clone()
                } else {
                    here.join(file)
                };
                checked += 1;
                let name = page.strip_prefix(root()).unwrap().display();
                if !path.exists() {
                    broken.push(format!("{name}: {target} (no such file)"));
                    continue;
                }
                if let Some(anchor) = anchor {
                    let target_text = std::fs::read_to_string(&path).unwrap_or_default();
                    if !anchors(&target_text).contains(anchor) {
                        broken.push(format!("{name}: {target} (no such heading)"));
                    }
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(checked > 100, "only {checked} links found");
}

/// The words of a page's prose in backticks.
fn backticked(text: &str) -> Vec<&str> {
    prose(text)
        .into_iter()
        .flat_map(|line| line.split('`').skip(1).step_by(2))
        .collect()
}

/// Every item `cite` finds on a page that `exists` does not accept, as
/// `page: item` lines, and how many items were cited in all.
fn unmatched(
    cite: impl Fn(&str) -> BTreeSet<String>,
    exists: impl Fn(&str) -> bool,
) -> (Vec<String>, usize) {
    let mut missing = Vec::new();
    let mut cited = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for item in cite(&text) {
            cited += 1;
            if !exists(&item) {
                let page = page.strip_prefix(root()).unwrap().display();
                missing.push(format!("{page}: {item}"));
            }
        }
    }
    (missing, cited)
}

/// Words in backticks shaped like a test's name: four or more snake-case
/// words (`one_key_gets_exactly_what_the_maths_predicts`).
fn cited_names(text: &str) -> BTreeSet<String> {
    backticked(text)
        .into_iter()
        .filter(|part| {
            part.split('_').count() >= 4
                && part.split('_').all(|w| {
                    !w.is_empty()
                        && w.chars()
                            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
                })
        })
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_test_the_docs_cite_by_name_exists() {
    let code: String = files()
        .into_iter()
        .filter(|p| p.extension().is_none_or(|e| e != "md"))
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .collect::<Vec<_>>()
        .join("\n");
    // A test is a function; a metric, label or setting with the same
    // shape is a quoted string somewhere in the code, a message's field a
    // struct's.
    let (missing, cited) = unmatched(cited_names, |name| {
        code.contains(&format!("fn {name}("))
            || code.contains(&format!("pub {name}:"))
            || code.contains(&format!("\"{name}"))
            || code.contains(&format!("{name}\""))
    });
    assert!(
        missing.is_empty(),
        "cited but not in the code:\n{}",
        missing.join("\n")
    );
    assert!(cited > 50, "only {cited} names cited");
}

/// Paths in backticks that name a file or folder of the repository
/// (`src/store/mod.rs`, `runbooks/`), as opposed to a pattern or a
/// placeholder (`benches/peers/peer_*.rs`, `target/<profile>/`).
fn cited_paths(text: &str) -> BTreeSet<String> {
    const TOP: [&str; 15] = [
        "src/",
        "tests/",
        "loadtest/",
        "testkit/",
        "benches/",
        "examples/",
        "scripts/",
        "config/",
        "docs/",
        "runbooks/",
        "grafana/",
        "prometheus/",
        "nginx/",
        "lua/",
        "jaeger/",
    ];
    backticked(text)
        .into_iter()
        .filter(|part| {
            TOP.iter().any(|t| part.starts_with(t))
                && part
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_./-".contains(c))
        })
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_path_the_docs_name_exists() {
    let (missing, cited) = unmatched(cited_paths, |path| {
        root().join(path.trim_end_matches('/')).exists()
    });
    assert!(missing.is_empty(), "no such path:\n{}", missing.join("\n"));
    assert!(cited > 100, "only {cited} paths cited");
}

#[test]
fn the_readme_is_read_in_one_sitting() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= 400,
        "README.md has {lines} lines; topics go in docs/"
    );
}

/// The checks see what they are meant to see.
#[test]
fn the_checks_read_links_anchors_and_names() {
    let text = "# A title: with, punctuation\n## Twice\n## Twice\n```\n# not a heading\n```\n";
    assert_eq!(
        anchors(text),
        ["a-title-with-punctuation", "twice", "twice-1"]
            .map(str::to_owned)
            .into()
    );
    assert_eq!(
        link_targets("see [a](docs/a.md#b) and [c](https://x/y)"),
        ["docs/a.md#b", "https://x/y"]
    );
    assert_eq!(
        cited_names("`one_two_three_four` `a_b` `x.y_z_w_v` `Not_a_test_name`"),
        ["one_two_three_four".to_owned()].into()
    );
    assert_eq!(
        cited_paths("`src/a.rs` `runbooks/` `benches/peer_*.rs` `target/x` `src/<n>`"),
        ["runbooks/".to_owned(), "src/a.rs".to_owned()].into()
    );
}
