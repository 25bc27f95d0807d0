//! `birchfs restore`: copies the files of an image into a directory, reading through
//! the format layer alone, so that an image whose damaged nodes keep it from
//! mounting still gives back everything that is readable.
//!
//! The trees are walked from their roots as a mount would. A node that cannot be
//! trusted (checksum, address, level, owner or generation wrong) is stood in for by
//! leaves of its tree that a scan of the device finds intact, none newer than the
//! parent says the node was, and only for the keys the node covered: newest first,
//! each leaf taken whole unless its keys overlap those of a leaf taken before. For a
//! lost internal node these are the leaves the extent tree counts as in use (its own
//! leaves, when only the node above them was lost), and those newer than what a
//! damaged extent tree, itself stood in for, can tell about; for a lost leaf, which was the
//! only live holder of its keys, they are older copies (a snapshot's, or one a commit
//! freed and nothing overwrote), and the report says so. When the root tree is
//! damaged the other trees are rebuilt from their newest leaves in the same way. A
//! block inside a data extent is never taken for a leaf: it is file data, perhaps
//! made to look like one.
//!
//! Names come from directory indexes, then directory items, then the names inodes
//! keep of themselves (inode refs), so a file whose entry was lost keeps its name when
//! its ref survived; an inode nothing names goes to `lost+found/#INO`. Data blocks are
//! checked against the checksum tree; a block that fails is written as read and its
//! file is listed. The fsyncs since the last commit are replayed from the log on top
//! of it, as a mount does (not for a snapshot, which the log never changes).
//!
//! Trouble cases: with snapshots, the leaves in use include a snapshot's own older
//! leaves, so a stand-in for a lost internal node of the live tree can bring back,
//! from a snapshot, files deleted since where the live tree kept no key near them.
//! Everything is created under DEST by name, each directory made by restore itself,
//! and `lost+found` is used only when it is a real directory, so no path goes through
//! a symlink the image holds.

mod at;
mod namespace;
mod reader;
mod writer;

use std::path::Path;

use crate::dev::BlockDev;
use crate::error::Result;

use reader::read_image;
pub use writer::unfit_dest;
use writer::{make_dest, Writer};

/// What to restore.
#[derive(Debug, Clone, Default)]
pub struct RestoreOptions {
    /// Restore this snapshot instead of the live tree.
    pub snapshot: Option<Vec<u8>>,
}

/// What restore did and what it could not do.
#[derive(Debug, Default)]
pub struct Restored {
    /// One line per thing damaged, lost or not restored; empty for a clean image.
    pub problems: Vec<String>,
    /// Directories made (the destination itself not counted).
    pub dirs: u64,
    /// Regular files written (each inode once).
    pub files: u64,
    /// Symbolic links made.
    pub symlinks: u64,
    /// Device nodes, FIFOs and sockets made.
    pub specials: u64,
    /// Further names of files already written.
    pub hard_links: u64,
    /// Bytes of file data written.
    pub bytes: u64,
    /// Inodes put into `lost+found` because nothing readable names them.
    pub lost_found: u64,
    /// Damaged tree nodes stood in for by scanned leaves (or lost).
    pub damaged_nodes: u64,
    /// Data blocks written that failed their checksum.
    pub bad_blocks: u64,
    /// Data blocks written with no checksum left to check them against.
    pub unverified_blocks: u64,
    /// Owners, permissions, times and extended attributes the destination refused.
    pub attrs_refused: u64,
    /// Fsynced log batches after the last commit, replayed on top of it.
    pub log_batches: usize,
}

impl Restored {
    /// One line of totals.
    pub fn summary(&self) -> String {
        format!(
            "{} problems; {} directories, {} files ({} bytes), {} symlinks, {} special files, \
             {} hard links restored; {} in lost+found; {} damaged tree nodes, {} data blocks \
             failing their checksum",
            self.problems.len(),
            self.dirs,
            self.files,
            self.bytes,
            self.symlinks,
            self.specials,
            self.hard_links,
            self.lost_found,
            self.damaged_nodes,
            self.bad_blocks
        )
    }

    pub(super) fn problem(&mut self, s: String) {
        if self.problems.len() < 100_000 {
            self.problems.push(s);
        }
    }
}

/// Copies the files of the image on `dev` into `dest` (created, or empty); `Err`
/// only when the image has no readable superblock, the snapshot asked for does not
/// exist, or `dest` cannot be made.
pub fn restore(dev: &dyn BlockDev, dest: &Path, opts: &RestoreOptions) -> Result<Restored> {
    let img = read_image(dev, opts)?;
    make_dest(dest)?;
    let mut w = Writer::new(dev, img.total_bytes, &img.ns, &img.csums, img.rep);
    w.run(dest);
    Ok(w.rep)
}

#[cfg(test)]
mod tests;
