//! On-disk format v1: constants, keys, superblock, nodes and items.
//!
//! ```text
//! device byte offset
//! 0        64K        68K        1M                1M+log_len            ...  64M (copy 2)  ...
//! | unused | SUPER #0 | unused   | LOG AREA        | allocatable: tree nodes and data extents |
//! ```
//! A log area larger than the 63 MiB below the second copy (devices over 2 GiB) starts
//! at 64M+64K instead ([`LOG_START_HIGH`]), and 1M..64M+64K stays unused.
//! Superblock copies live at 64 KiB, 64 MiB and 256 GiB where the device reaches
//! them; those 4 KiB blocks are never allocated. Integers are little-endian.

mod item;
mod key;
mod node;
mod superblock;

pub(crate) use item::{
    decode_dir_entries, decode_inode_extrefs, decode_inode_refs, decode_xattrs, encode_dir_entries,
    encode_inode_extrefs, encode_inode_refs, encode_xattrs, InodeExtref, InodeRef,
};
pub use item::{
    DirEntry, ExtentItem, FileExtent, InodeItem, RootItem, Timespec, XattrEntry, EXTENT_FLAG_DATA,
    EXTENT_FLAG_TREE, FILE_EXTENT_PREALLOC, FILE_EXTENT_REG,
};
pub use item::{SnapshotItem, SnapshotMeta};
pub use key::Key;
pub use node::{decode_node, encode_node, NodeBody, NodeHeader, NODE_HEADER_SIZE};
pub(crate) use node::{leaf_item_size, PTR_SIZE};
pub use superblock::{Superblock, SUPER_SIZE};

/// Size of a data block and of a sector.
pub const BLOCK_SIZE: u64 = 4096;
/// Default B-tree node size.
pub const DEFAULT_NODE_SIZE: u32 = 16384;
/// Magic at the start of every superblock.
pub const MAGIC: [u8; 8] = *b"BIRCHFS1";
/// Offsets of the superblock copies.
pub const SUPER_OFFSETS: [u64; 3] = [64 << 10, 64 << 20, 256 << 30];
/// Where the log area starts.
pub const LOG_START: u64 = 1 << 20;
/// Where a log area too large for the room below the second superblock copy starts:
/// just past that copy (what lies before it stays unused).
pub const LOG_START_HIGH: u64 = SUPER_OFFSETS[1] + (64 << 10);
/// Largest log area.
pub const LOG_MAX: u64 = 512 << 20;
/// Largest log area of an image without [`INCOMPAT_LARGE_LOG`].
pub const LOG_MAX_PLAIN: u64 = 256 << 20;
/// Smallest device mkfs accepts.
pub const MIN_DEVICE_SIZE: u64 = 32 << 20;
/// Longest name in a directory.
pub const NAME_MAX: usize = 255;
/// Longest symlink target.
pub const SYMLINK_MAX: usize = 4095;
/// Largest item payload; two always fit in a node, so a split always succeeds.
pub const MAX_ITEM_SIZE: usize = 7000;
/// Largest data extent written at once (its checksum item is 4 bytes per block).
pub const MAX_EXTENT_SIZE: u64 = 1 << 20;
/// Largest preallocated data extent, as btrfs's: it has no checksums until written,
/// and each piece then written in place gets its own item of at most
/// [`MAX_EXTENT_SIZE`]'s blocks.
pub const MAX_PREALLOC_SIZE: u64 = 128 << 20;
/// Largest file size: the kernel's own for FUSE (and btrfs's), `MAX_LFS_FILESIZE`, so
/// that every write the kernel takes into its cache can be stored.
pub const MAX_FILE_SIZE: u64 = i64::MAX as u64;
/// Where the last block a file may have ends: [`MAX_FILE_SIZE`] rounded up to a block
/// (a write of the last bytes maps that block whole).
pub const FILE_END: u64 = MAX_FILE_SIZE.next_multiple_of(BLOCK_SIZE);

/// Incompatible feature flags this build understands; any other bit refuses the image.
pub const INCOMPAT_SUPPORTED: u64 = INCOMPAT_BASE
    | INCOMPAT_LOG_RING
    | INCOMPAT_CSUM_PIECES
    | INCOMPAT_XATTR_CHUNKS
    | INCOMPAT_EXTREF
    | INCOMPAT_LARGE_LOG;
