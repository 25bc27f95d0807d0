//! An image file or a block device, through pread/pwrite/fdatasync.
//!
//! Large aligned reads and writes (sequential data: writeback runs, readahead) go
//! around the host's page cache (O_DIRECT; straight from the caller's buffer when it
//! is an `AlignedBuf`, else through a per-thread bounce buffer): birchfs caches the
//! data itself, and a second copy in the host cache would cost a copy, memory and a
//! writeback later. Small writes (log batches, tree nodes, random data blocks) stay
//! buffered, so an fsync's few blocks go out together with its flush. The kernel keeps
//! the two paths coherent (a direct write drops cached pages of its range).
//!
//! A block device is different: copying into its page cache costs more than the write
//! (buffered 64 KiB writes to a loop device ran at 0.4 of the speed of the same writes
//! to a file on the host), so there a batch of aligned writes goes direct from 64 KiB
//! on, and every aligned read goes direct, so that reads never fill the kernel's cache
//! of the device. That cache does not stay coherent beside direct writes: an
//! asynchronous (io_uring) direct write to a block device does not drop the cached
//! pages that a buffered read's readahead brought in while it was in flight, so a later
//! buffered read of those blocks returned their old contents (checksum mismatches under
//! four concurrent fsx runs), and a synchronous one whose cached pages were busy set an
//! error that the next fdatasync returned (EIO; "Page cache invalidation failure on
//! direct I/O" in the kernel log). Small writes stay buffered (an fsync's few blocks go
//! out with its flush); only their own blocks are cached, and no direct write meets
//! them (a freed block is reused only after the commit's flush wrote it). Direct writes
//! wait for the device, so a batch of them (`write_many`: the runs of one writeback,
//! the nodes of one commit) is submitted at once through an io_uring and waited for
//! together, falling back to one at a time where io_uring is not available. On an
//! image file a batch of several MiB (a large commit's nodes) goes the same way: left
//! in the host cache, it would be written out by the next fsync's fdatasync, which
//! then waited tens of milliseconds for the commit's blocks. Large
//! reads of one batch (`read_many`: a readahead window, read straight into its folios
//! piece by piece) go out the same way, on files and devices alike.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::{Condvar, Mutex};

use super::BlockDev;

/// A device backed by a file or a block device node, locked for exclusive use.
#[derive(Debug)]
pub struct FileDev {
    file: File,
    /// The same file opened with O_DIRECT, where the host filesystem allows it.
    direct: Option<File>,
    /// Size in bytes; it grows (never shrinks) with [`BlockDev::grow`] while in use.
    size: AtomicU64,
    /// A `write_many` batch whose aligned writes add up to at least this sends them
    /// all direct, together.
    batch_direct: usize,
    /// Whether every aligned read goes direct (a block device), not only large ones.
    reads_direct: bool,
    /// Whether this is a block device (discards are BLKDISCARD, not holes).
    bdev: bool,
    /// For a loop device, its backing file, locked as the image itself is: a mount
    /// of the file and one of the loop device over it would write the same blocks.
    _backing: Option<File>,
    /// Opens of the device for flushes ([`FlushGate`]).
    flushers: Flushers,
    /// Keeps a failed flush failing ([`FlushGate`]).
    flushes: FlushGate,
}

/// Keeps a failed flush failing: it fails every later flush, and (where the device
/// needs it) every flush under way with it that returns after it.
///
/// The host reports a write it lost in writeback (a bad sector, a thin pool or an NFS
/// server out of space) to the next fdatasync of each open file once, then forgets it
/// for that open and marks the pages clean, so a second fdatasync through it returns 0
/// with the write lost. Each flush uses an open of its own ([`Flushers`]), so each
/// flush under way hears of the loss. A loop device without direct I/O is different:
/// it passes the loss of a write to its backing file on to one of its flushes only,
/// whatever the opens, and of two flushes under way at once the other may return 0
/// first. There a flush whose fdatasync returned 0 waits for every flush that began
/// before then, and looks for a failure among them (`wait_beside`; it costs: waiting
/// everywhere made fs_mark's creates with fsync over io_uring 13 % slower).
#[derive(Debug, Default)]
struct FlushGate {
    /// Whether a flush that succeeded waits for those begun before it returned.
    wait_beside: bool,
    /// Flushes under way (counted only with `wait_beside`).
    tickets: Mutex<FlushTickets>,
    /// Signalled when a flush ends.
    ended: Condvar,
    /// Set once a flush failed.
    failed: AtomicBool,
}

/// Separate opens of the device, one per flush under way ([`FlushGate`]); more
/// flushes than opens wait their turn.
#[derive(Debug)]
struct Flushers {
    free: Mutex<Vec<File>>,
    returned: Condvar,
}

/// How many flushes may be under way at once ([`Flushers`]).
const FLUSHERS: usize = 8;

