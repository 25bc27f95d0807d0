//! B-tree node encoding.
//!
//! ```text
//! header (64 bytes):
//! 0    4      20    28    36         44    45    48     52        64
//! |csum|fsid  |addr |gen  |owner     |level|pad  |nitems|reserved |
//! leaf body:     nitems × (key 17 | len u32 | data[len])
//! internal body: nitems × (key 17 | child addr u64 | child generation u64)
//! ```
//! crc32c covers bytes 4..node_size. A node is trusted only when its checksum, fsid,
//! own address, level, owner and generation match what the reader expected.

use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use super::{csum, Key, Reader};
use crate::error::{Error, Result};

/// Bytes of the node header.
pub const NODE_HEADER_SIZE: usize = 64;

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy)]
#[repr(C)]
struct HeaderDisk {
    csum: U32,
    fsid: [u8; 16],
    addr: U64,
    generation: U64,
    owner: U64,
    level: u8,
    pad: [u8; 3],
    nitems: U32,
    reserved: [u8; 12],
}
const _: () = assert!(std::mem::size_of::<HeaderDisk>() == NODE_HEADER_SIZE);

/// Node metadata kept beside the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeHeader {
    /// Address the node was written at.
    pub addr: u64,
    /// Generation that wrote it.
    pub generation: u64,
    /// Tree the node belongs to.
    pub owner: u64,
    /// 0 for leaves.
    pub level: u8,
}

/// Items of a leaf or child pointers of an internal node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeBody {
    /// Keys with their payloads.
    Leaf(Vec<(Key, Vec<u8>)>),
    /// Keys with (child address, child generation).
    Internal(Vec<(Key, u64, u64)>),
}

/// Bytes one leaf item takes in the node.
pub(crate) const LEAF_ITEM_OVERHEAD: usize = Key::SIZE + 4;
/// Bytes one internal pointer takes in the node.
pub(crate) const PTR_SIZE: usize = Key::SIZE + 16;

/// Bytes a leaf item whose value is `len` bytes long takes in the node.
pub(crate) const fn leaf_item_size(len: usize) -> usize {
    LEAF_ITEM_OVERHEAD + len
}

/// Encodes a node into exactly `node_size` bytes with its checksum.
pub fn encode_node(h: &NodeHeader, body: &NodeBody, fsid: &[u8; 16], node_size: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(node_size);
    let nitems = match body {
        NodeBody::Leaf(v) => v.len(),
        NodeBody::Internal(v) => v.len(),
    };
    let hd = HeaderDisk {
        csum: 0.into(),
        fsid: *fsid,
        addr: h.addr.into(),
        generation: h.generation.into(),
        owner: h.owner.into(),
        level: h.level,
        pad: [0; 3],
        nitems: (nitems as u32).into(),
        reserved: [0; 12],
    };
    out.extend_from_slice(hd.as_bytes());
    match body {
        NodeBody::Leaf(items) => {
            for (k, v) in items {
                k.encode(&mut out);
                out.extend_from_slice(&(v.len() as u32).to_le_bytes());
                out.extend_from_slice(v);
            }
        }
        NodeBody::Internal(ptrs) => {
            for (k, a, g) in ptrs {
                k.encode(&mut out);
                out.extend_from_slice(&a.to_le_bytes());
                out.extend_from_slice(&g.to_le_bytes());
            }
        }
    }
    assert!(
        out.len() <= node_size,
        "node overflow: {} > {node_size}",
        out.len()
    );
    out.resize(node_size, 0);
    let c = csum(&out[4..]);
    out[..4].copy_from_slice(&c.to_le_bytes());
    out
}

/// Decodes a node read from `addr`, verifying checksum, fsid and address.
pub fn decode_node(buf: &[u8], addr: u64, fsid: &[u8; 16]) -> Result<(NodeHeader, NodeBody)> {
    let bad = |why: &str| Error::corrupt("tree node", addr, why);
    let (hd, _) = HeaderDisk::read_from_prefix(buf).map_err(|_| bad("short node"))?;
    if hd.csum.get() != csum(&buf[4..]) {
        return Err(bad("checksum mismatch"));
    }
    if &hd.fsid != fsid {
        return Err(bad("fsid mismatch"));
    }
    if hd.addr.get() != addr {
        return Err(bad("node claims another address"));
    }
    let h = NodeHeader {
        addr,
        generation: hd.generation.get(),
        owner: hd.owner.get(),
        level: hd.level,
    };
    if h.level > 8 {
        return Err(bad("level too high"));
    }
    let n = hd.nitems.get() as usize;
    let mut r = Reader::new(&buf[NODE_HEADER_SIZE..]);
    let body = if h.level == 0 {
        let mut items = Vec::with_capacity(n.min(buf.len() / LEAF_ITEM_OVERHEAD));
        for _ in 0..n {
            let k = Key::decode(&mut r).ok_or_else(|| bad("truncated item"))?;
            let len = r.u32().ok_or_else(|| bad("truncated item"))? as usize;
            let v = r.bytes(len).ok_or_else(|| bad("item past node end"))?;
            items.push((k, v.to_vec()));
        }
        NodeBody::Leaf(items)
    } else {
        let mut ptrs = Vec::with_capacity(n.min(buf.len() / PTR_SIZE));
        for _ in 0..n {
            let k = Key::decode(&mut r).ok_or_else(|| bad("truncated pointer"))?;
            let a = r.u64().ok_or_else(|| bad("truncated pointer"))?;
            let g = r.u64().ok_or_else(|| bad("truncated pointer"))?;
            ptrs.push((k, a, g));
        }
        if ptrs.is_empty() {
            return Err(bad("internal node without children"));
        }
        NodeBody::Internal(ptrs)
    };
    let sorted = match &body {
        NodeBody::Leaf(v) => v.windows(2).all(|w| w[0].0 < w[1].0),
        NodeBody::Internal(v) => v.windows(2).all(|w| w[0].0 < w[1].0),
    };
    if !sorted {
        return Err(bad("keys out of order"));
    }
    Ok((h, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leaf_and_internal_roundtrip_and_detect_flips() {
        let fsid = [3; 16];
        let h = NodeHeader {
            addr: 1 << 22,
            generation: 5,
            owner: 5,
            level: 0,
        };
        let body = NodeBody::Leaf(vec![
            (Key::new(256, 1, 0), vec![1, 2, 3]),
            (Key::new(256, 84, 99), vec![]),
        ]);
        let buf = encode_node(&h, &body, &fsid, 16384);
        assert_eq!(buf.len(), 16384);
        assert_eq!(decode_node(&buf, h.addr, &fsid).unwrap(), (h, body));
        for bit in [0usize, 40, 70, 16383 * 8] {
            let mut b = buf.clone();
            b[bit / 8] ^= 1 << (bit % 8);
            assert!(decode_node(&b, h.addr, &fsid).is_err(), "flip at bit {bit}");
        }
        assert!(decode_node(&buf, h.addr + 4096, &fsid).is_err());
        assert!(decode_node(&buf, h.addr, &[4; 16]).is_err());

        let hi = NodeHeader { level: 1, ..h };
        let body = NodeBody::Internal(vec![(Key::new(1, 1, 1), 8192, 4)]);
        let buf = encode_node(&hi, &body, &fsid, 16384);
        assert_eq!(decode_node(&buf, hi.addr, &fsid).unwrap().1, body);
    }
}
