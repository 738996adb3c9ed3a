//! The crate's layers, enforced: reads every source file of `src/` and fails when one names a
//! module it may not use (see the layer diagram at the top of `src/lib.rs`).
//!
//! | layer | folder | may use |
//! | --- | --- | --- |
//! | 1 model | `src/model/` | the model |
//! | 2 contract | `src/contract/` | the model, the contract |
//! | 3 resource | `src/resource/` | the model, the contract, the resources |
//! | 4 progress | `src/progress.rs`, `src/progress/` | the model, the contract, the resources, itself |
//! | 5 provider | `src/shm/`, `src/tcp/`, `src/ofi/` | the model, the contract, its own folder |
//! | top | the files at the root of `src/` (`lib.rs`, `registry.rs`, `tests.rs`, ...), and unit-test modules (`*/tests.rs`) | all |
//!
//! A provider never uses the progress layer either (it polls completion queues: it is above the
//! resources, used by the engines above the crate).
//!
//! So a provider never reaches into a resource (`resource::..`: a handle's internals) nor into
//! another provider, and nothing below the top names a provider (only `registry.rs` does).
//! Nor does a provider name the resource layer's side of the queue-pair core
//! (`contract::QpHandleSide`: states, posting, harvesting), so that it reaches its queue pair
//! only through the core's services (`QpInner`'s own methods).
//!
//! What counts as "naming": every path that starts with `crate::` or `super::`, in `use` lines
//! and in code (`crate::contract::copy_bytes(..)`), groups included (`crate::{model::X, ..}`);
//! comments (doc links included) and string literals are skipped. `super::` is resolved against
//! the file's module. A path into the crate root's re-exports (`crate::Cancel`) counts as the
//! layer that defines the item. A new folder under `src/` fails the test until it is given a
//! layer here.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A layer, in order: a file may use its own layer and those below, with the provider rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Layer {
    Model = 1,
    Contract = 2,
    Resource = 3,
    Progress = 4,
    Provider = 5,
    Top = 6,
}

const PROVIDERS: &[&str] = &["shm", "tcp", "ofi"];

/// The layer of a module path's first segment (`None`: a folder no layer claims).
fn layer_of_module(first: &str, is_dir: bool) -> Option<Layer> {
    match first {
        "model" => Some(Layer::Model),
        "contract" => Some(Layer::Contract),
        "resource" => Some(Layer::Resource),
        "progress" => Some(Layer::Progress),
        p if PROVIDERS.contains(&p) => Some(Layer::Provider),
        // Files at the root of `src/` (lib.rs, registry.rs, tests.rs, ...).
        _ if !is_dir => Some(Layer::Top),
        _ => None,
    }
}

/// One source file: its module path (`["tcp", "rx"]`; `[]` for lib.rs) and its text.
#[derive(Clone)]
struct Source {
    rel: String,
    module: Vec<String>,
    /// Whether the file is a folder's `mod.rs` (or `lib.rs`): its `super` is one level up.
    is_mod: bool,
    text: String,
}

fn collect(dir: &Path, root: &Path, out: &mut Vec<Source>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            collect(&p, root, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            let rel = p.strip_prefix(root).expect("under src").to_path_buf();
            let mut module: Vec<String> = rel
                .parent()
                .into_iter()
                .flat_map(|d| d.iter())
                .map(|s| s.to_string_lossy().into_owned())
                .collect();
            let stem = p
                .file_stem()
                .expect("file name")
                .to_string_lossy()
                .into_owned();
            let is_mod = stem == "mod" || (stem == "lib" && module.is_empty());
            if !is_mod {
                module.push(stem);
            }
            out.push(Source {
                rel: format!("src/{}", rel.display()),
                module,
                is_mod,
                text: std::fs::read_to_string(&p).expect("readable source"),
            });
        }
    }
}

