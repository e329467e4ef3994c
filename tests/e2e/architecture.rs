//! The module graph stays a one-way flow: no top-level module of `src/` reaches, through the
//! `crate::` paths in its code, a module that reaches back to it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Top-level module name -> the top-level modules its code names (`crate::x`), comments and
/// doc comments left out (an intra-doc link is not a dependency).
fn module_graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut files = Vec::new();
    collect(&src, &mut files);
    for file in files {
        let rel = file.strip_prefix(&src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if top == "lib" || top == "main" {
            continue;
        }
        let deps = graph.entry(top.clone()).or_default();
        let text = std::fs::read_to_string(&file).unwrap();
        for name in crate_paths(&text) {
            if name != top {
                deps.insert(name);
            }
        }
    }
    graph
}

/// The top-level modules named by `crate::` paths in `text`, also inside grouped imports
/// (`use crate::{a, b::c}`); comment lines and trailing comments are left out.
fn crate_paths(text: &str) -> BTreeSet<String> {
    let code: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .map(|l| l.split(" // ").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut names = BTreeSet::new();
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // Top level of the group only: `a`, `b` in `{a, b::{c, d}}`.
            let mut depth = 0;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        names.insert(ident(&item));
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                if depth == 0 {
                    item.push(c);
                }
            }
            names.insert(ident(&item));
        } else {
            names.insert(ident(rest));
        }
    }
    names.remove("");
    names
}

fn collect(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            collect(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Modules in an order where each comes after everything it uses, or the ones left in a cycle.
fn layers(graph: &BTreeMap<String, BTreeSet<String>>) -> Result<Vec<String>, Vec<String>> {
    let mut placed: Vec<String> = Vec::new();
    let mut left: BTreeSet<&String> = graph.keys().collect();
    while !left.is_empty() {
        let ready: Vec<&String> = left
            .iter()
            .copied()
            .filter(|m| {
                graph[*m]
                    .iter()
                    .all(|d| placed.contains(d) || !graph.contains_key(d))
            })
            .collect();
        if ready.is_empty() {
            return Err(left.into_iter().cloned().collect());
        }
        for m in ready {
            left.remove(m);
            placed.push(m.clone());
        }
    }
    Ok(placed)
}

#[test]
fn the_module_graph_has_no_cycle() {
    let graph = module_graph();
    assert!(graph.contains_key("idempotency") && graph.contains_key("store"));
    match layers(&graph) {
        Ok(order) => println!("modules, each after what it uses: {}", order.join(" < ")),
        Err(cycle) => {
            let edges: Vec<String> = cycle
                .iter()
                .map(|m| format!("{m} -> {:?}", graph[m]))
                .collect();
            panic!("import cycle among {cycle:?}:\n{}", edges.join("\n"));
        }
    }
}

#[test]
fn crate_paths_are_found_in_every_form() {
    let text = "use crate::a::X;\nuse crate::{b, c::{D, E}, d::F};\n// crate::commented\nlet u = \"http://x\"; crate::e::f(); // crate::trailing\n";
    let found: Vec<String> = crate_paths(text).into_iter().collect();
    assert_eq!(found, ["a", "b", "c", "d", "e"]);
}

#[test]
fn the_cycle_check_finds_a_cycle() {
    let mut graph = BTreeMap::new();
    graph.insert("a".to_string(), BTreeSet::from(["b".to_string()]));
    graph.insert("b".to_string(), BTreeSet::from(["a".to_string()]));
    graph.insert("c".to_string(), BTreeSet::new());
    assert_eq!(layers(&graph), Err(vec!["a".to_string(), "b".to_string()]));
}

/// The data flows one way: config knows nothing of what runs it, the core nothing of HTTP
/// servers, stores nothing of the core.
#[test]
fn the_layers_point_down() {
    let graph = module_graph();
    let uses = |m: &str, d: &str| graph[m].contains(d);
    for lower in [
        "config",
        "route",
        "key",
        "fingerprint",
        "body",
        "store",
        "upstream",
    ] {
        for upper in [
            "idempotency",
            "gateway",
            "server",
            "admin",
            "metrics",
            "cli",
        ] {
            assert!(!uses(lower, upper), "{lower} uses {upper}");
        }
    }
    for front in ["gateway", "server", "admin", "upstream", "problem"] {
        assert!(!uses("idempotency", front), "the core uses {front}");
    }
}
