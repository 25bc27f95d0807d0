//! Which opens read past the kernel's page cache (`FOPEN_DIRECT_IO`).
//!
//! Through the kernel's page cache a read costs two copies: the daemon's reply into
//! page-cache pages the kernel has just allocated, then from those into the reader's
//! buffer. birchfs has a cache and readahead of its own, so a file streamed once
//! gains nothing from the first copy: a read-only open of a large file (mount option
//! `direct_read=`, by default the size of birchfs's cache) gets direct I/O, and each
//! read() becomes one request answered from birchfs's cache straight into the
//! reader's buffer, without filling the kernel's cache with a second copy of data
//! read once.
//!
//! The kernel's cache stays in charge of what it does better. Opens use it
//! - for a file that has been read through once by direct opens, so a file read
//!   again and again is cached by the kernel as on any filesystem;
//! - for a file whose direct reads came in small pieces out of order (a database's
//!   pages), which the kernel answers from memory without a round trip;
//! - for a file opened for writing, or opened to be executed;
//! - always, when the kernel cannot flush a writer's cached pages before a direct
//!   read (it did not agree to `FUSE_DIRECT_IO_ALLOW_MMAP` at INIT).
//!
//! An inode's open handles are all direct or all cached: an open while others are
//! open takes their kind, a writer's too. Mixed, a cached writer could extend the file
//! in the kernel's cache with a gap before its new data, and a direct read of the gap
//! would end at the size birchfs knows (the kernel writes back only the dirty pages of
//! the range a direct read asks for). The kernel does not move the mtime for a direct
//! writer's writes, so when such a file's last handle closes, the daemon has the
//! kernel drop the inode, whose next lookup takes birchfs's mtime. Otherwise
//! correctness does not rest on this bookkeeping: with `FUSE_DIRECT_IO_ALLOW_MMAP` the
//! kernel writes back a range's dirty cached pages (a shared mapping's too) before a
//! direct read of it, and on close a handle's. An entry goes when the kernel forgets
//! the inode, or when its last handle closes and it is small or nothing is known of
//! it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

/// The file handle of an open that reads past the kernel's page cache (others are 0).
pub(crate) const DIRECT_FH: u64 = 1;

/// `__FMODE_EXEC`: the open flag of a file opened to be executed.
const FMODE_EXEC: i32 = 0x20;

/// Reads shorter than this that do not continue the previous one count as scattered.
const SMALL_READ: u64 = 128 << 10;

/// Scattered reads after which a file's later opens use the kernel's cache.
const SCATTERED_MAX: u32 = 16;

/// Whether an open with `flags` may change the file (for writing, or truncating).
pub(crate) fn opens_to_write(flags: i32) -> bool {
    flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0
}

/// How a file's opens read, once none of its handles is open.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// As the size and open flags say (nothing is known of it).
    Fresh,
    /// Past the kernel's cache, with what those reads have done so far.
    Direct {
        /// The file's size when it was last opened.
        size: u64,
        /// Bytes read through direct opens.
        read: u64,
        /// Where the last direct read ended.
        next: u64,
        /// Small reads that did not continue the one before.
        scattered: u32,
    },
    /// Through the kernel's cache.
    Cached,
}

/// What is known of one inode.
#[derive(Clone, Copy, Debug)]
struct Entry {
    mode: Mode,
    /// Handles open now, direct and cached (one of them is 0).
    direct: u32,
    cached: u32,
    /// Whether it was at least the direct-read size at an open. Small files are
    /// forgotten when their last handle closes (the kernel wrote back what it held
    /// of them on close), so that the map does not grow with every file written.
    large: bool,
    /// A handle open for writing wrote past the kernel's cache since the file's
    /// handles were last all closed.
    direct_writer: bool,
}

impl Entry {
    /// Nothing known, no handle open.
    fn new() -> Entry {
        Entry {
            mode: Mode::Fresh,
            direct: 0,
            cached: 0,
            large: false,
            direct_writer: false,
        }
    }
}

/// The per-file choice between direct and cached reads (see the module docs).
#[derive(Default)]
pub(crate) struct DirectReads {
    /// Smallest file that a read-only open reads directly; `None`: never.
    min_size: Option<u64>,
    /// Set at INIT when the kernel agreed to `FUSE_DIRECT_IO_ALLOW_MMAP`.
    agreed: AtomicBool,
    files: Mutex<HashMap<u64, Entry>>,
}

impl DirectReads {
    /// Direct reads for read-only opens of files of at least `min_size` bytes; `None`
    /// turns them off.
    pub(crate) fn new(min_size: Option<u64>) -> DirectReads {
        DirectReads {
            min_size,
            ..Default::default()
        }
    }

    /// Records whether the kernel agreed to keep direct reads coherent.
    pub(crate) fn set_agreed(&self, on: bool) {
        self.agreed.store(on, Ordering::SeqCst);
    }

    /// Whether direct reads are configured (the kernel's agreement aside).
    pub(crate) fn enabled_by_config(&self) -> bool {
        self.min_size.is_some()
    }

