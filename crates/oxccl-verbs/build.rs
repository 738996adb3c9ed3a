//! Builds the ofi provider's C shim (`src/ofi/shim.c`) when the `ofi` feature is on. The shim
//! loads libfabric at run time (`dlopen`), so nothing here links it: only its headers are needed
//! to build, and only for that feature.

fn main() {
    println!("cargo:rerun-if-changed=src/ofi/shim.c");
    if std::env::var_os("CARGO_FEATURE_OFI").is_none() {
        return;
    }
    let header = std::path::Path::new("/usr/include/rdma/fabric.h");
    let mut build = cc::Build::new();
    // A libfabric installed elsewhere: pkg-config's include path, when it knows one.
    if let Ok(out) = std::process::Command::new("pkg-config")
        .args(["--cflags-only-I", "libfabric"])
        .output()
        && out.status.success()
    {
        for flag in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            if let Some(dir) = flag.strip_prefix("-I") {
                build.include(dir);
            }
        }
    } else if !header.exists() {
        panic!(
            "the `ofi` feature builds the ofi provider against libfabric's headers \
             (rdma/fabric.h), which are not installed: install libfabric-dev (Debian/Ubuntu: \
             apt-get install libfabric-dev; 1.17 or later), or build without the feature"
        );
    }
    build
        .file("src/ofi/shim.c")
        .warnings(true)
        .compile("oxccl_ofi_shim");
    // dlopen and pthread_once live in libc from glibc 2.34; older ones need these.
    println!("cargo:rustc-link-lib=dl");
    println!("cargo:rustc-link-lib=pthread");
}