/// Base v1 format: CoW trees, extent refcounts, crc32c checksums, reserved log area.
pub const INCOMPAT_BASE: u64 = 1;
/// The log area is a ring: a generation's batches start at the superblock's
/// `log_head`, and a batch flagged as closing its generation is followed by the next
/// generation's (see `log`).
pub const INCOMPAT_LOG_RING: u64 = 2;
/// A data extent's checksums may be split over several items, each keyed by the
/// address of its first block: a preallocated extent written in place gets one per
/// piece written; and preallocated extents may be up to [`MAX_PREALLOC_SIZE`]. Set
/// by every commit, so an older build never reads such an image.
pub const INCOMPAT_CSUM_PIECES: u64 = 4;
/// An xattr value too large for its XATTR_ITEM is stored in XATTR_CHUNK items, and
/// its entry names them. Set when the first such value is written.
pub const INCOMPAT_XATTR_CHUNKS: u64 = 8;
/// Names of an inode that do not fit its INODE_REF item for a directory are in
/// INODE_EXTREF items. Set when the first such name is made.
pub const INCOMPAT_EXTREF: u64 = 16;
/// The log area is over [`LOG_MAX_PLAIN`], up to [`LOG_MAX`]. Set by mkfs when it
/// makes such a log, so that a build that allowed only the smaller log says the image
/// uses a feature it lacks, not that the superblock is damaged.
pub const INCOMPAT_LARGE_LOG: u64 = 32;
/// Largest xattr value, as Linux limits it (`XATTR_SIZE_MAX`).
pub const XATTR_SIZE_MAX: usize = 65536;

/// Tree ids (objectids of ROOT_ITEMs in the root tree).
pub mod tree {
    /// Holds a ROOT_ITEM per other tree.
    pub const ROOT: u64 = 1;
    /// Extent refcounts, for data and tree nodes.
    pub const EXTENT: u64 = 2;
    /// The default subvolume's files.
    pub const FS: u64 = 5;
    /// crc32c of data blocks, keyed by extent address.
    pub const CSUM: u64 = 7;
}

/// Key types, ordered as btrfs orders them.
pub mod kind {
    /// Inode attributes.
    pub const INODE_ITEM: u8 = 1;
    /// Names an inode goes by, keyed by parent.
    pub const INODE_REF: u8 = 12;
    /// Names an inode goes by beyond what its INODE_REF for a parent holds, keyed by
    /// [`extref_hash`](super::extref_hash) of parent and name.
    pub const INODE_EXTREF: u8 = 13;
    /// Extended attributes, keyed by name hash.
    pub const XATTR_ITEM: u8 = 24;
    /// A piece of an xattr value too large for its XATTR_ITEM, keyed by the base
    /// its entry names plus the piece's index.
    pub const XATTR_CHUNK: u8 = 25;
    /// An inode to free at mount.
    pub const ORPHAN_ITEM: u8 = 48;
    /// Directory entries keyed by name hash.
    pub const DIR_ITEM: u8 = 84;
    /// Directory entries keyed by insertion sequence (readdir order).
    pub const DIR_INDEX: u8 = 96;
    /// A symlink's target.
    pub const SYMLINK: u8 = 100;
    /// A file extent (file offset -> disk extent).
    pub const EXTENT_DATA: u8 = 108;
    /// Data checksums of one extent.
    pub const EXTENT_CSUM: u8 = 128;
    /// A tree root.
    pub const ROOT_ITEM: u8 = 132;
    /// How far the background drop of a deleted snapshot got (root tree, by tree id).
    pub const DROP_PROGRESS: u8 = 134;
    /// Snapshot bookkeeping: the next tree id and the newest snapshot's generation.
    pub const SNAPSHOT_META: u8 = 139;
    /// A snapshot's name and creation (root tree, keyed by its tree id).
    pub const SNAPSHOT: u8 = 140;
    /// An allocated extent with its refcount.
    pub const EXTENT_ITEM: u8 = 168;
}