    /// Whether direct reads can be given at all (configured and agreed).
    pub(crate) fn enabled(&self) -> bool {
        self.min_size.is_some() && self.agreed.load(Ordering::SeqCst)
    }

    /// Opens a handle of `ino` (a regular file of `size` bytes) with open `flags`;
    /// returns its file handle, [`DIRECT_FH`] when it reads past the kernel's cache.
    /// Each handle is closed with [`DirectReads::release`].
    pub(crate) fn open(&self, ino: u64, flags: i32, size: u64) -> u64 {
        let Some(min) = self.min_size.filter(|_| self.enabled()) else {
            return 0;
        };
        // Such an open leaves the file's pages in the kernel's cache.
        let caches = opens_to_write(flags) || flags & FMODE_EXEC != 0;
        let mut files = self.files.lock();
        let e = files.entry(ino).or_insert_with(Entry::new);
        e.large |= size >= min;
        let direct = if e.direct > 0 {
            true
        } else if e.cached > 0 || caches {
            false
        } else {
            match &mut e.mode {
                Mode::Fresh => size >= min,
                Mode::Cached => false,
                Mode::Direct {
                    size: was,
                    read,
                    scattered,
                    ..
                } => {
                    if *read >= (*was).max(1) || *scattered >= SCATTERED_MAX {
                        false
                    } else {
                        *was = size;
                        true
                    }
                }
            }
        };
        if caches || !direct && e.mode != Mode::Fresh {
            // Its pages may sit in the kernel's cache from now on.
            e.mode = Mode::Cached;
        } else if direct && e.mode == Mode::Fresh {
            e.mode = Mode::Direct {
                size,
                read: 0,
                next: 0,
                scattered: 0,
            };
        }
        if direct {
            e.direct += 1;
            e.direct_writer |= opens_to_write(flags);
            DIRECT_FH
        } else {
            e.cached += 1;
            0
        }
    }

    /// Counts the handle (cached) that creating `ino` opened.
    pub(crate) fn created(&self, ino: u64) {
        if !self.enabled() {
            return;
        }
        let mut files = self.files.lock();
        let e = files.entry(ino).or_insert_with(Entry::new);
        e.mode = Mode::Cached;
        e.cached += 1;
    }

    /// Closes a handle that [`DirectReads::open`] gave out (or a created file's, 0).
    /// Returns whether that was the last handle and a writer among them wrote past the
    /// kernel's cache: the kernel's mtime of the file is then stale (with the
    /// writeback cache on it keeps the mtime itself and does not move it for such
    /// writes) until the inode leaves its cache.
    pub(crate) fn release(&self, ino: u64, fh: u64) -> bool {
        let mut files = self.files.lock();
        let Some(e) = files.get_mut(&ino) else {
            return false;
        };
        let n = if fh == DIRECT_FH {
            &mut e.direct
        } else {
            &mut e.cached
        };
        *n = n.saturating_sub(1);
        let last = e.direct == 0 && e.cached == 0;
        let stale = last && std::mem::take(&mut e.direct_writer);
        if last && (e.mode == Mode::Fresh || !e.large) {
            files.remove(&ino);
        }
        stale
    }

    /// Notes a read of `len` bytes at `offset` of `ino` through handle `fh`.
    pub(crate) fn read(&self, ino: u64, fh: u64, offset: u64, len: u64) {
        if fh != DIRECT_FH {
            return;
        }
        if let Some(Entry {
            mode:
                Mode::Direct {
                    read,
                    next,
                    scattered,
                    ..
                },
            ..
        }) = self.files.lock().get_mut(&ino)
        {
            *read += len;
            if offset != *next && len < SMALL_READ {
                *scattered += 1;
            }
            *next = offset + len;
        }
    }

    /// Handles open now that read past the kernel's cache.
    pub(crate) fn open_direct(&self) -> u64 {
        self.files
            .lock()
            .values()
            .map(|e| u64::from(e.direct))
            .sum()
    }

