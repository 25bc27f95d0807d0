//! An fs tree's items, sorted out by inode, for restore.

use std::collections::{BTreeMap, HashMap, HashSet};

use zerocopy::FromBytes;

use super::Restored;
use crate::format::{
    decode_dir_entries, decode_inode_extrefs, decode_inode_refs, decode_xattrs, kind, objectid,
    FileExtent, InodeItem, Key, XattrEntry,
};

/// One fs tree's items, sorted out by inode.
#[derive(Default)]
pub(super) struct Namespace {
    pub(super) inodes: BTreeMap<u64, InodeItem>,
    /// dir -> name -> inode: from DIR_INDEX, then DIR_ITEM, then INODE_REF and
    /// INODE_EXTREF.
    pub(super) entries: BTreeMap<u64, BTreeMap<Vec<u8>, u64>>,
    pub(super) extents: HashMap<u64, Vec<(u64, FileExtent)>>,
    pub(super) symlinks: HashMap<u64, Vec<u8>>,
    pub(super) xattrs: HashMap<u64, Vec<XattrEntry>>,
    pub(super) chunks: HashMap<(u64, u64), Vec<u8>>,
    pub(super) orphans: HashSet<u64>,
}

impl Namespace {
    pub(super) fn build(items: Vec<(Key, Vec<u8>)>, rep: &mut Restored) -> Namespace {
        let mut ns = Namespace::default();
        let mut by_index = Vec::new();
        let mut by_item = Vec::new();
        let mut by_ref = Vec::new();
        for (k, v) in items {
            let ino = k.objectid;
            let bad = |rep: &mut Restored, what: &str| {
                rep.problem(format!("inode {ino}: malformed {what} {k:?}; skipped"))
            };
            match k.ty {
                kind::ORPHAN_ITEM if ino == objectid::ORPHAN => {
                    ns.orphans.insert(k.offset);
                }
                kind::INODE_ITEM => match InodeItem::read_from_bytes(&v) {
                    Ok(i) => {
                        ns.inodes.insert(ino, i);
                    }
                    Err(_) => bad(rep, "inode item"),
                },
                kind::DIR_INDEX | kind::DIR_ITEM => match decode_dir_entries(&v) {
                    Some(l) => {
                        let to = if k.ty == kind::DIR_INDEX {
                            &mut by_index
                        } else {
                            &mut by_item
                        };
                        to.extend(l.into_iter().map(|e| (ino, e.name, e.ino)));
                    }
                    None => bad(rep, "directory entry"),
                },
                kind::INODE_REF => match decode_inode_refs(&v) {
                    Some(l) => by_ref.extend(l.into_iter().map(|r| (k.offset, r.name, ino))),
                    None => bad(rep, "inode ref"),
                },
                kind::INODE_EXTREF => match decode_inode_extrefs(&v) {
                    Some(l) => by_ref.extend(l.into_iter().map(|x| (x.parent, x.name, ino))),
                    None => bad(rep, "inode extref"),
                },
                kind::EXTENT_DATA => match FileExtent::read_from_bytes(&v) {
                    Ok(fe) => ns.extents.entry(ino).or_default().push((k.offset, fe)),
                    Err(_) => bad(rep, "file extent"),
                },
                kind::SYMLINK => {
                    ns.symlinks.insert(ino, v);
                }
                kind::XATTR_ITEM => match decode_xattrs(&v) {
                    Some(l) => ns.xattrs.entry(ino).or_default().extend(l),
                    None => bad(rep, "xattr item"),
                },
                kind::XATTR_CHUNK => {
                    ns.chunks.insert((ino, k.offset), v);
                }
                _ => {}
            }
        }
        for (dir, name, ino) in by_index.into_iter().chain(by_item).chain(by_ref) {
            ns.entries
                .entry(dir)
                .or_default()
                .entry(name)
                .or_insert(ino);
        }
        for l in ns.extents.values_mut() {
            l.sort_by_key(|x| x.0);
        }
        ns
    }

    /// An xattr's value, its chunks put together.
    pub(super) fn xattr_value(&self, ino: u64, e: &XattrEntry) -> Option<Vec<u8>> {
        let Some((base, len)) = e.chunks else {
            return Some(e.value.clone());
        };
        let mut v = Vec::new();
        // The chunks are keyed base, base + 1, ... (src/fs/xattr.rs).
        let mut key = base;
        while v.len() < len as usize {
            v.extend_from_slice(self.chunks.get(&(ino, key))?);
            key = key.checked_add(1)?;
        }
        (v.len() == len as usize).then_some(v)
    }
}
