//! A small tmpfs as a broker's data directory, filled for real to make its writes
//! fail with ENOSPC. Mounting needs root, as CI runs; without it the test fails
//! saying so rather than skipping.

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
