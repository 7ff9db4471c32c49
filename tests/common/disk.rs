//! A small tmpfs as a broker's data directory, filled for real to make its writes
//! fail with ENOSPC (mounting needs root, as CI runs; without it the test fails
//! saying so rather than skipping); and a disk whose flushes fail with EIO.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A tmpfs mounted at a directory; unmounted when dropped.
pub struct Tmpfs {
    dir: PathBuf,
}

impl Tmpfs {
    /// Mounts a tmpfs of `size` (as `mount` takes it: `64m`) at `dir`.
    pub fn mount(dir: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(dir).expect("mount point");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "mounting a tmpfs at {} failed (this test needs root, as CI runs): {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Tmpfs {
            dir: dir.to_path_buf(),
        }
    }

    fn filler(&self) -> PathBuf {
        self.dir.join("filler")
    }

    /// Fills the file system to its last byte; returns how many bytes that took.
    pub fn fill(&self) -> u64 {
        let mut f = std::fs::File::create(self.filler()).expect("filler file");
        let mut written = 0u64;
        for chunk in [1 << 20, 4096, 1] {
            let buf = vec![0xa5u8; chunk];
            loop {
                match f.write(&buf) {
                    Ok(n) => written += n as u64,
                    Err(e) if e.raw_os_error() == Some(28) => break, // ENOSPC
                    Err(e) => panic!("filling {}: {e}", self.dir.display()),
                }
            }
        }
        written
    }

    /// Frees what [`Tmpfs::fill`] took.
    pub fn free(&self) {
        std::fs::remove_file(self.filler()).expect("remove the filler");
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

/// The C source of the fault shim: `fdatasync` and `fsync` fail with EIO while the
/// file named by `COURIER_FAULT_TRIGGER` exists, and pass through otherwise.
const FAULT_SHIM: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

static int failing(void) {
    const char *trigger = getenv("COURIER_FAULT_TRIGGER");
    return trigger != NULL && access(trigger, F_OK) == 0;
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    if (failing()) { errno = EIO; return -1; }
    return real(fd);
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    if (failing()) { errno = EIO; return -1; }
    return real(fd);
}
"#;

/// A disk whose flushes can be made to fail with EIO, as a failing device's do: a
/// shim preloaded into the broker (`LD_PRELOAD`) in front of libc's `fdatasync`
/// and `fsync`, switched by a trigger file. Built with the system's C compiler,
/// which Rust's linker needs anyway.
pub struct FaultyDisk {
    lib: PathBuf,
    trigger: PathBuf,
}

impl FaultyDisk {
    /// Builds the shim into `dir`.
    pub fn build(dir: &Path) -> FaultyDisk {
        let src = dir.join("fault-shim.c");
        let lib = dir.join("fault-shim.so");
        std::fs::write(&src, FAULT_SHIM).expect("shim source");
        let out = Command::new("cc")
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&lib)
            .arg(&src)
            .arg("-ldl")
            .output()
            .expect("run cc");
        assert!(
            out.status.success(),
            "building the fault shim failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        FaultyDisk {
            lib,
            trigger: dir.join("fault-trigger"),
        }
    }

    /// The environment that puts the shim in front of a process's flushes.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("LD_PRELOAD".into(), self.lib.display().to_string()),
            (
                "COURIER_FAULT_TRIGGER".into(),
                self.trigger.display().to_string(),
            ),
        ]
    }

    /// From now on every flush fails with EIO.
    pub fn fail(&self) {
        std::fs::write(&self.trigger, b"").expect("fault trigger");
    }

    /// Flushes pass through again.
    pub fn heal(&self) {
        let _ = std::fs::remove_file(&self.trigger);
    }
}
