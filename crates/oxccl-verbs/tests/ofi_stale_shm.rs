//! libfabric shm regions left under `/dev/shm` by processes that no longer run are removed
//! before this process's first ofi endpoint over `shm`; regions of live processes, and regions
//! some process still maps, stay. Without the clean-up a killed process's regions stay until
//! reboot, and one named after this PID fails `fi_enable` with EBUSY (as CI once saw, after a
//! few hundred killed test peers had left theirs behind). A test binary of its own: the
//! clean-up runs once per process, before its first shm endpoint.
#![cfg(feature = "ofi")]

use std::path::Path;

use oxccl_verbs::{Context, Device, DeviceConfig};

/// A PID that no process of this namespace has now: a child's, after it was reaped.
fn dead_pid() -> u32 {
    loop {
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("spawning true");
        let pid = child.id();
        child.wait().expect("reaping true");
        if !Path::new(&format!("/proc/{pid}")).exists() {
            return pid;
        }
    }
}

#[test]
fn regions_of_processes_that_no_longer_run_are_removed_before_the_first_shm_endpoint() {
    let pid = std::process::id();
    let (dead, mapped_dead) = (dead_pid(), dead_pid());
    let stale = [
        format!("/dev/shm/{pid}:0:0"),
        format!("/dev/shm/{pid}:1:0"),
        format!("/dev/shm/{dead}:0:0"),
    ];
    // PID 1 runs in every PID namespace; an unrelated name; a dead owner's region that this
    // process still maps (as a peer of the dead process would).
    let live = "/dev/shm/1:7:7".to_string();
    let unrelated = format!("/dev/shm/{dead}:0:0:x");
    let mapped = format!("/dev/shm/{mapped_dead}:3:0");
    for p in stale.iter().chain([&live, &unrelated, &mapped]) {
        std::fs::write(p, vec![7u8; 4096]).expect("writing /dev/shm");
    }
    let file = std::fs::File::open(&mapped).unwrap();
    // SAFETY: a private read-only mapping of a file this test made and nobody else writes.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&file),
            0,
        )
    };
    assert_ne!(map, libc::MAP_FAILED);
    drop(file);

    let mut config = DeviceConfig::from_env().unwrap();
    config.ofi_provider = "shm".into();
    let device = Device::by_name("ofi").unwrap();
    // Without the clean-up this fails: the endpoint's own region is `{pid}:0:0`.
    let ctx = Context::open_with(device.provider(), &config);
    let kept: Vec<bool> = [&live, &unrelated, &mapped]
        .iter()
        .map(|p| Path::new(p).exists())
        .collect();
    for p in [&live, &unrelated, &mapped] {
        let _ = std::fs::remove_file(p);
    }
    // SAFETY: the mapping made above, of 4096 bytes, unmapped once.
    unsafe { libc::munmap(map, 4096) };
    let ctx = ctx.unwrap_or_else(|e| panic!("opening ofi over shm: {e}"));
    // The endpoint's own region goes when it closes; a stale one would still be there.
    drop(ctx);
    let left: Vec<bool> = stale.iter().map(|p| Path::new(p).exists()).collect();
    for p in &stale {
        let _ = std::fs::remove_file(p);
    }
    assert_eq!(left, [false, false, false], "the stale regions are gone");
    assert_eq!(
        kept,
        [true, true, true],
        "a live PID's region, another name and a mapped region stay"
    );
}
