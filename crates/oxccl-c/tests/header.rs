//! `include/oxccl.h` is what cbindgen makes of `src/` now: fails when it is stale. Regenerate
//! it with `OXCCL_BLESS=1 cargo test -p oxccl-c --test header`.

use std::path::Path;

#[test]
fn the_header_is_up_to_date() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config =
        cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut fresh = Vec::new();
    cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen failed")
        .write(&mut fresh);
    let fresh = String::from_utf8(fresh).expect("UTF-8");
    let path = crate_dir.join("include/oxccl.h");
    if std::env::var_os("OXCCL_BLESS").is_some() {
        std::fs::write(&path, &fresh).expect("writing the header");
        return;
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        checked_in == fresh,
        "{} is stale: regenerate it with `OXCCL_BLESS=1 cargo test -p oxccl-c --test header`",
        path.display()
    );
}
