//! Item payloads. Fixed-size items are zerocopy structs; lists of names are
//! length-prefixed records.

use zerocopy::little_endian::{I64, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use super::Reader;

/// A timestamp with nanoseconds.
#[derive(
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
)]
#[repr(C)]
pub struct Timespec {
    /// Seconds since the epoch.
    pub sec: I64,
    /// Nanoseconds, below 1e9.
    pub nsec: U32,
}
const _: () = assert!(std::mem::size_of::<Timespec>() == 12);

impl Timespec {
    /// A timestamp from parts.
    pub fn new(sec: i64, nsec: u32) -> Timespec {
        Timespec {
            sec: sec.into(),
            nsec: nsec.into(),
        }
    }
    /// The current time, from the clock the kernel stamps inodes with.
    ///
    /// That is the coarse realtime clock (advanced once a tick), as for ext4 or
    /// XFS without fine-grained timestamps. With FUSE's writeback cache the kernel
    /// keeps a written file's mtime itself and sends it back (a SETATTR) when it
    /// changed, at fsync or writeback: a file created, written and fsynced within
    /// one tick then costs no SETATTR round trip, where the precise clock's
    /// creation time would always differ from the kernel's.
    pub fn now() -> Timespec {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid timespec for clock_gettime to fill.
        if unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut ts) } == 0 {
            Timespec::new(ts.tv_sec, ts.tv_nsec as u32)
        } else {
            Self::from_system(std::time::SystemTime::now())
        }
    }
    /// From a `SystemTime`, including times before the epoch.
    pub fn from_system(t: std::time::SystemTime) -> Timespec {
        match t.duration_since(std::time::UNIX_EPOCH) {
            Ok(d) => Timespec::new(d.as_secs() as i64, d.subsec_nanos()),
            Err(e) => {
                let d = e.duration();
                if d.subsec_nanos() == 0 {
                    Timespec::new(-(d.as_secs() as i64), 0)
                } else {
                    Timespec::new(-(d.as_secs() as i64) - 1, 1_000_000_000 - d.subsec_nanos())
                }
            }
        }
    }
    /// As a `SystemTime`.
    pub fn to_system(self) -> std::time::SystemTime {
        let s = self.sec.get();
        let n = self.nsec.get().min(999_999_999);
        if s >= 0 {
            std::time::UNIX_EPOCH + std::time::Duration::new(s as u64, n)
        } else {
            std::time::UNIX_EPOCH - std::time::Duration::new((-s) as u64, 0)
                + std::time::Duration::new(0, n)
        }
    }
}

/// Inode attributes (INODE_ITEM).
#[derive(
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
)]
#[repr(C)]
pub struct InodeItem {
    /// Generation that created the inode (FUSE generation number).
    pub generation: U64,
    /// Generation of the last change.
    pub transid: U64,
    /// File size in bytes.
    pub size: U64,
    /// Bytes of data extents referenced.
    pub nbytes: U64,
    /// Hard links (directories: 2 + subdirectories).
    pub nlink: U32,
    /// Owner.
    pub uid: U32,
    /// Group.
    pub gid: U32,
    /// Type and permission bits as in st_mode.
    pub mode: U32,
    /// Device number of a device node.
    pub rdev: U64,
    /// Inode flags ([`super::inode_flag`]).
    pub flags: U64,
    /// Next DIR_INDEX sequence number (directories).
    pub next_index: U64,
    /// Last access.
    pub atime: Timespec,
    /// Last data change.
    pub mtime: Timespec,
    /// Last attribute change.
    pub ctime: Timespec,
    /// Creation.
    pub crtime: Timespec,
}
const _: () = assert!(std::mem::size_of::<InodeItem>() == 120);

/// File extent kind: data on disk.
pub const FILE_EXTENT_REG: u8 = 0;
/// File extent kind: allocated by fallocate, reads as zeros.
pub const FILE_EXTENT_PREALLOC: u8 = 1;