/// Object ids with fixed meaning.
pub mod objectid {
    /// The root directory of a subvolume.
    pub const ROOT_DIR: u64 = 256;
    /// First inode number handed out after the root.
    pub const FIRST_FREE: u64 = 257;
    /// Holds ORPHAN_ITEMs.
    pub const ORPHAN: u64 = u64::MAX - 4;
    /// Holds EXTENT_CSUM items.
    pub const CSUM: u64 = u64::MAX - 9;
    /// Inode numbers are below this.
    pub const LAST_INODE: u64 = u64::MAX - 256;
    /// Holds SNAPSHOT and SNAPSHOT_META items in the root tree.
    pub const SNAPSHOTS: u64 = u64::MAX - 12;
    /// Tree id of the first snapshot; later ones count up and are never reused.
    pub const FIRST_SNAPSHOT: u64 = 256;
}

/// INODE_ITEM flags: the bits `chattr` sets, with the values of Linux's `FS_*_FL`.
pub mod inode_flag {
    /// Nothing may change the inode, its data or its names (`chattr +i`).
    pub const IMMUTABLE: u64 = 0x10;
    /// Data may only be appended; no truncate, rename or unlink (`chattr +a`).
    pub const APPEND: u64 = 0x20;
    /// dump(8) skips the file (`chattr +d`); birchfs only keeps the bit.
    pub const NODUMP: u64 = 0x40;
    /// Reads do not update the access time (`chattr +A`); a FUSE read never does.
    pub const NOATIME: u64 = 0x80;
    /// Every bit an inode may have.
    pub const KNOWN: u64 = IMMUTABLE | APPEND | NODUMP | NOATIME;
}

/// ROOT_ITEM flags.
pub mod root_flag {
    /// A read-only snapshot.
    pub const RDONLY: u64 = 1;
    /// A deleted snapshot whose nodes are being freed in the background.
    pub const DEAD: u64 = 2;
}

/// crc32c as every checksum in the format uses it.
///
/// Computed with crc-fast, which folds with VPCLMULQDQ where the CPU has it (2.2-2.4x
/// the crc32c crate on 4 KiB blocks and 16 KiB nodes on the benchmark machine,
/// `cargo bench --bench csum`); every data block read or written is summed, so this
/// is on the hot path of streaming I/O. The value is the same CRC-32C (iSCSI) either
/// way; a unit test holds the two crates to it.
pub fn csum(data: &[u8]) -> u32 {
    crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, data) as u32
}

/// 64-bit hash of a name, the offset of its DIR_ITEM and XATTR_ITEM.
pub fn name_hash(name: &[u8]) -> u64 {
    let hi = crc32c::crc32c_append(!0, name) as u64;
    let lo = crc32c::crc32c_append(0x9e37_79b9, name) as u64;
    (hi << 32) | lo
}

/// 64-bit hash of a parent and a name, the offset of an INODE_EXTREF.
pub fn extref_hash(parent: u64, name: &[u8]) -> u64 {
    let mut b = Vec::with_capacity(8 + name.len());
    b.extend_from_slice(&parent.to_le_bytes());
    b.extend_from_slice(name);
    name_hash(&b)
}

/// Little-endian readers over a byte slice, returning `None` past the end.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf }
    }
    pub(crate) fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
    pub(crate) fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.buf.len() < n {
            return None;
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Some(a)
    }
    pub(crate) fn u8(&mut self) -> Option<u8> {
        self.bytes(1).map(|b| b[0])
    }
    pub(crate) fn u16(&mut self) -> Option<u16> {
        self.bytes(2).map(|b| u16::from_le_bytes([b[0], b[1]]))
    }
    pub(crate) fn u32(&mut self) -> Option<u32> {
        self.bytes(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
    }
    pub(crate) fn u64(&mut self) -> Option<u64> {
        self.bytes(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csum_is_crc32c_at_every_length_and_alignment() {
        // The format's checksum is CRC-32C; images written with the crc32c crate
        // must verify with whatever computes `csum` now, and the other way round.
        let data: Vec<u8> = (0..20_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for start in 0..9 {
            for len in (0..300).chain([4095, 4096, 4097, 16_384, 19_000]) {
                let d = &data[start..start + len];
                assert_eq!(csum(d), crc32c::crc32c(d), "start {start} len {len}");
            }
        }
        // The standard check value of CRC-32C.
        assert_eq!(csum(b"123456789"), 0xe306_9283);
    }
}