impl Flushers {
    /// Opens `path` (the device `file` is open on) `n` times, before any write, so
    /// that each open hears of every write lost from then on.
    fn open(path: &Path, file: &File, writable: bool, n: usize) -> io::Result<Flushers> {
        use std::os::unix::fs::MetadataExt;
        let want = file.metadata()?;
        let mut free = Vec::with_capacity(n);
        for _ in 0..n {
            let f = OpenOptions::new().read(true).write(writable).open(path)?;
            let m = f.metadata()?;
            if (m.dev(), m.ino(), m.rdev()) != (want.dev(), want.ino(), want.rdev()) {
                return Err(io::Error::other(format!(
                    "{} was replaced while it was opened",
                    path.display()
                )));
            }
            free.push(f);
        }
        Ok(Flushers {
            free: Mutex::new(free),
            returned: Condvar::new(),
        })
    }

    /// fdatasync through an open no other flush is using.
    fn sync_data(&self) -> io::Result<()> {
        let file = {
            let mut g = self.free.lock();
            loop {
                if let Some(file) = g.pop() {
                    break file;
                }
                self.returned.wait(&mut g);
            }
        };
        let r = file.sync_data();
        self.free.lock().push(file);
        self.returned.notify_one();
        r
    }
}

/// Whether `meta` is a loop device that does not use direct I/O on its backing file
/// (or one that cannot be told).
fn buffered_loop(meta: &std::fs::Metadata) -> bool {
    loop_backing_file(meta).is_some() && loop_attr(meta, "dio").is_none_or(|v| v.trim() != "1")
}

/// Flushes under way, numbered in the order they began.
#[derive(Debug, Default)]
struct FlushTickets {
    /// The number the next flush gets.
    next: u64,
    /// The flushes that have not ended.
    under_way: std::collections::BTreeSet<u64>,
}

impl FlushGate {
    /// Runs the flush `f` (fdatasync) and keeps its failure (see [`FlushGate`]).
    fn flush(&self, f: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
        if self.failed.load(Ordering::Acquire) {
            return Err(flush_failed());
        }
        let ticket = self.wait_beside.then(|| {
            let mut g = self.tickets.lock();
            let t = g.next;
            g.next += 1;
            g.under_way.insert(t);
            t
        });
        let r = f();
        if let Err(e) = &r {
            tracing::error!("flush of the device failed, as will every later one: {e}");
            self.failed.store(true, Ordering::Release);
        }
        if let Some(ticket) = ticket {
            let mut g = self.tickets.lock();
            g.under_way.remove(&ticket);
            self.ended.notify_all();
            if r.is_ok() {
                let began_before = g.next;
                while g.under_way.first().is_some_and(|&t| t < began_before) {
                    self.ended.wait(&mut g);
                }
            }
        }
        if r.is_err() || self.failed.load(Ordering::Acquire) {
            return Err(flush_failed());
        }
        Ok(())
    }
}

/// Writes to an image file at least this large (and aligned) bypass the host page cache.
const DIRECT_MIN: usize = 256 << 10;
/// A batch of writes to a block device that adds up to this goes direct as a whole.
const BATCH_DIRECT_BDEV: usize = 64 << 10;
/// The same for an image file (W3's commits write 10-40 MiB of nodes).
const BATCH_DIRECT_FILE: usize = 4 << 20;
/// Writes one io_uring submission carries at most.
const RING_ENTRIES: usize = 64;
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

/// The process's file size limit (`ulimit -f`) in bytes, if it has one.
fn file_size_limit() -> Option<u64> {
    super::soft_limit(libc::RLIMIT_FSIZE)
}

/// The error for an image of `size` bytes that the file size limit `limit` would cut
/// short: every write past the limit would fail (EFBIG).
fn too_large(path: &Path, size: u64, limit: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::FileTooLarge,
        format!(
            "{} is {size} bytes, more than this process may write to a file (ulimit -f: \
             {limit} bytes); raise the limit (ulimit -f unlimited) and try again",
            path.display()
        ),
    )
}

/// What a flush returns once one failed: EIO, whatever the host said (the log has it),
/// so that it never reads as a want of space that freeing some would cure.
fn flush_failed() -> io::Error {
    io::Error::from_raw_os_error(libc::EIO)
}

thread_local! {
    static BOUNCE_BUF: std::cell::RefCell<Option<Bounce>> = const { std::cell::RefCell::new(None) };
}