    /// Drops what is known of `ino` (the kernel forgot it, and its cached pages).
    pub(crate) fn forget(&self, ino: u64) {
        self.files.lock().remove(&ino);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1 << 20;
    const RO: i32 = libc::O_RDONLY;

    fn on() -> DirectReads {
        let d = DirectReads::new(Some(64 * MB));
        d.set_agreed(true);
        d
    }

    /// Opens and closes at once: whether that open was direct.
    fn once(d: &DirectReads, ino: u64, flags: i32, size: u64) -> bool {
        let fh = d.open(ino, flags, size);
        d.release(ino, fh);
        fh == DIRECT_FH
    }

    #[test]
    fn only_read_only_opens_of_large_files_read_directly() {
        let d = on();
        assert!(once(&d, 1, RO, 64 * MB));
        assert!(!once(&d, 2, RO, 64 * MB - 1), "below the size");
        assert!(!once(&d, 3, libc::O_RDWR, 100 * MB), "opened for writing");
        assert!(!once(&d, 4, libc::O_WRONLY, 100 * MB));
        assert!(!once(&d, 5, RO | libc::O_TRUNC, 100 * MB));
        assert!(!once(&d, 6, RO | FMODE_EXEC, 100 * MB), "exec");
        // Only large files seen so far, or open, are tracked.
        assert!(d.files.lock().get(&2).is_none());
        let w = d.open(7, libc::O_RDWR, 0);
        d.created(8);
        assert_eq!(d.files.lock().len(), 7);
        d.release(7, w);
        d.release(8, 0);
        assert_eq!(d.files.lock().len(), 5, "closed small files are kept");
    }

    #[test]
    fn nothing_is_direct_when_off_or_not_agreed_by_the_kernel() {
        let off = DirectReads::new(None);
        off.set_agreed(true);
        assert!(!once(&off, 1, RO, 1 << 40));
        let unagreed = DirectReads::new(Some(MB));
        assert!(!once(&unagreed, 1, RO, 1 << 40));
        assert!(!unagreed.enabled());
    }

    #[test]
    fn a_file_read_through_once_is_cached_by_the_kernel_afterwards() {
        let d = on();
        let fh = d.open(1, RO, 100 * MB);
        assert_eq!(fh, DIRECT_FH);
        for k in 0..99 {
            d.read(1, fh, k * MB, MB);
        }
        d.release(1, fh);
        assert!(once(&d, 1, RO, 100 * MB), "not read through yet");
        d.read(1, DIRECT_FH, 99 * MB, MB);
        assert!(
            !once(&d, 1, RO, 100 * MB),
            "read through: the kernel caches it"
        );
        assert!(!once(&d, 1, RO, 100 * MB), "and keeps doing so");
    }

    #[test]
    fn reads_of_cached_handles_do_not_count() {
        let d = on();
        assert!(once(&d, 1, RO, 100 * MB));
        d.read(1, 0, 0, 100 * MB);
        assert!(once(&d, 1, RO, 100 * MB));
    }

    #[test]
    fn scattered_small_reads_send_later_opens_to_the_kernel_cache() {
        let d = on();
        assert!(once(&d, 1, RO, 1000 * MB));
        for k in 1..=u64::from(SCATTERED_MAX) {
            d.read(1, DIRECT_FH, (k * 37 % 997) * MB, 4096);
        }
        assert!(!once(&d, 1, RO, 1000 * MB));
        // Large reads out of order (several streams) are not scattered.
        assert!(once(&d, 2, RO, 1000 * MB));
        for k in 0..64u64 {
            d.read(2, DIRECT_FH, (k * 37 % 997) * MB, MB);
        }
        assert!(once(&d, 2, RO, 1000 * MB));
    }

    #[test]
    fn a_write_open_of_a_large_file_keeps_it_in_the_kernel_cache() {
        let d = on();
        assert!(!once(&d, 1, libc::O_RDWR, 100 * MB));
        assert!(!once(&d, 1, RO, 100 * MB));
        // Also after direct opens of it.
        assert!(once(&d, 2, RO, 100 * MB));
        assert!(!once(&d, 2, libc::O_WRONLY, 100 * MB));
        assert!(!once(&d, 2, RO, 100 * MB));
    }

    #[test]
    fn open_handles_are_all_direct_or_all_cached() {
        let d = on();
        // A writer opened while a direct reader is open is direct too; afterwards
        // the file is the kernel's to cache.
        let r = d.open(1, RO, 100 * MB);
        assert_eq!(r, DIRECT_FH);
        let w = d.open(1, libc::O_RDWR, 100 * MB);
        assert_eq!(w, DIRECT_FH, "writer beside a direct reader");
        assert_eq!(d.open_direct(), 2);
        assert!(!d.release(1, r), "the writer is still open");
        assert_eq!(
            d.open(1, RO, 100 * MB),
            DIRECT_FH,
            "the writer is still open"
        );
        assert!(!d.release(1, DIRECT_FH));
        assert!(d.release(1, w), "the last close after a direct writer");
        assert!(!once(&d, 1, RO, 100 * MB));
        assert!(!once(&d, 1, libc::O_RDWR, 100 * MB), "a cached writer");
        // A reader opened while a cached handle (a small file's writer, the file
        // since grown) is open is cached, whatever the size.
        let w = d.open(2, libc::O_WRONLY, 0);
        assert_eq!(w, 0);
        assert!(!once(&d, 2, RO, 100 * MB), "reader beside a cached writer");
        d.release(2, w);
        // A created file's handle counts as cached.
        d.created(3);
        assert!(!once(&d, 3, RO, 100 * MB));
        d.release(3, 0);
    }

    #[test]
    fn forgetting_an_inode_starts_it_over() {
        let d = on();
        assert!(!once(&d, 1, libc::O_RDWR, 100 * MB));
        d.forget(1);
        assert!(once(&d, 1, RO, 100 * MB));
    }
}
