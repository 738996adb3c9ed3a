//! Lets the unit tests find libpython: without the `extension-module` feature the crate links
//! the interpreter's shared library, which (for pyenv's or any non-system Python) lives outside
//! the loader's search path.
fn main() {
    pyo3_build_config::use_pyo3_cfgs();
    if std::env::var_os("CARGO_FEATURE_EXTENSION_MODULE").is_some() {
        return;
    }
    let config = pyo3_build_config::get();
    if let Some(dir) = config.lib_dir() {
        // (Only the unit-test binary runs from cargo; the cdylib built this way is not shipped.)
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