impl FileDev {
    /// Opens `path` and takes an exclusive lock on it; fails with `WouldBlock` if another
    /// process (a mounted birchfs) holds it. A block device opened for writing is
    /// also claimed from the kernel (O_EXCL): one that is mounted, or held by LVM, md,
    /// swap or another exclusive opener, fails with `ResourceBusy`, and while birchfs
    /// holds it, the kernel will not mount it.
    pub fn open(path: &Path, writable: bool) -> io::Result<FileDev> {
        use std::os::unix::fs::OpenOptionsExt;
        let claim =
            writable && std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device());
        let mut file = OpenOptions::new()
            .read(true)
            .write(writable)
            .custom_flags(if claim { libc::O_EXCL } else { 0 })
            .open(path)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::EBUSY) if claim => io::Error::new(
                    io::ErrorKind::ResourceBusy,
                    format!(
                        "{} is in use by the system (mounted, or held by LVM, md, swap \
                         or another program); birchfs will not write to it",
                        path.display()
                    ),
                ),
                _ => e,
            })?;
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
        let meta = file.metadata()?;
        let bdev = meta.file_type().is_block_device();
        let backing = if bdev {
            lock_backing(path, &meta)?
        } else {
            None
        };
        if writable && !bdev {
            if let Some(limit) = file_size_limit().filter(|&l| l < size) {
                return Err(too_large(path, size, limit));
            }
        }
        if writable && bdev && read_only_bdev(&file) {
            // It opens for writing all the same, and every write fails (EPERM).
            return Err(io::Error::from_raw_os_error(libc::EROFS));
        }
        let direct = if writable {
            OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(path)
                .ok()
        } else {
            None
        };
        let flushers = Flushers::open(path, &file, writable, if writable { FLUSHERS } else { 1 })?;
        Ok(FileDev {
            file,
            direct,
            size: AtomicU64::new(size),
            batch_direct: if bdev {
                BATCH_DIRECT_BDEV
            } else {
                BATCH_DIRECT_FILE
            },
            // On a block device every aligned read goes direct (see the module's notes).
            reads_direct: bdev,
            bdev,
            _backing: backing,
            flushers,
            flushes: FlushGate {
                wait_beside: bdev && buffered_loop(&meta),
                ..FlushGate::default()
            },
        })
    }

    /// Sets the length of an image file (not of a block device) to `len` bytes.
    pub fn resize(&mut self, len: u64) -> io::Result<()> {
        self.set_file_len(len)?;
        self.size.store(len, Ordering::Relaxed);
        Ok(())
    }

    /// Sets the image file's length, with the reason when the host or `ulimit -f`
    /// refuses it.
    fn set_file_len(&self, len: u64) -> io::Result<()> {
        if let Some(limit) = file_size_limit().filter(|&l| l < len) {
            return Err(too_large(Path::new("the image"), len, limit));
        }
        self.file.set_len(len).map_err(|e| match e.raw_os_error() {
            Some(libc::EFBIG) => io::Error::new(
                io::ErrorKind::FileTooLarge,
                format!(
                    "the host filesystem holds no file of {} GiB ({e})",
                    len.div_ceil(1 << 30)
                ),
            ),
            _ => e,
        })
    }

    /// Writes each `(buf, off)` of `writes`, which belongs to a write of `whole[i]`
    /// bytes: large aligned writes go direct, in flight together; the rest one at a
    /// time.
    fn write_pieces(&self, writes: &[(&[u8], u64)], whole: &[usize]) -> io::Result<()> {
        if writes
            .iter()
            .any(|&(buf, off)| off + buf.len() as u64 > self.size())
        {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        let Some(d) = self.direct.as_ref() else {
            return writes
                .iter()
                .try_for_each(|&(b, off)| self.file.write_all_at(b, off));
        };
        let min = direct_min(writes.iter().map(|&(b, off)| (b, off)), self.batch_direct);
        let mut batch: Vec<(&[u8], u64)> = Vec::with_capacity(writes.len().min(RING_ENTRIES));
        for (&(buf, off), &len) in writes.iter().zip(whole) {
            if len >= min && direct_ok(buf, off) {
                batch.push((buf, off));
            } else {
                self.write_at(buf, off)?;
            }
        }
        for chunk in batch.chunks(RING_ENTRIES) {
            if chunk.len() > 1 {
                let ops: Vec<RingOp> = chunk
                    .iter()
                    .map(|&(b, off)| RingOp {
                        // The ring only reads from a write's buffer.
                        ptr: b.as_ptr().cast_mut(),
                        len: b.len(),
                        off,
                    })
                    .collect();
                if ring_io(d, &self.file, &ops, false)? {
                    continue;
                }
            }
            for &(buf, off) in chunk {
                d.write_all_at(buf, off)?;
            }
        }
        Ok(())
    }

    /// The O_DIRECT file, if `len` bytes at `off` should go through it.
    fn direct_for(&self, len: usize, off: u64, read: bool) -> Option<&File> {
        let min = if read && self.reads_direct {
            DIRECT_ALIGN
        } else {
            DIRECT_MIN
        };
        self.direct
            .as_ref()
            .filter(|_| len >= min && aligned(len, off))
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

/// The file under the loop device whose metadata is `meta`, as the kernel names it;
/// `None` for any other device or file.
pub fn loop_backing_file(meta: &std::fs::Metadata) -> Option<std::path::PathBuf> {
    let name = loop_attr(meta, "backing_file")?;
    Some(name.trim_end_matches('\n').into())
}

/// Attribute `name` of the loop device `meta` describes, from sysfs (`None` for
/// other files and devices, or an attribute this kernel lacks).
fn loop_attr(meta: &std::fs::Metadata, name: &str) -> Option<String> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    if !meta.file_type().is_block_device() {
        return None;
    }
    let rdev = meta.rdev();
    let (major, minor) = (libc::major(rdev), libc::minor(rdev));
    std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/loop/{name}")).ok()
}

/// For a loop device, opens and locks its backing file (named in sysfs) as
/// [`FileDev::open`] locks an image: fails with `WouldBlock` if a mount of that file
/// holds it. Nothing for other devices, or a backing file that is gone.
fn lock_backing(path: &Path, meta: &std::fs::Metadata) -> io::Result<Option<File>> {
    let Some(name) = loop_backing_file(meta) else {
        return Ok(None);
    };
    let Ok(f) = File::open(&name) else {
        return Ok(None);
    };
    // SAFETY: flock on a valid fd owned by `f`.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                format!(
                    "{} is a loop device over {}, which is in use (mounted?)",
                    path.display(),
                    name.display()
                ),
            ));
        }
        return Err(e);
    }
    Ok(Some(f))
}

