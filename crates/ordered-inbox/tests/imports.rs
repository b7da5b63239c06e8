//! The crate's modules import one way: no module imports one that imports it back, directly or
//! through others. Read from the source files: every `crate::…` and `super::…` path outside
//! comments and test modules is an edge from the file's module to the module the path names.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every source file of the crate, as (module path, text): `lib.rs` is the root `crate`,
/// `a/mod.rs` is `crate::a`, `a/b.rs` is `crate::a::b`.
fn modules(root: &Path) -> BTreeMap<String, String> {
    let mut found = BTreeMap::new();
    let mut pending: Vec<PathBuf> = vec![root.to_owned()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
                continue;
            }
            let relative = path.strip_prefix(root).unwrap().with_extension("");
            let mut parts: Vec<String> = relative
                .iter()
                .map(|part| part.to_string_lossy().into_owned())
                .collect();
            if parts
                .last()
                .is_some_and(|last| last == "mod" || last == "lib")
            {
                parts.pop();
            }
            let name = std::iter::once("crate".to_owned())
                .chain(parts)
                .collect::<Vec<_>>();
            found.insert(name.join("::"), std::fs::read_to_string(&path).unwrap());
        }
    }
    found
}

/// The text of a module without its comments and its `#[cfg(test)]` items (test modules may
/// import their helpers, which import the module under test).
fn code(text: &str) -> String {
    let mut kept = String::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(test)]") {
            // Skip the item: up to the line that closes it at the same indentation.
            let indent = line.len() - trimmed.len();
            for next in lines.by_ref() {
                let rest = next.trim_start();
                if next.len() - rest.len() == indent && (rest == "}" || rest.ends_with(';')) {
                    break;
                }
            }
            continue;
        }
        if trimmed.starts_with("//") {
            continue;
        }
        kept.push_str(line);
        kept.push('\n');
    }
    kept
}

/// The module paths `text` names: `crate::a::b::Item`, `super::x::Item` (relative to
/// `module`) and `child::Item` (a module declared in it), each cut to the longest prefix that
/// is a module of the crate. `use` groups name their members: `crate::a::{b, c::D}` names
/// `crate::a::b` and `crate::a::c`.
fn named(module: &str, text: &str, known: &BTreeSet<String>) -> BTreeSet<String> {
    let parent = module
        .rsplit_once("::")
        .map_or("crate", |(parent, _)| parent);
    // One line, without the spaces inside paths and groups (`crate::a::{\n b,\n c}`), but
    // with the one between words, so that a path's start is still a word's.
    let mut flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    for (spaced, tight) in [
        (":: ", "::"),
        (" ::", "::"),
        ("{ ", "{"),
        (" }", "}"),
        (", ", ","),
    ] {
        flat = flat.replace(spaced, tight);
    }
    let children: Vec<(String, String)> = known
        .iter()
        .filter_map(|candidate| {
            let child = candidate.strip_prefix(module)?.strip_prefix("::")?;
            (!child.contains("::")).then(|| (format!("{child}::"), candidate.clone()))
        })
        .collect();
    let mut paths = Vec::new();
    let starts = flat
        .match_indices("crate::")
        .map(|(i, _)| (i, "crate"))
        .chain(flat.match_indices("super::").map(|(i, _)| (i, parent)))
        .chain(children.iter().flat_map(|(spelled, _)| {
            flat.match_indices(spelled.as_str())
                .map(|(i, _)| (i, module))
        }));
    for (start, prefix) in starts {
        let before = flat[..start].chars().last();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        let rest = &flat[start..];
        let rest = if prefix == module {
            rest
        } else {
            &rest[rest.find("::").unwrap_or(0) + 2..]
        };
        expand(prefix, rest, &mut paths);
    }
    paths
        .into_iter()
        .filter_map(|path| {
            let mut parts: Vec<&str> = path.split("::").collect();
            while !parts.is_empty() {
                let candidate = parts.join("::");
                if known.contains(&candidate) {
                    return Some(candidate);
                }
                parts.pop();
            }
            None
        })
        .filter(|target| target != module)
        .collect()
}

/// Appends to `paths` every path that `rest` (text after `prefix::`) spells, groups expanded.
fn expand(prefix: &str, rest: &str, paths: &mut Vec<String>) {
    let end = rest
        .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(rest.len());
    let head = rest[..end].trim_end_matches(':');
    let path = if head.is_empty() {
        prefix.to_owned()
    } else {
        format!("{prefix}::{head}")
    };
    if rest[end..].starts_with('{') && rest[..end].ends_with("::") {
        let mut depth = 0;
        let mut member_start = end + 1;
        for (offset, c) in rest[end..].char_indices() {
            let at = end + offset;
            match c {
                '{' => depth += 1,
                '}' | ',' if depth == 1 => {
                    let member = &rest[member_start..at];
                    if !member.is_empty() {
                        expand(&path, member, paths);
                    }
                    member_start = at + 1;
                    if c == '}' {
                        return;
                    }
                }
                '}' => depth -= 1,
                _ => {}
            }
        }
    }
    paths.push(path);
}

#[test]
fn no_module_of_the_crate_imports_one_that_imports_it_back() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let sources = modules(&root);
    let known: BTreeSet<String> = sources.keys().cloned().collect();
    let graph: BTreeMap<&str, BTreeSet<String>> = sources
        .iter()
        .filter(|(module, _)| !module.ends_with("::testing"))
        .map(|(module, text)| (module.as_str(), named(module, &code(text), &known)))
        .collect();
    // The crate root only declares modules and re-exports them: it is the top, not a module
    // others may import from.
    let mut circles = Vec::new();
    for (module, targets) in &graph {
        if targets.contains("crate") {
            circles.push(format!("{module} imports the crate root's re-exports"));
        }
        for target in targets {
            if target != "crate" && reaches(&graph, target, module) {
                circles.push(format!("{module} -> {target} -> … -> {module}"));
            }
        }
    }
    assert!(
        circles.is_empty(),
        "import circles:\n{}",
        circles.join("\n")
    );
}

/// Whether `to` can be reached from `from` along the graph's edges.
fn reaches(graph: &BTreeMap<&str, BTreeSet<String>>, from: &str, to: &str) -> bool {
    let mut seen = BTreeSet::new();
    let mut pending = vec![from.to_owned()];
    while let Some(next) = pending.pop() {
        if next == to {
            return true;
        }
        if next == "crate" || !seen.insert(next.clone()) {
            continue;
        }
        if let Some(targets) = graph.get(next.as_str()) {
            pending.extend(targets.iter().cloned());
        }
    }
    false
}
