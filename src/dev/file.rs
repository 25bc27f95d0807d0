//! An image file or a block device, through pread/pwrite/fdatasync.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;

use super::BlockDev;

/// A device backed by a file or a block device node, locked for exclusive use.
#[derive(Debug)]
pub struct FileDev {
    file: File,
    size: u64,
}

impl FileDev {
    /// Opens `path` and takes an exclusive lock on it; fails with `WouldBlock` if another
    /// process (a mounted birchfs) holds it.
    pub fn open(path: &Path, writable: bool) -> io::Result<FileDev> {
        let mut file = OpenOptions::new().read(true).write(writable).open(path)?;
        // SAFETY: flock on a valid fd owned by `file`.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Err(io::Error::new(
                    io::ErrorKind::WouldBlock,
                    format!("{} is in use (already mounted?)", path.display()),
                ));
            }
            return Err(e);
        }
        let size = file.seek(SeekFrom::End(0))?;
        Ok(FileDev { file, size })
    }
}

impl BlockDev for FileDev {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        if off + buf.len() as u64 > self.size {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        self.file.write_all_at(buf, off)
    }
    fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }
    fn size(&self) -> u64 {
        self.size
    }
}