/// Whether the block device `f` is set read-only (`blockdev --setro`, `losetup -r`).
fn read_only_bdev(f: &File) -> bool {
    /// `BLKROGET`, `_IO(0x12, 94)`.
    const BLKROGET: libc::c_ulong = 0x125e;
    let mut ro: libc::c_int = 0;
    // SAFETY: BLKROGET writes one int through the pointer, which is valid.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), BLKROGET, &mut ro) };
    rc == 0 && ro != 0
}

/// Whether `len` bytes at `off` are whole direct-I/O blocks.
fn aligned(len: usize, off: u64) -> bool {
    len % DIRECT_ALIGN == 0 && off % DIRECT_ALIGN as u64 == 0
}

/// Whether the ring may take `b` at `off` as it is: the transfer goes straight from
/// or into the caller's buffer, which must then be aligned too.
fn direct_ok(b: &[u8], off: u64) -> bool {
    b.as_ptr() as usize % DIRECT_ALIGN == 0 && aligned(b.len(), off)
}

/// The smallest piece of a batch that goes direct: any aligned piece once the batch's
/// aligned pieces add up to `batch` bytes, else only pieces of [`DIRECT_MIN`].
fn direct_min<'a>(pieces: impl Iterator<Item = (&'a [u8], u64)>, batch: usize) -> usize {
    let total: usize = pieces
        .filter(|&(b, off)| direct_ok(b, off))
        .map(|(b, _)| b.len())
        .sum();
    if total >= batch {
        DIRECT_ALIGN
    } else {
        DIRECT_MIN
    }
}

thread_local! {
    /// Each thread's io_uring for batches of direct writes: `None` until first used,
    /// `Some(None)` where the kernel refused one.
    static RING: std::cell::RefCell<Option<Option<io_uring::IoUring>>> =
        const { std::cell::RefCell::new(None) };
}

/// One direct transfer for [`ring_io`]: a buffer and its device offset.
#[derive(Clone, Copy)]
struct RingOp {
    ptr: *mut u8,
    len: usize,
    off: u64,
}

