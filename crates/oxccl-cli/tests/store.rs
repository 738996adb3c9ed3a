//! `oxccl store`: a standalone store serves authenticated clients, refuses and logs strangers,
//! and names what is wrong when it cannot start.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use oxccl_bootstrap::{Error, Secret, Store, TcpStore};

const T: Duration = Duration::from_secs(10);

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn oxccl_store(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_oxccl"));
    cmd.arg("store")
        .args(args)
        .env_remove("OXCCL_SECRET")
        .env_remove("OXCCL_SECRET_FILE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

#[test]
fn serves_the_job_and_logs_strangers() {
    let dir = std::env::temp_dir().join(format!("oxccl-store-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("secret");
    std::fs::write(&file, "cli-secret\n").unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let mut child = Killed(
        oxccl_store(&[
            "--bind",
            "127.0.0.1:0",
            "--secret-file",
            file.to_str().unwrap(),
        ])
        .spawn()
        .unwrap(),
    );
    let mut line = String::new();
    BufReader::new(child.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("oxccl store: listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();

    let secret = Secret::new("cli-secret").unwrap();
    let a = TcpStore::connect(&addr, &secret, T).unwrap();
    let b = TcpStore::connect(&addr, &secret, T).unwrap();
    a.set("endpoint/0", b"qp 1").unwrap();
    assert_eq!(b.get("endpoint/0", T).unwrap(), b"qp 1");
    assert_eq!(b.add("count", 2).unwrap(), 2);

    let wrong = Secret::new("guess").unwrap();
    let e = TcpStore::connect(&addr, &wrong, T).unwrap_err();
    assert!(matches!(e, Error::AuthRefused { .. }), "{e}");
    // The job goes on.
    assert_eq!(a.get("count", T).unwrap(), b"2");

    // Kill the store: clients fail at once, naming it.
    let _ = child.0.kill();
    let _ = child.0.wait();
    let e = a.get("never", Duration::from_secs(60)).unwrap_err();
    assert!(e.is_store_gone() && e.to_string().contains(&addr), "{e}");
    let mut log = String::new();
    child
        .0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    assert!(
        log.contains("WARN") && log.contains("does not know the secret"),
        "{log}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn says_what_is_missing_or_taken() {
    // No secret at all, and no home for the per-user secret file.
    let out = oxccl_store(&["--bind", "127.0.0.1:0"])
        .env_remove("HOME")
        .env_remove("XDG_CONFIG_HOME")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("OXCCL_SECRET") && err.contains("HOME"),
        "{err}"
    );

    // The port is taken.
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = held.local_addr().unwrap().to_string();
    let out = oxccl_store(&["--bind", &addr])
        .env("OXCCL_SECRET", "s")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&addr) && err.contains("already in use"),
        "{err}"
    );
}