/// The text with comments and the insides of string and char literals blanked out (lines
/// kept, so that reported line numbers stay right).
fn code_only(src: &str) -> String {
    let b: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
        } else if c == 'r' && (next == Some('"') || next == Some('#')) && !ident_char_before(&b, i)
        {
            // A raw string: r"..", r#".."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == '"' && (0..hashes).all(|k| b.get(j + 1 + k) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            for &ch in &b[i..j.min(b.len())] {
                out.push(blank(ch));
            }
            i = j;
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                if i < b.len() {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
            out.push(' ');
            i += 1;
        } else if c == '\'' {
            // A char literal ('x', '\n', '\''), or a lifetime ('a), which is left as it is.
            let end = if next == Some('\\') {
                (i + 2..b.len().min(i + 12)).find(|&j| b[j] == '\'')
            } else if b.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(e) => {
                    for _ in i..=e {
                        out.push(' ');
                    }
                    i = e + 1;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

fn ident_char_before(b: &[char], i: usize) -> bool {
    i > 0 && (b[i - 1].is_alphanumeric() || b[i - 1] == '_')
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Reads an identifier at `i` (after spaces); returns it and where it ends.
fn ident_at(b: &[char], mut i: usize) -> (String, usize) {
    while i < b.len() && b[i].is_whitespace() {
        i += 1;
    }
    let start = i;
    while i < b.len() && is_ident(b[i]) {
        i += 1;
    }
    (b[start..i].iter().collect(), i)
}

/// The first segments of the entries of a `{ .. }` group that starts at `i` (the `{`).
fn group_firsts(b: &[char], i: usize) -> Vec<String> {
    let mut firsts = Vec::new();
    let mut depth = 0;
    let mut j = i;
    let mut expect = true;
    while j < b.len() {
        match b[j] {
            '{' => {
                depth += 1;
                expect = depth == 1;
                j += 1;
            }
            '}' => {
                depth -= 1;
                j += 1;
                if depth == 0 {
                    break;
                }
            }
            ',' => {
                expect = depth == 1;
                j += 1;
            }
            c if c.is_whitespace() => j += 1,
            _ => {
                if expect && depth == 1 {
                    let (id, e) = ident_at(b, j);
                    if !id.is_empty() {
                        firsts.push(id);
                        j = e;
                        expect = false;
                        continue;
                    }
                }
                expect = false;
                j += 1;
            }
        }
    }
    firsts
}

/// Every module path a file names: (line, the path as written, absolute first segment, or
/// the name of a root item when the path goes through the crate root's re-exports).
fn named_paths(src: &Source) -> Vec<(usize, String, Vec<String>)> {
    let code = code_only(&src.text);
    let b: Vec<char> = code.chars().collect();
    let mut found = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let at_crate = b[i..].starts_with(&['c', 'r', 'a', 't', 'e', ':', ':']);
        let at_super = b[i..].starts_with(&['s', 'u', 'p', 'e', 'r', ':', ':']);
        if !(at_crate || at_super) || ident_char_before(&b, i) {
            i += 1;
            continue;
        }
        let line = b[..i].iter().filter(|&&c| c == '\n').count() + 1;
        let start = i;
        // The absolute module the path starts from.
        let mut base: Vec<String> = if at_crate {
            i += 7;
            Vec::new()
        } else {
            let mut m = src.module.clone();
            // `super` of `a/b.rs` (module a::b) is `a`; of `a/mod.rs` (module a) is the root.
            while b[i..].starts_with(&['s', 'u', 'p', 'e', 'r', ':', ':']) {
                m.pop();
                i += 7;
            }
            m
        };
        // Follow plain segments; a group gives several paths.
        let mut heads: Vec<Vec<String>> = Vec::new();
        loop {
            while i < b.len() && b[i].is_whitespace() {
                i += 1;
            }
            if b.get(i) == Some(&'{') {
                for f in group_firsts(&b, i) {
                    let mut p = base.clone();
                    if f != "self" {
                        p.push(f);
                    }
                    heads.push(p);
                }
                break;
            }
            let (id, e) = ident_at(&b, i);
            if id.is_empty() {
                heads.push(base.clone());
                break;
            }
            base.push(id);
            i = e;
            // Only the first segment below the root matters; keep one more for root items.
            if base.len() >= 2 || !b[i..].starts_with(&[':', ':']) {
                heads.push(base.clone());
                break;
            }
            i += 2;
        }
        let written: String = b[start..i.min(b.len())].iter().collect();
        for h in heads {
            found.push((line, written.trim().to_string(), h));
        }
        i = i.max(start + 1);
    }
    found
}

/// The layer of the item `name` at the crate root (a re-export, or an item of lib.rs): the
/// layer of the file that defines a `pub` item of that name (the highest, if several do).
fn root_item_layer(name: &str, sources: &[Source]) -> Option<Layer> {
    let kinds = [
        "struct",
        "enum",
        "type",
        "fn",
        "const",
        "trait",
        "static",
        "mod",
        "unsafe fn",
    ];
    let mut best = None;
    for s in sources {
        let defines = s.text.lines().any(|l| {
            let l = l.trim_start();
            kinds.iter().any(|k| {
                l.strip_prefix("pub ")
                    .and_then(|r| r.strip_prefix(k))
                    .and_then(|r| r.strip_prefix(' '))
                    .is_some_and(|r| {
                        r.starts_with(name) && !r[name.len()..].starts_with(|c: char| is_ident(c))
                    })
            })
        });
        if defines {
            best = best.max(file_layer(s).ok());
        }
    }
    best
}

/// The layer of a source file.
fn file_layer(src: &Source) -> Result<Layer, String> {
    // A unit-test module (`tests.rs`, beside the code it tests) may open contexts and use
    // anything: it counts as the top.
    let is_tests = src.module.last().is_some_and(|m| m == "tests");
    match src.module.first() {
        None => Ok(Layer::Top),
        Some(_) if is_tests => Ok(Layer::Top),
        Some(f) => layer_of_module(f, src.module.len() > 1 || src.is_mod)
            .ok_or_else(|| format!("{}: folder `{f}` has no layer in tests/layers.rs", src.rel)),
    }
}

/// What `src` may use, in words, and whether `target` (an absolute path's head) is allowed.
fn check(src: &Source, target: &[String], sources: &[Source]) -> Result<(), String> {
    let from_first = src.module.first().map(String::as_str);
    let from = file_layer(src)?;
    if from == Layer::Top {
        return Ok(());
    }
    let Some(first) = target.first() else {
        return Ok(()); // `crate::` alone, or `super::*` at the root
    };
    let to = match layer_of_module(first, true) {
        Some(l) => l,
        None if target.len() == 1 || first.starts_with(|c: char| c.is_uppercase()) => {
            match root_item_layer(first, sources) {
                Some(l) => l,
                None => return Err(format!("`crate::{first}`: no such item or layer")),
            }
        }
        // A root module (registry, tests, fuzzing): the top.
        None => Layer::Top,
    };
    let ok = match from {
        Layer::Top => true,
        Layer::Provider => {
            to <= Layer::Contract || (to == Layer::Provider && from_first == Some(first.as_str()))
        }
        _ => to <= from,
    };
    if ok {
        return Ok(());
    }
    let allowed = match from {
        Layer::Model => "the model only".to_string(),
        Layer::Contract => "the model and the contract".to_string(),
        Layer::Resource => "the model, the contract and the resources".to_string(),
        Layer::Progress => "the model, the contract, the resources and itself".to_string(),
        Layer::Provider => format!(
            "the model, the contract and its own folder ({})",
            from_first.unwrap_or("?")
        ),
        Layer::Top => unreachable!(),
    };
    Err(format!(
        "names `{}` ({to:?} layer); a {from:?} file may use {allowed}",
        target.join("::")
    ))
}

/// Items of lower layers that a provider may not name: the side of the queue-pair core that
/// only the resource layer uses (the handle's states and posting, the completion queues'
/// harvest), so that a transport reaches its queue pair only through the core's services.
const NOT_FOR_PROVIDERS: &[&str] = &["QpHandleSide"];

fn violations(sources: &[Source]) -> Vec<String> {
    let mut bad = Vec::new();
    for s in sources {
        let provider = s
            .module
            .first()
            .is_some_and(|f| PROVIDERS.contains(&f.as_str()));
        if provider {
            let code = code_only(&s.text);
            for (n, line) in code.lines().enumerate() {
                for item in NOT_FOR_PROVIDERS {
                    let named = line.match_indices(item).any(|(at, _)| {
                        let before = line[..at].chars().next_back();
                        let after = line[at + item.len()..].chars().next();
                        !before.is_some_and(is_ident) && !after.is_some_and(is_ident)
                    });
                    if named {
                        bad.push(format!(
                            "{}:{}: names `{item}`, which is the resource layer's side of the \
                             core: a provider uses the core's services only",
                            s.rel,
                            n + 1
                        ));
                    }
                }
            }
        }
        for (line, written, target) in named_paths(s) {
            if let Err(why) = check(s, &target, sources) {
                bad.push(format!("{}:{line}: `{written}`: {why}", s.rel));
            }
        }
    }
    bad
}

fn crate_sources() -> Vec<Source> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut sources = Vec::new();
    collect(&root, &root, &mut sources);
    sources
}

#[test]
fn every_file_uses_only_the_layers_it_may() {
    let sources = crate_sources();
    let folders: Vec<&str> = sources
        .iter()
        .filter(|s| s.module.len() > 1 || (s.is_mod && !s.module.is_empty()))
        .map(|s| s.module[0].as_str())
        .collect();
    for f in &folders {
        assert!(
            layer_of_module(f, true).is_some(),
            "src/{f}/ belongs to no layer: add it to tests/layers.rs"
        );
    }
    for needed in ["model", "contract", "resource", "shm", "tcp", "ofi"] {
        assert!(folders.contains(&needed), "src/{needed}/ is missing");
    }
    let bad = violations(&sources);
    assert!(
        bad.is_empty(),
        "{} import(s) break the layering (see src/lib.rs):\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
fn only_the_top_names_the_providers() {
    // The registry (which module opens each provider) sits at the top, not in the contract.
    let sources = crate_sources();
    let mut namers = BTreeMap::new();
    for s in &sources {
        for (line, written, target) in named_paths(s) {
            let Some(first) = target.first() else {
                continue;
            };
            let own = s.module.first() == Some(first);
            if PROVIDERS.contains(&first.as_str()) && !own {
                namers.insert(format!("{}:{line}", s.rel), written);
            }
        }
    }
    for (at, written) in &namers {
        assert!(
            at.starts_with("src/registry.rs") || at.starts_with("src/lib.rs"),
            "{at}: `{written}` names a provider outside the registry"
        );
    }
    assert!(
        namers.keys().any(|k| k.starts_with("src/registry.rs")),
        "the registry names no provider: was it moved? ({namers:?})"
    );
}

/// The checker itself: it must catch what it is for (an upward import, a provider reaching a
/// resource or another provider), and let the allowed ones through.
#[test]
fn the_checker_catches_bad_imports() {
    let file = |rel: &str, module: &[&str], is_mod: bool, text: &str| Source {
        rel: rel.to_string(),
        module: module.iter().map(|s| s.to_string()).collect(),
        is_mod,
        text: text.to_string(),
    };
    let defs = file(
        "src/model/types.rs",
        &["model", "types"],
        false,
        "pub struct Cancel;\n",
    );
    let cases = [
        // (file, expected number of violations)
        (
            file(
                "src/model/types.rs",
                &["model", "types"],
                false,
                "use crate::contract::QpInner;\n",
            ),
            1,
        ),
        (
            file(
                "src/contract/qp.rs",
                &["contract", "qp"],
                false,
                "use super::cq::CqCore;\nuse crate::{model::Error, resource::QueuePair};\n\
                 fn f() { crate::tcp::open(); }\n",
            ),
            2,
        ),
        (
            file(
                "src/tcp/rx.rs",
                &["tcp", "rx"],
                false,
                "use super::conn::Conn;\nuse crate::contract::{MrInner, sendq::Keep};\n\
                 use crate::model::*;\nuse crate::Cancel;\n\
                 // use crate::resource::qp::QueuePair;\n\
                 const S: &str = \"crate::shm::x\";\n",
            ),
            0,
        ),
        (
            file(
                "src/tcp/rx.rs",
                &["tcp", "rx"],
                false,
                "use crate::resource::QueuePair;\nuse crate::shm::service;\n\
                 use super::super::ofi::Engine;\nuse crate::contract::{QpHandleSide, QpInner};\n",
            ),
            4,
        ),
        (
            file(
                "src/shm/mod.rs",
                &["shm"],
                true,
                "use super::resource::Context;\nuse self::qp::ShmQp;\n",
            ),
            1,
        ),
        (
            file(
                "src/progress.rs",
                &["progress"],
                false,
                "use crate::resource::CompletionQueue;\nuse crate::model::Error;\n\
                 use crate::registry::Device;\n",
            ),
            1,
        ),
        (
            file(
                "src/progress/tests.rs",
                &["progress", "tests"],
                false,
                "use super::*;\nuse crate::{Context, Device};\n",
            ),
            0,
        ),
        (
            file(
                "src/registry.rs",
                &["registry"],
                false,
                "use crate::resource::Context;\nfn f() { crate::shm::open() }\n",
            ),
            0,
        ),
    ];
    for (src, want) in cases {
        let got = violations(&[src.clone(), defs.clone()]);
        assert_eq!(
            got.len(),
            want,
            "{}: {:?}\n{}",
            src.rel,
            src.text,
            got.join("\n")
        );
    }
}