/// Carries out every op of `ops` (at most [`RING_ENTRIES`], buffers aligned) on `d`
/// (the O_DIRECT file) through this thread's io_uring, all in flight at once: reads
/// when `read`, else writes; `plain` is the same file without O_DIRECT, for the rest
/// of a short transfer. Returns `Ok(false)`, nothing done, when there is no ring to use.
fn ring_io(d: &File, plain: &File, ops: &[RingOp], read: bool) -> io::Result<bool> {
    use io_uring::{opcode, types};
    debug_assert!(ops.len() <= RING_ENTRIES);
    RING.with(|r| {
        let mut r = r.borrow_mut();
        let slot = r.get_or_insert_with(|| io_uring::IoUring::new(RING_ENTRIES as u32).ok());
        let Some(ring) = slot.as_mut() else {
            return Ok(false);
        };
        let fd = types::Fd(d.as_raw_fd());
        for (i, op) in ops.iter().enumerate() {
            let e = if read {
                opcode::Read::new(fd, op.ptr, op.len as u32)
                    .offset(op.off)
                    .build()
            } else {
                opcode::Write::new(fd, op.ptr, op.len as u32)
                    .offset(op.off)
                    .build()
            }
            .user_data(i as u64);
            // SAFETY: every buffer outlives this call, and the call does not return
            // before the kernel has completed every entry it was given (below).
            if unsafe { ring.submission().push(&e) }.is_err() {
                unreachable!("the queue holds RING_ENTRIES entries and starts empty");
            }
        }
        let mut submitted = 0;
        let mut done = vec![0usize; ops.len()];
        let mut reaped = 0;
        let mut first_err: Option<io::Error> = None;
        let mut tries = 0;
        while reaped < ops.len() {
            match ring.submit_and_wait(ops.len() - reaped) {
                Ok(n) => submitted += n,
                Err(e) if submitted == 0 && e.raw_os_error() != Some(libc::EINTR) => {
                    // Nothing reached the kernel: drop the ring (and the entries in
                    // it) and let the caller go one at a time.
                    tracing::warn!("io_uring submit failed ({e}); going without it");
                    *slot = None;
                    return Ok(false);
                }
                Err(e) => {
                    // Entries are in flight: keep waiting for them, whatever happens.
                    tries += 1;
                    if tries % 1000 == 0 {
                        tracing::error!("io_uring wait keeps failing: {e}");
                    }
                    std::thread::yield_now();
                }
            }
            for cqe in ring.completion() {
                reaped += 1;
                let i = cqe.user_data() as usize;
                match usize::try_from(cqe.result()) {
                    Ok(n) => done[i] = n,
                    Err(_) => {
                        first_err.get_or_insert(io::Error::from_raw_os_error(-cqe.result()));
                    }
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        for (op, &n) in ops.iter().zip(&done) {
            finish_short(d, plain, *op, n, read)?;
        }
        Ok(true)
    })
}

/// Finishes `op` after its first `n` bytes were transferred (a short direct transfer
/// is legal, if rare): synchronously, on `d` while the rest is still whole direct-I/O
/// blocks, else on `plain`, since O_DIRECT refuses an unaligned rest (EINVAL).
fn finish_short(d: &File, plain: &File, op: RingOp, n: usize, read: bool) -> io::Result<()> {
    if n >= op.len {
        return Ok(());
    }
    let off = op.off + n as u64;
    let len = op.len - n;
    // SAFETY: `op.ptr + n .. op.ptr + op.len` lies in the caller's buffer, which is no
    // longer in flight; a write's buffer is only read (it may be shared), a read's is
    // the caller's own mutable buffer.
    let ptr = unsafe { op.ptr.add(n) };
    let f = if aligned(len, off) && ptr as usize % DIRECT_ALIGN == 0 {
        d
    } else {
        plain
    };
    if read {
        // SAFETY: see above.
        f.read_exact_at(unsafe { std::slice::from_raw_parts_mut(ptr, len) }, off)
    } else {
        // SAFETY: see above.
        f.write_all_at(unsafe { std::slice::from_raw_parts(ptr, len) }, off)
    }
}

impl BlockDev for FileDev {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        if let Some(d) = self.direct_for(buf.len(), off, true) {
            return Self::read_direct(d, buf, off);
        }
        self.file.read_exact_at(buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        if off + buf.len() as u64 > self.size() {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        if let Some(d) = self.direct_for(buf.len(), off, false) {
            return Self::write_direct(d, buf, off);
        }
        self.file.write_all_at(buf, off)
    }
    fn write_many(&self, writes: &[(&[u8], u64)]) -> io::Result<()> {
        let whole: Vec<usize> = writes.iter().map(|(b, _)| b.len()).collect();
        self.write_pieces(writes, &whole)
    }
    fn write_gathered(&self, writes: &[(&[&[u8]], u64)]) -> io::Result<()> {
        let (pieces, whole) = super::flatten(writes);
        self.write_pieces(&pieces, &whole)
    }
    fn read_many(&self, reads: &mut [(&mut [u8], u64)]) -> io::Result<()> {
        // Large aligned reads into aligned buffers go direct, in flight together; the
        // rest one at a time. A batch of aligned reads that is large as a whole (a
        // readahead window read straight into its folios) goes direct piece by piece.
        let batch = if self.reads_direct { 0 } else { DIRECT_MIN };
        let min = direct_min(reads.iter().map(|(b, off)| (&**b, *off)), batch);
        let mut ops: Vec<RingOp> = Vec::new();
        for (buf, off) in reads.iter_mut() {
            let ringable = self.direct.is_some() && buf.len() >= min && direct_ok(buf, *off);
            if ringable {
                ops.push(RingOp {
                    ptr: buf.as_mut_ptr(),
                    len: buf.len(),
                    off: *off,
                });
            } else {
                self.read_at(buf, *off)?;
            }
        }
        let Some(d) = self.direct.as_ref() else {
            debug_assert!(ops.is_empty());
            return Ok(());
        };
        for chunk in ops.chunks(RING_ENTRIES) {
            if chunk.len() > 1 && ring_io(d, &self.file, chunk, true)? {
                continue;
            }
            for op in chunk {
                // SAFETY: a buffer of `reads`, borrowed mutably for this call.
                let buf = unsafe { std::slice::from_raw_parts_mut(op.ptr, op.len) };
                d.read_exact_at(buf, op.off)?;
            }
        }
        Ok(())
    }
    /// fdatasync, through an open of its own, with a failure kept ([`FlushGate`]).
    fn flush(&self) -> io::Result<()> {
        self.flushes.flush(|| self.flushers.sync_data())
    }
    fn discard(&self, off: u64, len: u64) -> io::Result<bool> {
        if len == 0 || off.checked_add(len).is_none_or(|end| end > self.size()) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let fd = self.file.as_raw_fd();
        let rc = if self.bdev {
            // BLKDISCARD, _IO(0x12, 119): the range as two u64s.
            const BLKDISCARD: libc::c_ulong = 0x1277;
            let range = [off, len];
            // SAFETY: the ioctl reads two u64s from a valid pointer.
            unsafe { libc::ioctl(fd, BLKDISCARD, range.as_ptr()) }
        } else {
            // SAFETY: fallocate on a valid fd owned by `self.file`.
            unsafe {
                libc::fallocate(
                    fd,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    off as libc::off_t,
                    len as libc::off_t,
                )
            }
        };
        if rc == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EOPNOTSUPP) | Some(libc::ENOTTY) => Ok(false),
            _ => Err(e),
        }
    }
    fn size(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }
    fn is_block_device(&self) -> bool {
        self.bdev
    }
    fn current_size(&self) -> io::Result<u64> {
        // lseek, not fstat: a block device's fstat size is 0.
        (&self.file).seek(SeekFrom::End(0))
    }
    fn grow(&self, len: u64) -> io::Result<u64> {
        let mut now = self.current_size()?;
        if now < len && !self.bdev {
            self.set_file_len(len)?;
            now = len;
        }
        Ok(self.size.fetch_max(now, Ordering::Relaxed).max(now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dev::AlignedBuf;

    /// Where the gate waits (a loop device without direct I/O), a flush that returns 0
    /// while one begun before it is still under way and then fails (the one the host
    /// told) fails too; so does every flush after, without reaching the device.
    #[test]
    fn a_flush_beside_a_failing_one_fails_too() {
        use std::sync::mpsc::channel;
        let gate = std::sync::Arc::new(FlushGate {
            wait_beside: true,
            ..FlushGate::default()
        });
        let (began_tx, began) = channel();
        let (fail_tx, fail) = channel::<()>();
        let failing = {
            let gate = gate.clone();
            std::thread::spawn(move || {
                gate.flush(|| {
                    began_tx.send(()).unwrap();
                    fail.recv().unwrap();
                    Err(io::Error::from_raw_os_error(libc::ENOSPC))
                })
            })
        };
        began.recv().unwrap();
        let (done_tx, done) = channel();
        let beside = {
            let gate = gate.clone();
            std::thread::spawn(move || {
                gate.flush(|| {
                    done_tx.send(()).unwrap();
                    Ok(())
                })
            })
        };
        // The second flush's fdatasync has returned 0; it must wait for the first.
        done.recv().unwrap();
        while gate.tickets.lock().under_way.len() != 1 {
            std::thread::yield_now();
        }
        fail_tx.send(()).unwrap();
        let r = beside.join().unwrap();
        assert!(r.is_err(), "returned 0 beside a failing flush");
        let e = failing.join().unwrap().unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
        let mut reached = false;
        assert!(gate
            .flush(|| {
                reached = true;
                Ok(())
            })
            .is_err());
        assert!(!reached, "flushed the device after a failure");
        // One begun after a successful one does not wait for it.
        let ok = FlushGate::default();
        assert!(ok.flush(|| Ok(())).is_ok());
        assert!(ok.flush(|| Ok(())).is_ok());
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect()
    }

    /// A device over a fresh 16 MiB file in /var/tmp (a disk filesystem, where
    /// O_DIRECT works; /tmp may be tmpfs).
    fn device() -> (tempfile::TempDir, FileDev) {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let path = dir.path().join("img");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(16 << 20)
            .unwrap();
        let dev = FileDev::open(&path, true).unwrap();
        (dir, dev)
    }

    /// A discard on an image file gives the range back to the host as a hole (fewer
    /// blocks allocated, zeros read) and leaves the rest alone; one past the end is
    /// refused.
    #[test]
    fn a_discard_punches_a_hole_in_an_image_file() {
        use std::os::unix::fs::MetadataExt;
        let (dir, dev) = device();
        let data = pattern(16 << 20, 3);
        dev.write_at(&data, 0).unwrap();
        dev.flush().unwrap();
        let blocks = || std::fs::metadata(dir.path().join("img")).unwrap().blocks();
        let before = blocks();
        assert!(dev.discard(4 << 20, 2 << 20).unwrap(), "no hole punched");
        assert_eq!(before - blocks(), (2 << 20) / 512, "host blocks freed");
        let mut buf = vec![1u8; 3 << 20];
        dev.read_at(&mut buf, 3 << 20).unwrap();
        assert_eq!(&buf[..1 << 20], &data[3 << 20..4 << 20]);
        assert!(
            buf[1 << 20..].iter().all(|&b| b == 0),
            "the hole reads other than zeros"
        );
        assert!(dev.discard(15 << 20, 2 << 20).is_err(), "past the end");
    }

    /// The rest of a short direct transfer is finished whether or not it is whole
    /// blocks: an unaligned rest goes through the plain file (O_DIRECT would refuse
    /// it with EINVAL), an aligned one stays direct.
    #[test]
    fn a_short_transfer_is_finished_aligned_or_not() {
        let (_dir, dev) = device();
        let Some(d) = dev.direct.as_ref() else {
            return; // no O_DIRECT here: nothing can come back short
        };
        let data = pattern(64 << 10, 9);
        let mut src = AlignedBuf::default();
        src.extend_from_slice(&data);
        for n in [0, 512, 4096, 5000, (64 << 10) - 1, 64 << 10] {
            let off = 1 << 20;
            dev.write_at(&vec![0u8; 64 << 10], off).unwrap();
            // As if the device had taken the first n bytes: write them, then finish.
            dev.file.write_all_at(&data[..n], off).unwrap();
            let op = RingOp {
                ptr: src.as_ptr().cast_mut(),
                len: src.len(),
                off,
            };
            finish_short(d, &dev.file, op, n, false).unwrap();
            let mut back = vec![0u8; 64 << 10];
            dev.read_at(&mut back, off).unwrap();
            assert!(back == data, "write finished after {n} bytes");
            // And a read that came back short after n bytes.
            let mut dst = AlignedBuf::default();
            dst.extend_from_slice(&vec![0u8; 64 << 10]);
            dst[..n].copy_from_slice(&data[..n]);
            let op = RingOp {
                ptr: dst.as_mut_ptr(),
                len: dst.len(),
                off,
            };
            finish_short(d, &dev.file, op, n, true).unwrap();
            assert!(dst[..] == data[..], "read finished after {n} bytes");
        }
    }

    /// Writes a batch mixing large aligned writes (direct, through the ring when
    /// there is one), small ones and an unaligned one, then reads every byte back.
    fn write_many_round_trip(dev: &FileDev) {
        let mut want = vec![0u8; 16 << 20];
        let big: Vec<AlignedBuf> = (0..5)
            .map(|k| {
                let mut b = AlignedBuf::default();
                b.extend_from_slice(&pattern(256 << 10, k as u8 + 1));
                b
            })
            .collect();
        let small = pattern(4096, 0x55);
        let odd = pattern(1000, 0xaa);
        let mut writes: Vec<(&[u8], u64)> = Vec::new();
        for (k, b) in big.iter().enumerate() {
            // Out of address order, and one right after another.
            let off = [(3 << 20), (1 << 20), (1 << 20) + (256 << 10), (9 << 20), 0][k];
            writes.push((&b[..], off));
        }
        writes.push((&small, 5 << 20));
        writes.push((&odd, (6 << 20) + 17));
        for &(b, off) in &writes {
            want[off as usize..off as usize + b.len()].copy_from_slice(b);
        }
        dev.write_many(&writes).unwrap();
        dev.flush().unwrap();
        let tried = RING.with(|r| r.borrow().as_ref().map(|ring| ring.is_some()));
        assert!(
            tried.is_some(),
            "the large direct writes went one at a time"
        );
        if tried == Some(false) {
            eprintln!("note: no io_uring here; the batch was written one piece at a time");
        }
        let mut got = vec![0u8; 16 << 20];
        for (k, chunk) in got.chunks_mut(1 << 20).enumerate() {
            dev.read_at(chunk, (k as u64) << 20).unwrap();
        }
        assert!(got == want, "write_many wrote something else than asked");
    }

    #[test]
    fn read_many_sends_small_aligned_pieces_of_a_large_batch_direct() {
        let (_d, dev) = device();
        let want = pattern(16 << 20, 0x5e);
        dev.write_at(&want, 0).unwrap();
        dev.flush().unwrap();
        // A readahead window read into its folios: 64 KiB buffers, 4 MiB in all,
        // from scattered places.
        let mut bufs: Vec<AlignedBuf> = (0..64).map(|_| AlignedBuf::zeroed(64 << 10)).collect();
        let offs: Vec<u64> = (0..64u64).map(|k| (k * 37 % 256) << 16).collect();
        let mut reads: Vec<(&mut [u8], u64)> = bufs
            .iter_mut()
            .zip(&offs)
            .map(|(b, &off)| (&mut b[..], off))
            .collect();
        dev.read_many(&mut reads).unwrap();
        for (b, &off) in bufs.iter().zip(&offs) {
            assert!(
                b[..] == want[off as usize..off as usize + (64 << 10)],
                "at {off}"
            );
        }
        if dev.direct.is_some() {
            let tried = RING.with(|r| r.borrow().as_ref().map(|ring| ring.is_some()));
            assert!(tried.is_some(), "the pieces were read one at a time");
        }
    }

    #[test]
    fn read_many_reads_every_piece_from_where_asked() {
        let (_d, dev) = device();
        let want = pattern(16 << 20, 0x3c);
        dev.write_at(&want, 0).unwrap();
        // Large aligned pieces (direct, in flight together), a small one, one at an
        // odd offset, and one into a buffer that is not aligned.
        let mut big = AlignedBuf::zeroed(3 << 20);
        let (a, rest) = big.split_at_mut(1 << 20);
        let (b, c) = rest.split_at_mut(1 << 20);
        let mut small = vec![0u8; 4096];
        let mut odd = vec![0u8; 999];
        let mut unaligned = vec![0u8; (256 << 10) + 1];
        let mut reads: Vec<(&mut [u8], u64)> = vec![
            (a, 5 << 20),
            (b, 0),
            (c, 15 << 20),
            (&mut small, 4096),
            (&mut odd, 12345),
            (&mut unaligned[1..], 8 << 20),
        ];
        dev.read_many(&mut reads).unwrap();
        let expect = |off: usize, len: usize| &want[off..off + len];
        assert!(big[..1 << 20] == *expect(5 << 20, 1 << 20));
        assert!(big[1 << 20..2 << 20] == *expect(0, 1 << 20));
        assert!(big[2 << 20..] == *expect(15 << 20, 1 << 20));
        assert!(small == expect(4096, 4096));
        assert!(odd == expect(12345, 999));
        assert!(unaligned[1..] == *expect(8 << 20, 256 << 10));
        // Past the end of the device is an error, not a short read.
        let mut tail = AlignedBuf::zeroed(1 << 20);
        let mut more = AlignedBuf::zeroed(1 << 20);
        let mut reads: Vec<(&mut [u8], u64)> = vec![(&mut tail, 15 << 20), (&mut more, 16 << 20)];
        assert!(dev.read_many(&mut reads).is_err());
    }

    #[test]
    fn write_many_writes_every_piece_where_asked() {
        let (_d, dev) = device();
        write_many_round_trip(&dev);
    }

    #[test]
    fn write_many_as_for_a_block_device_sends_the_whole_batch_direct() {
        let (_d, mut dev) = device();
        dev.batch_direct = BATCH_DIRECT_BDEV;
        write_many_round_trip(&dev);
        // Direct overwrites of blocks the host has cached (read buffered above) are
        // what later buffered reads see.
        let mut b = AlignedBuf::default();
        b.extend_from_slice(&pattern(64 << 10, 7));
        let small = pattern(4096, 9);
        dev.write_many(&[(&b[..], 4096), (&small, 128 << 10)])
            .unwrap();
        let mut got = vec![0u8; 128 << 10];
        dev.read_at(&mut got, 4096).unwrap();
        assert!(
            got[..64 << 10] == pattern(64 << 10, 7)[..],
            "the direct overwrite was lost"
        );
        assert!(
            got[(128 << 10) - 4096..] == small[..],
            "the small write was lost"
        );
    }

    /// A write gathered from small segments is judged by its whole length: 1 MiB of
    /// 64 KiB folio buffers goes direct, as one 1 MiB buffer would, where the same
    /// segments as separate small writes go through the host's cache.
    #[test]
    fn a_large_gathered_write_of_small_segments_goes_direct() {
        let (_d, dev) = device();
        let segs: Vec<AlignedBuf> = (0..16)
            .map(|k| {
                let mut b = AlignedBuf::default();
                b.extend_from_slice(&pattern(64 << 10, k as u8 + 1));
                b
            })
            .collect();
        let refs: Vec<&[u8]> = segs.iter().map(|b| &b[..]).collect();
        let apart: Vec<(&[u8], u64)> = refs
            .iter()
            .enumerate()
            .map(|(k, &b)| (b, (4 << 20) + ((k as u64) << 16)))
            .collect();
        dev.write_many(&apart).unwrap();
        let ring = || RING.with(|r| r.borrow().is_some());
        assert!(!ring(), "small separate writes went direct");
        dev.write_gathered(&[(&refs, 1 << 20)]).unwrap();
        if dev.direct.is_some() {
            assert!(ring(), "the gathered write did not go direct");
        }
        let want: Vec<u8> = refs.concat();
        for at in [1 << 20, 4 << 20] {
            let mut got = vec![0u8; 1 << 20];
            dev.read_at(&mut got, at).unwrap();
            assert!(got == want, "at {at}");
        }
    }

    #[test]
    fn write_many_past_the_end_is_enospc_and_writes_nothing() {
        let (_d, dev) = device();
        let mut b = AlignedBuf::default();
        b.extend_from_slice(&pattern(256 << 10, 3));
        let r = dev.write_many(&[(&b[..], 0), (&b[..], (16 << 20) - 4096)]);
        assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::ENOSPC));
        let mut got = vec![1u8; 256 << 10];
        dev.read_at(&mut got, 0).unwrap();
        assert!(got.iter().all(|&x| x == 0), "the batch was refused whole");
    }
}