/// A file extent (EXTENT_DATA): `num_bytes` of the file at the key's offset map to
/// `disk_bytenr + offset` in an extent of `disk_len` bytes.
#[derive(
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
)]
#[repr(C)]
pub struct FileExtent {
    /// Generation that wrote it.
    pub generation: U64,
    /// `FILE_EXTENT_REG` or `FILE_EXTENT_PREALLOC`.
    pub kind: u8,
    /// Zero.
    pub pad: [u8; 7],
    /// Start of the disk extent.
    pub disk_bytenr: U64,
    /// Length of the whole disk extent.
    pub disk_len: U64,
    /// Where in the disk extent this file range starts.
    pub offset: U64,
    /// Length of the file range.
    pub num_bytes: U64,
}
const _: () = assert!(std::mem::size_of::<FileExtent>() == 48);

impl FileExtent {
    /// Why this extent, at file offset `at`, is none birchfs writes (damage); `None`
    /// when it could be: whole blocks, at least one, within its disk extent, within
    /// the largest file (its last block whole) and the address space.
    pub fn flaw(&self, at: u64) -> Option<&'static str> {
        let (off, n) = (self.offset.get(), self.num_bytes.get());
        let (disk, len) = (self.disk_bytenr.get(), self.disk_len.get());
        if (at | off | n | disk | len) % super::BLOCK_SIZE != 0 {
            Some("not on block boundaries")
        } else if n == 0 || len == 0 {
            Some("of no blocks")
        } else if off.checked_add(n).is_none_or(|e| e > len) {
            Some("reaches past its disk extent")
        } else if at.checked_add(n).is_none_or(|e| e > super::FILE_END)
            || disk.checked_add(len).is_none()
        {
            Some("reaches past the largest file or address")
        } else {
            None
        }
    }
}

/// A tree root (ROOT_ITEM in the root tree).
#[derive(
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
)]
#[repr(C)]
pub struct RootItem {
    /// Address of the root node.
    pub bytenr: U64,
    /// Generation of the root node.
    pub generation: U64,
    /// Level of the root node.
    pub level: u8,
    /// Zero.
    pub pad: [u8; 7],
    /// `root_flag` bits.
    pub flags: U64,
}
const _: () = assert!(std::mem::size_of::<RootItem>() == 32);

/// Snapshot bookkeeping (SNAPSHOT_META in the root tree).
#[derive(
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
)]
#[repr(C)]
pub struct SnapshotMeta {
    /// Tree id the next snapshot gets.
    pub next_id: U64,
    /// Generation of the newest snapshot: fs-tree nodes of this generation or older
    /// may be shared.
    pub last_snapshot: U64,
}
const _: () = assert!(std::mem::size_of::<SnapshotMeta>() == 16);

/// A snapshot (SNAPSHOT item in the root tree, keyed by its tree id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotItem {
    /// Generation of the commit that took it.
    pub generation: u64,
    /// When it was taken.
    pub ctime: Timespec,
    /// Its name under `.snapshots`.
    pub name: Vec<u8>,
}

impl SnapshotItem {
    /// The item's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(22 + self.name.len());
        out.extend_from_slice(&self.generation.to_le_bytes());
        out.extend_from_slice(self.ctime.as_bytes());
        out.extend_from_slice(&(self.name.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.name);
        out
    }

    /// Parses an item; `None` when malformed.
    pub fn decode(b: &[u8]) -> Option<SnapshotItem> {
        let mut r = Reader::new(b);
        let generation = r.u64()?;
        let ctime = Timespec::read_from_bytes(r.bytes(12)?).ok()?;
        let n = r.u16()? as usize;
        let name = r.bytes(n)?.to_vec();
        if !r.is_empty() || name.is_empty() {
            return None;
        }
        Some(SnapshotItem {
            generation,
            ctime,
            name,
        })
    }
}

/// Extent is file data.
pub const EXTENT_FLAG_DATA: u64 = 1;
/// Extent is a tree node.
pub const EXTENT_FLAG_TREE: u64 = 2;

/// An allocated extent (EXTENT_ITEM keyed `(bytenr, EXTENT_ITEM, len)`).
#[derive(
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
)]
#[repr(C)]
pub struct ExtentItem {
    /// References to it.
    pub refs: U64,
    /// `EXTENT_FLAG_DATA` or `EXTENT_FLAG_TREE`.
    pub flags: U64,
    /// Generation that allocated it.
    pub generation: U64,
}
const _: () = assert!(std::mem::size_of::<ExtentItem>() == 24);

