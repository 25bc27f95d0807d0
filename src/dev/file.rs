//! An image file or a block device, through pread/pwrite/fdatasync.
//!
//! Large aligned reads and writes (sequential data: writeback runs, readahead) go
//! around the host's page cache (O_DIRECT; straight from the caller's buffer when it
//! is an `AlignedBuf`, else through a per-thread bounce buffer): birchfs caches the
//! data itself, and a second copy in the host cache would cost a copy, memory and a
//! writeback later. Small writes (log batches, tree nodes, random data blocks) stay
//! buffered, so an fsync's few blocks go out together with its flush. The kernel keeps
//! the two paths coherent (a direct write drops cached pages of its range).

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
    /// The same file opened with O_DIRECT, where the host filesystem allows it.
    direct: Option<File>,
    size: u64,
}

/// Writes at least this large (and aligned) bypass the host page cache.
const DIRECT_MIN: usize = 256 << 10;
/// Alignment of direct I/O addresses, lengths and buffers.
const DIRECT_ALIGN: usize = 4096;
/// Size of each thread's bounce buffer for direct I/O.
const BOUNCE: usize = 1 << 20;

/// A zeroed buffer aligned for direct I/O.
struct Bounce {
    ptr: *mut u8,
}

impl Bounce {
    fn layout() -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(BOUNCE, DIRECT_ALIGN).expect("valid layout")
    }
    fn new() -> Bounce {
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(Self::layout()) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(Self::layout());
        }
        Bounce { ptr }
    }
    fn slice(&mut self, len: usize) -> &mut [u8] {
        assert!(len <= BOUNCE);
        // SAFETY: ptr holds BOUNCE initialized bytes owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, len) }
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with the same layout.
        unsafe { std::alloc::dealloc(self.ptr, Self::layout()) }
    }
}

thread_local! {
    static BOUNCE_BUF: std::cell::RefCell<Option<Bounce>> = const { std::cell::RefCell::new(None) };
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
        let direct = if writable {
            use std::os::unix::fs::OpenOptionsExt;
            OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(path)
                .ok()
        } else {
            None
        };
        Ok(FileDev { file, direct, size })
    }

    /// The O_DIRECT file, if `len` bytes at `off` should go through it.
    fn direct_for(&self, len: usize, off: u64) -> Option<&File> {
        self.direct.as_ref().filter(|_| {
            len >= DIRECT_MIN && len % DIRECT_ALIGN == 0 && off % DIRECT_ALIGN as u64 == 0
        })
    }

    /// Reads `buf` at `off` with O_DIRECT (into `buf` itself when it is aligned).
    fn read_direct(d: &File, buf: &mut [u8], off: u64) -> io::Result<()> {
        if buf.as_ptr() as usize % DIRECT_ALIGN == 0 {
            return d.read_exact_at(buf, off);
        }
        BOUNCE_BUF.with(|b| {
            let mut b = b.borrow_mut();
            let bounce = b.get_or_insert_with(Bounce::new);
            let mut done = 0;
            while done < buf.len() {
                let n = (buf.len() - done).min(BOUNCE);
                let chunk = bounce.slice(n);
                d.read_exact_at(chunk, off + done as u64)?;
                buf[done..done + n].copy_from_slice(chunk);
                done += n;
            }
            Ok(())
        })
    }

    /// Writes `buf` at `off` with O_DIRECT (from `buf` itself when it is aligned).
    fn write_direct(d: &File, buf: &[u8], off: u64) -> io::Result<()> {
        if buf.as_ptr() as usize % DIRECT_ALIGN == 0 {
            return d.write_all_at(buf, off);
        }
        BOUNCE_BUF.with(|b| {
            let mut b = b.borrow_mut();
            let bounce = b.get_or_insert_with(Bounce::new);
            let mut done = 0;
            while done < buf.len() {
                let n = (buf.len() - done).min(BOUNCE);
                let chunk = bounce.slice(n);
                chunk.copy_from_slice(&buf[done..done + n]);
                d.write_all_at(chunk, off + done as u64)?;
                done += n;
            }
            Ok(())
        })
    }
}

impl BlockDev for FileDev {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        if let Some(d) = self.direct_for(buf.len(), off) {
            return Self::read_direct(d, buf, off);
        }
        self.file.read_exact_at(buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        if off + buf.len() as u64 > self.size {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        if let Some(d) = self.direct_for(buf.len(), off) {
            return Self::write_direct(d, buf, off);
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
