//! The superblock: where every mount starts.
//!
//! ```text
//! 0    4      12          20          28    44         52          60          68
//! |csum|magic |incompat   |compat     |fsid |generation|own_addr   |total_bytes|
//! 68        72        76         84         85  92          100       108
//! |blocksize|nodesize |root_tree |root_level|pad|log_start  |log_len  |bytes_used|
//! 116       124
//! |log_head |
//! ```
//! `log_head` (where in the log area the next generation's batches start) is read
//! as 0 from images written before it existed; writing it sets `INCOMPAT_LOG_RING`.
//! crc32c covers bytes 4..4096 of the 4 KiB superblock block.

use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use super::{csum, INCOMPAT_SUPPORTED, MAGIC};
use crate::error::{Error, Result};

/// Bytes a superblock copy occupies.
pub const SUPER_SIZE: usize = 4096;

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy)]
#[repr(C)]
struct SuperDisk {
    csum: U32,
    magic: [u8; 8],
    incompat: U64,
    compat: U64,
    fsid: [u8; 16],
    generation: U64,
    own_addr: U64,
    total_bytes: U64,
    block_size: U32,
    node_size: U32,
    root_tree: U64,
    root_level: u8,
    pad: [u8; 7],
    log_start: U64,
    log_len: U64,
    bytes_used: U64,
    log_head: U64,
}
const _: () = assert!(std::mem::size_of::<SuperDisk>() == 124);

/// The decoded superblock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    /// Incompatible feature bits.
    pub incompat: u64,
    /// Compatible feature bits.
    pub compat: u64,
    /// Filesystem id, stamped into every node.
    pub fsid: [u8; 16],
    /// Generation of the last commit.
    pub generation: u64,
    /// Device size.
    pub total_bytes: u64,
    /// Data block size.
    pub block_size: u32,
    /// B-tree node size.
    pub node_size: u32,
    /// Address of the root tree's root node.
    pub root_tree: u64,
    /// Level of the root tree's root node.
    pub root_level: u8,
    /// Start of the log area.
    pub log_start: u64,
    /// Length of the log area.
    pub log_len: u64,
    /// Bytes allocated at the time of the commit.
    pub bytes_used: u64,
    /// Offset in the log area of the first batch of the generation after this one.
    pub log_head: u64,
}

impl Superblock {
    /// The 4 KiB on-disk form for the copy at `own_addr`.
    pub fn encode(&self, own_addr: u64) -> Vec<u8> {
        let d = SuperDisk {
            csum: 0.into(),
            magic: MAGIC,
            incompat: self.incompat.into(),
            compat: self.compat.into(),
            fsid: self.fsid,
            generation: self.generation.into(),
            own_addr: own_addr.into(),
            total_bytes: self.total_bytes.into(),
            block_size: self.block_size.into(),
            node_size: self.node_size.into(),
            root_tree: self.root_tree.into(),
            root_level: self.root_level,
            pad: [0; 7],
            log_start: self.log_start.into(),
            log_len: self.log_len.into(),
            bytes_used: self.bytes_used.into(),
            log_head: self.log_head.into(),
        };
        let mut buf = vec![0u8; SUPER_SIZE];
        buf[..std::mem::size_of::<SuperDisk>()].copy_from_slice(d.as_bytes());
        let c = csum(&buf[4..]);
        buf[..4].copy_from_slice(&c.to_le_bytes());
        buf
    }

