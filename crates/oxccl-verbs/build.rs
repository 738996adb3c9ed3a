//! Builds the ofi provider's C shim (`src/ofi/shim.c`) and links libfabric.

fn main() {
    println!("cargo:rerun-if-changed=src/ofi/shim.c");
    let header = std::path::Path::new("/usr/include/rdma/fabric.h");
    let mut build = cc::Build::new();
    // A libfabric installed elsewhere: pkg-config's include path, when it knows one.
    if let Ok(out) = std::process::Command::new("pkg-config")
        .args(["--cflags-only-I", "--libs-only-L", "libfabric"])
        .output()
        && out.status.success()
    {
        for flag in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            if let Some(dir) = flag.strip_prefix("-I") {
                build.include(dir);
            } else if let Some(dir) = flag.strip_prefix("-L") {
                println!("cargo:rustc-link-search=native={dir}");
            }
        }
    } else if !header.exists() {
        panic!(
            "the ofi provider needs libfabric's headers (rdma/fabric.h): install libfabric-dev \
             (Debian/Ubuntu: apt-get install libfabric-dev; 1.17 or later)"
        );
    }
    build
        .file("src/ofi/shim.c")
        .warnings(true)
        .compile("oxccl_ofi_shim");
    println!("cargo:rustc-link-lib=fabric");
}