/// One directory entry, in a DIR_ITEM (list, by hash) or DIR_INDEX (one, by sequence).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    /// Inode the name points at.
    pub ino: u64,
    /// File type (DT_* value).
    pub dtype: u8,
    /// DIR_INDEX sequence of this entry.
    pub index: u64,
    /// The name.
    pub name: Vec<u8>,
}

/// Encodes a list of directory entries.
pub(crate) fn encode_dir_entries(entries: &[DirEntry]) -> Vec<u8> {
    let mut out = Vec::new();
    for e in entries {
        out.extend_from_slice(&e.ino.to_le_bytes());
        out.push(e.dtype);
        out.extend_from_slice(&e.index.to_le_bytes());
        out.extend_from_slice(&(e.name.len() as u16).to_le_bytes());
        out.extend_from_slice(&e.name);
    }
    out
}

/// Decodes a list of directory entries; `None` if malformed.
pub(crate) fn decode_dir_entries(buf: &[u8]) -> Option<Vec<DirEntry>> {
    let mut r = Reader::new(buf);
    let mut v = Vec::new();
    while !r.is_empty() {
        let ino = r.u64()?;
        let dtype = r.u8()?;
        let index = r.u64()?;
        let n = r.u16()? as usize;
        let name = r.bytes(n)?.to_vec();
        v.push(DirEntry {
            ino,
            dtype,
            index,
            name,
        });
    }
    Some(v)
}

/// One name of an inode in its parent (INODE_REF keyed `(ino, INODE_REF, parent)`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InodeRef {
    pub(crate) index: u64,
    pub(crate) name: Vec<u8>,
}

/// Appends a back-reference's index and name, as inode refs and extended refs
/// store them.
fn put_indexed_name(out: &mut Vec<u8>, index: u64, name: &[u8]) {
    out.extend_from_slice(&index.to_le_bytes());
    out.extend_from_slice(&(name.len() as u16).to_le_bytes());
    out.extend_from_slice(name);
}

/// Reads what [`put_indexed_name`] wrote.
fn get_indexed_name(r: &mut Reader<'_>) -> Option<(u64, Vec<u8>)> {
    let index = r.u64()?;
    let n = r.u16()? as usize;
    Some((index, r.bytes(n)?.to_vec()))
}

pub(crate) fn encode_inode_refs(refs: &[InodeRef]) -> Vec<u8> {
    let mut out = Vec::new();
    for r in refs {
        put_indexed_name(&mut out, r.index, &r.name);
    }
    out
}

pub(crate) fn decode_inode_refs(buf: &[u8]) -> Option<Vec<InodeRef>> {
    let mut r = Reader::new(buf);
    let mut v = Vec::new();
    while !r.is_empty() {
        let (index, name) = get_indexed_name(&mut r)?;
        v.push(InodeRef { index, name });
    }
    Some(v)
}

/// One name of an inode in a parent, kept in an INODE_EXTREF item keyed
/// `(ino, INODE_EXTREF, extref_hash(parent, name))`; names whose hashes collide share it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InodeExtref {
    pub(crate) parent: u64,
    pub(crate) index: u64,
    pub(crate) name: Vec<u8>,
}

pub(crate) fn encode_inode_extrefs(refs: &[InodeExtref]) -> Vec<u8> {
    let mut out = Vec::new();
    for r in refs {
        out.extend_from_slice(&r.parent.to_le_bytes());
        put_indexed_name(&mut out, r.index, &r.name);
    }
    out
}

pub(crate) fn decode_inode_extrefs(buf: &[u8]) -> Option<Vec<InodeExtref>> {
    let mut r = Reader::new(buf);
    let mut v = Vec::new();
    while !r.is_empty() {
        let parent = r.u64()?;
        let (index, name) = get_indexed_name(&mut r)?;
        v.push(InodeExtref {
            parent,
            index,
            name,
        });
    }
    Some(v)
}