    /// Decodes and verifies the copy read from `own_addr`.
    pub fn decode(buf: &[u8], own_addr: u64) -> Result<Superblock> {
        let bad = |why: &str| Error::corrupt("superblock", own_addr, why);
        if buf.len() < SUPER_SIZE {
            return Err(bad("short read"));
        }
        let (d, _) = SuperDisk::read_from_prefix(buf).map_err(|_| bad("short"))?;
        if d.magic != MAGIC {
            return Err(Error::BadImage("not a birchfs image (no magic)".into()));
        }
        if d.csum.get() != csum(&buf[4..SUPER_SIZE]) {
            return Err(bad("checksum mismatch"));
        }
        if d.own_addr.get() != own_addr {
            return Err(bad("wrong own address"));
        }
        let unknown = d.incompat.get() & !INCOMPAT_SUPPORTED;
        if unknown != 0 {
            return Err(Error::BadImage(format!(
                "image uses features {unknown:#x} this birchfs does not support"
            )));
        }
        let sb = Superblock {
            incompat: d.incompat.get(),
            compat: d.compat.get(),
            fsid: d.fsid,
            generation: d.generation.get(),
            total_bytes: d.total_bytes.get(),
            block_size: d.block_size.get(),
            node_size: d.node_size.get(),
            root_tree: d.root_tree.get(),
            root_level: d.root_level,
            log_start: d.log_start.get(),
            log_len: d.log_len.get(),
            bytes_used: d.bytes_used.get(),
            log_head: d.log_head.get(),
        };
        if sb.block_size as u64 != super::BLOCK_SIZE
            || !sb.node_size.is_power_of_two()
            || !(4096..=65536).contains(&sb.node_size)
        {
            return Err(bad("unsupported block or node size"));
        }
        // A checksum proves the block was written whole, not that a writer was honest:
        // every field that sizes an allocation or bounds a loop is checked here.
        let data_start = sb.log_start.checked_add(sb.log_len);
        if sb.total_bytes < super::MIN_DEVICE_SIZE
            || sb.log_len % super::BLOCK_SIZE != 0
            // The log ends before the second superblock copy, or starts after it.
            || !match sb.log_start {
                super::LOG_START => sb.log_len <= super::SUPER_OFFSETS[1] - super::LOG_START,
                super::LOG_START_HIGH => sb.log_len <= if sb.incompat & super::INCOMPAT_LARGE_LOG != 0 {
                    super::LOG_MAX
                } else {
                    super::LOG_MAX_PLAIN
                },
                _ => false,
            }
            || data_start.is_none_or(|d| d >= sb.total_bytes)
            || sb.root_tree % super::BLOCK_SIZE != 0
            || sb.root_tree < data_start.unwrap_or(u64::MAX)
            || sb.root_tree.saturating_add(sb.node_size as u64) > sb.total_bytes
            || sb.root_level > 8
            || sb.bytes_used > sb.total_bytes
            || sb.log_head % super::BLOCK_SIZE != 0
            || (sb.log_head != 0 && sb.log_head >= sb.log_len)
        {
            return Err(bad("fields out of range"));
        }
        Ok(sb)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Superblock {
        Superblock {
            incompat: 1,
            compat: 0,
            fsid: [7; 16],
            generation: 9,
            total_bytes: 1 << 30,
            block_size: 4096,
            node_size: 16384,
            root_tree: 1 << 25,
            root_level: 1,
            log_start: 1 << 20,
            log_len: 1 << 24,
            bytes_used: 12345,
            log_head: 8192,
        }
    }

    #[test]
    fn roundtrip() {
        let sb = sample();
        let buf = sb.encode(65536);
        assert_eq!(Superblock::decode(&buf, 65536).unwrap(), sb);
    }

    #[test]
    fn well_checksummed_but_hostile_fields_are_refused() {
        let cases: [fn(&mut Superblock); 12] = [
            |s| s.log_head = 1 << 24,
            |s| s.log_head = 100,
            |s| s.log_len = 1 << 40,
            |s| s.log_len = 4095,
            // A log below the second superblock copy must end before it...
            |s| s.log_len = 64 << 20,
            // ... a log past it is at most LOG_MAX, and no other start is valid.
            |s| {
                s.log_start = super::super::LOG_START_HIGH;
                s.log_len = super::super::LOG_MAX + 4096;
                s.incompat |= super::super::INCOMPAT_LARGE_LOG;
                s.root_tree = 1 << 30;
                s.total_bytes = 2 << 30;
            },
            |s| s.log_start = 2 << 20,
            |s| s.log_start = super::super::SUPER_OFFSETS[1],
            |s| s.total_bytes = 1 << 20,
            |s| s.root_tree = 4096,
            |s| s.root_tree = u64::MAX - 4095,
            |s| s.root_level = 200,
        ];
        for (i, f) in cases.iter().enumerate() {
            let mut sb = sample();
            f(&mut sb);
            assert!(
                Superblock::decode(&sb.encode(65536), 65536).is_err(),
                "case {i}"
            );
        }
    }

    #[test]
    fn a_log_past_the_second_superblock_copy_is_accepted() {
        let mut sb = sample();
        sb.log_start = super::super::LOG_START_HIGH;
        sb.log_len = super::super::LOG_MAX;
        sb.root_tree = 1 << 30;
        sb.total_bytes = 2 << 30;
        // Over 256 MiB only with the feature flag that says so.
        assert!(Superblock::decode(&sb.encode(65536), 65536).is_err());
        sb.incompat |= super::super::INCOMPAT_LARGE_LOG;
        assert_eq!(Superblock::decode(&sb.encode(65536), 65536).unwrap(), sb);
        sb.log_len = super::super::LOG_MAX_PLAIN;
        sb.incompat &= !super::super::INCOMPAT_LARGE_LOG;
        assert_eq!(Superblock::decode(&sb.encode(65536), 65536).unwrap(), sb);
        // Its tree root may not lie in it.
        sb.root_tree = super::super::LOG_START_HIGH + 4096;
        assert!(Superblock::decode(&sb.encode(65536), 65536).is_err());
    }

    #[test]
    fn bad_checksum_wrong_addr_and_features_are_refused() {
        let sb = sample();
        let mut buf = sb.encode(65536);
        assert!(Superblock::decode(&buf, 1 << 26).is_err());
        buf[100] ^= 1;
        assert!(matches!(
            Superblock::decode(&buf, 65536),
            Err(Error::Corrupt { .. })
        ));
        let mut sb2 = sample();
        sb2.incompat |= 1 << 40;
        let buf = sb2.encode(65536);
        assert!(matches!(
            Superblock::decode(&buf, 65536),
            Err(Error::BadImage(_))
        ));
        assert!(matches!(
            Superblock::decode(&[0u8; 4096], 65536),
            Err(Error::BadImage(_))
        ));
    }
}
