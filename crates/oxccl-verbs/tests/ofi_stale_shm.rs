//! A libfabric shm region left under `/dev/shm` by a killed process whose PID this process now
//! has does not keep the ofi provider over `shm` from opening (libfabric's `fi_enable` failed
//! with EBUSY, as CI saw once a few hundred killed test peers had left theirs behind). A test
//! binary of its own: the clean-up runs once per process, before its first shm endpoint.

use oxccl_verbs::{Context, Device, DeviceConfig};

#[test]
fn a_stale_region_named_after_this_pid_is_removed_before_the_first_shm_endpoint() {
    let pid = std::process::id();
    let stale = [format!("/dev/shm/{pid}:0:0"), format!("/dev/shm/{pid}:1:0")];
    // Another PID's region and a name of another shape stay.
    let other = format!("/dev/shm/{}:0:0", pid.wrapping_add(1));
    let unrelated = format!("/dev/shm/{pid}:0:0:x");
    for p in stale.iter().chain([&unrelated]) {
        std::fs::write(p, b"left by a killed process").expect("writing /dev/shm");
    }
    let other_existed = std::path::Path::new(&other).exists();
    if !other_existed {
        std::fs::write(&other, b"another process's").expect("writing /dev/shm");
    }
    let mut config = DeviceConfig::from_env().unwrap();
    config.ofi_provider = "shm".into();
    let device = Device::by_name("ofi").unwrap();
    // Without the clean-up this fails: the endpoint's own region is `{pid}:0:0`.
    let ctx = Context::open_with(device.provider(), &config);
    let kept = std::path::Path::new(&other).exists() && std::path::Path::new(&unrelated).exists();
    let _ = std::fs::remove_file(&unrelated);
    if !other_existed {
        let _ = std::fs::remove_file(&other);
    }
    let ctx = ctx.unwrap_or_else(|e| panic!("opening ofi over shm: {e}"));
    // The endpoint's own region goes when it closes; a stale one would still be there.
    drop(ctx);
    let left: Vec<bool> = stale
        .iter()
        .map(|p| std::path::Path::new(p).exists())
        .collect();
    assert_eq!(left, [false, false], "the stale regions are gone");
    assert!(kept, "another PID's region and another name stay");
}
