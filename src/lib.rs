//! birchfs: a copy-on-write, checksummed filesystem in user space, mounted through
//! FUSE or embedded as a library over an image file or a block device.
//!
//! ```no_run
//! use birchfs::{Fs, Options, Creds, ROOT_INO};
//! let fs = Fs::open_path("disk.img".as_ref(), Options::default()).unwrap();
//! let f = fs.mknod(ROOT_INO, b"hello", 0o644, 0, Creds::default()).unwrap();
//! fs.write(f.ino, 0, b"hi").unwrap();
//! fs.fsync(f.ino, false).unwrap();
//! ```

#![warn(missing_docs)]

mod alloc;
mod btree;
mod cache;
pub mod check;
pub mod dev;
pub mod dump;
mod error;
pub mod extent_map;
pub mod format;
mod fs;
pub mod fuse;
mod log;
pub mod refs;
pub mod restore;
pub mod skiplist;
mod stats;
mod txn;

pub use cache::{
    default_cache_size, memory_limit_room, usable_memory, CacheOptions, MemoryPressure,
};
pub use error::{Error, Result};
pub use fs::{
    check_snapshot_name, is_snapshot_ino, Attr, Creds, DirEntryOut, ExtentInfo, FallocMode,
    FileKind, Fs, MkfsOptions, Options, RenameFlags, SetAttr, SnapshotInfo, SpaceUsage, StatFs,
    TimeSet, INODES_PER_BLOCK, ROOT_INO, SNAPSHOTS_INO, SNAPSHOTS_NAME,
};
pub use stats::{Histogram, LatencySummary, Stats, StatsSnapshot};
pub use txn::log_area_sized;