/// One extended attribute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XattrEntry {
    /// Full name, e.g. `user.comment`.
    pub name: Vec<u8>,
    /// Value, when the entry holds it (empty when `chunks` is set).
    pub value: Vec<u8>,
    /// Where a value too large for the entry is: the key offset of its first
    /// XATTR_CHUNK item, and its length.
    pub chunks: Option<(u64, u32)>,
}

/// Flag in an entry's value length: the value is in XATTR_CHUNK items, and the
/// entry holds their base key offset instead.
const XATTR_CHUNKED: u32 = 1 << 31;

pub(crate) fn encode_xattrs(x: &[XattrEntry]) -> Vec<u8> {
    let mut out = Vec::new();
    for e in x {
        out.extend_from_slice(&(e.name.len() as u16).to_le_bytes());
        match e.chunks {
            Some((base, len)) => {
                out.extend_from_slice(&(len | XATTR_CHUNKED).to_le_bytes());
                out.extend_from_slice(&e.name);
                out.extend_from_slice(&base.to_le_bytes());
            }
            None => {
                out.extend_from_slice(&(e.value.len() as u32).to_le_bytes());
                out.extend_from_slice(&e.name);
                out.extend_from_slice(&e.value);
            }
        }
    }
    out
}

pub(crate) fn decode_xattrs(buf: &[u8]) -> Option<Vec<XattrEntry>> {
    let mut r = Reader::new(buf);
    let mut v = Vec::new();
    while !r.is_empty() {
        let n = r.u16()? as usize;
        let l = r.u32()?;
        let name = r.bytes(n)?.to_vec();
        if l & XATTR_CHUNKED != 0 {
            let base = r.u64()?;
            v.push(XattrEntry {
                name,
                value: Vec::new(),
                chunks: Some((base, l & !XATTR_CHUNKED)),
            });
        } else {
            let value = r.bytes(l as usize)?.to_vec();
            v.push(XattrEntry {
                name,
                value,
                chunks: None,
            });
        }
    }
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use zerocopy::FromBytes;

    #[test]
    fn lists_roundtrip_and_truncation_is_detected() {
        let d = vec![
            DirEntry {
                ino: 300,
                dtype: 8,
                index: 5,
                name: b"a".to_vec(),
            },
            DirEntry {
                ino: 301,
                dtype: 4,
                index: 6,
                name: vec![b'x'; 255],
            },
        ];
        let b = encode_dir_entries(&d);
        assert_eq!(decode_dir_entries(&b).unwrap(), d);
        assert!(decode_dir_entries(&b[..b.len() - 1]).is_none());
        let x = vec![
            XattrEntry {
                name: b"user.a".to_vec(),
                value: vec![1, 2],
                chunks: None,
            },
            XattrEntry {
                name: b"user.big".to_vec(),
                value: Vec::new(),
                chunks: Some((0xABCD_0000, 65536)),
            },
        ];
        let b = encode_xattrs(&x);
        assert_eq!(decode_xattrs(&b).unwrap(), x);
        assert!(decode_xattrs(&b[..b.len() - 1]).is_none());
        let r = vec![InodeRef {
            index: 9,
            name: b"n".to_vec(),
        }];
        assert_eq!(decode_inode_refs(&encode_inode_refs(&r)).unwrap(), r);
        let x = vec![
            InodeExtref {
                parent: 7,
                index: 3,
                name: b"a".to_vec(),
            },
            InodeExtref {
                parent: 1 << 40,
                index: u64::MAX,
                name: vec![b'z'; 255],
            },
        ];
        let enc = encode_inode_extrefs(&x);
        assert_eq!(decode_inode_extrefs(&enc).unwrap(), x);
        assert_eq!(decode_inode_extrefs(&enc[..enc.len() - 1]), None);
    }

    #[test]
    fn timespec_roundtrips_before_and_after_epoch() {
        for (s, n) in [(0i64, 0u32), (1_000_000_000, 123_456_789), (-5, 250)] {
            let t = Timespec::new(s, n);
            assert_eq!(Timespec::from_system(t.to_system()), t);
        }
        let i = InodeItem {
            size: 77.into(),
            ..Default::default()
        };
        let b = i.as_bytes().to_vec();
        assert_eq!(InodeItem::read_from_bytes(&b).unwrap(), i);
    }
}
