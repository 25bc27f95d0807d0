//! Tree keys: `(objectid, type, offset)` in lexicographic order.

use std::fmt;

/// A B-tree key; 17 bytes on disk.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Key {
    /// The object (inode number, extent address, tree id).
    pub objectid: u64,
    /// The item type (`format::kind`).
    pub ty: u8,
    /// Type-specific (file offset, name hash, parent inode, ...).
    pub offset: u64,
}

impl Key {
    /// Bytes a key takes on disk.
    pub const SIZE: usize = 17;
    /// The smallest key.
    pub const MIN: Key = Key::new(0, 0, 0);
    /// The largest key.
    pub const MAX: Key = Key::new(u64::MAX, u8::MAX, u64::MAX);

    /// A key from its parts.
    pub const fn new(objectid: u64, ty: u8, offset: u64) -> Key {
        Key {
            objectid,
            ty,
            offset,
        }
    }

    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.objectid.to_le_bytes());
        out.push(self.ty);
        out.extend_from_slice(&self.offset.to_le_bytes());
    }

    pub(crate) fn decode(r: &mut super::Reader<'_>) -> Option<Key> {
        Some(Key::new(r.u64()?, r.u8()?, r.u64()?))
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({} {} {})", self.objectid, self.ty, self.offset)
    }
}
