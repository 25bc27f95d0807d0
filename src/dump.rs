//! `birchfs dump`: prints the superblock and trees, like btrfs inspect-internal dump-tree,
//! and the log records a mount would replay.

use std::io::Write;

use zerocopy::FromBytes;

use crate::dev::BlockDev;
use crate::error::{Error, Result};
use crate::format::{
    decode_dir_entries, decode_inode_extrefs, decode_inode_refs, decode_node, decode_xattrs, kind,
    tree, ExtentItem, FileExtent, InodeItem, Key, NodeBody, RootItem, SnapshotItem, SnapshotMeta,
};
use crate::txn::Store;

/// What `--tree log` selects: no tree, the log.
const LOG: u64 = u64::MAX;

fn tree_id(name: &str) -> Result<u64> {
    Ok(match name {
        "log" => LOG,
        "root" => tree::ROOT,
        "extent" => tree::EXTENT,
        "fs" => tree::FS,
        "csum" => tree::CSUM,
        _ => return Err(Error::Invalid("unknown tree (root, extent, fs, csum, log)")),
    })
}

fn describe(k: &Key, v: &[u8]) -> String {
    let s = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    match k.ty {
        kind::INODE_ITEM => {
            match InodeItem::read_from_bytes(v) {
                Ok(i) => format!(
                "INODE_ITEM mode {:o} size {} nbytes {} nlink {} uid {} gid {} gen {} transid {} flags {:#x}",
                i.mode.get(), i.size.get(), i.nbytes.get(), i.nlink.get(), i.uid.get(), i.gid.get(),
                i.generation.get(), i.transid.get(), i.flags.get()
            ),
                Err(_) => "INODE_ITEM (malformed)".into(),
            }
        }
        kind::INODE_REF => match decode_inode_refs(v) {
            Some(l) => format!(
                "INODE_REF {}",
                l.iter()
                    .map(|r| format!("index {} name {:?}", r.index, s(&r.name)))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
            None => "INODE_REF (malformed)".into(),
        },
        kind::INODE_EXTREF => match decode_inode_extrefs(v) {
            Some(l) => format!(
                "INODE_EXTREF {}",
                l.iter()
                    .map(|x| format!(
                        "parent {} index {} name {:?}",
                        x.parent,
                        x.index,
                        s(&x.name)
                    ))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
            None => "INODE_EXTREF (malformed)".into(),
        },
        kind::DIR_ITEM | kind::DIR_INDEX => match decode_dir_entries(v) {
            Some(l) => format!(
                "{} {}",
                if k.ty == kind::DIR_ITEM {
                    "DIR_ITEM"
                } else {
                    "DIR_INDEX"
                },
                l.iter()
                    .map(|e| format!(
                        "ino {} type {} index {} name {:?}",
                        e.ino,
                        e.dtype,
                        e.index,
                        s(&e.name)
                    ))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
            None => "DIR entry (malformed)".into(),
        },
        kind::XATTR_ITEM => match decode_xattrs(v) {
            Some(l) => format!(
                "XATTR_ITEM {}",
                l.iter()
                    .map(|e| match e.chunks {
                        Some((base, len)) => {
                            format!("{:?} ({len} bytes in chunks from {base:#x})", s(&e.name))
                        }
                        None => format!("{:?} ({} bytes)", s(&e.name), e.value.len()),
                    })
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
            None => "XATTR_ITEM (malformed)".into(),
        },
        kind::XATTR_CHUNK => format!("XATTR_CHUNK {} bytes", v.len()),
        kind::ORPHAN_ITEM => "ORPHAN_ITEM".into(),
        kind::SYMLINK => format!("SYMLINK -> {:?}", s(v)),
        kind::EXTENT_DATA => match FileExtent::read_from_bytes(v) {
            Ok(f) => format!(
                "EXTENT_DATA {} disk {:#x} len {} offset {} num_bytes {} gen {}",
                if f.kind == crate::format::FILE_EXTENT_PREALLOC {
                    "prealloc"
                } else {
                    "regular"
                },
                f.disk_bytenr.get(),
                f.disk_len.get(),
                f.offset.get(),
                f.num_bytes.get(),
                f.generation.get()
            ),
            Err(_) => "EXTENT_DATA (malformed)".into(),
        },
        kind::EXTENT_CSUM => format!("EXTENT_CSUM {} blocks", v.len() / 4),
        kind::ROOT_ITEM => match RootItem::read_from_bytes(v) {
            Ok(r) => format!(
                "ROOT_ITEM bytenr {:#x} level {} gen {}{}{}",
                r.bytenr.get(),
                r.level,
                r.generation.get(),
                if r.flags.get() & crate::format::root_flag::RDONLY != 0 {
                    " read-only"
                } else {
                    ""
                },
                if r.flags.get() & crate::format::root_flag::DEAD != 0 {
                    " deleted"
                } else {
                    ""
                }
            ),
            Err(_) => "ROOT_ITEM (malformed)".into(),
        },
        kind::DROP_PROGRESS => match Key::decode(&mut crate::format::Reader::new(v)) {
            Some(p) => format!("DROP_PROGRESS dropped below {p:?}"),
            None => "DROP_PROGRESS (malformed)".into(),
        },
        kind::SNAPSHOT_META => match SnapshotMeta::read_from_bytes(v) {
            Ok(m) => format!(
                "SNAPSHOT_META next id {} last snapshot gen {}",
                m.next_id.get(),
                m.last_snapshot.get()
            ),
            Err(_) => "SNAPSHOT_META (malformed)".into(),
        },
        kind::SNAPSHOT => match SnapshotItem::decode(v) {
            Some(snap) => format!(
                "SNAPSHOT {:?} gen {} created {}",
                s(&snap.name),
                snap.generation,
                snap.ctime.sec.get()
            ),
            None => "SNAPSHOT (malformed)".into(),
        },
        kind::EXTENT_ITEM => match ExtentItem::read_from_bytes(v) {
            Ok(e) => format!(
                "EXTENT_ITEM refs {} {} gen {}",
                e.refs.get(),
                if e.flags.get() & crate::format::EXTENT_FLAG_TREE != 0 {
                    "tree"
                } else {
                    "data"
                },
                e.generation.get()
            ),
            Err(_) => "EXTENT_ITEM (malformed)".into(),
        },
        t => format!("type {t}, {} bytes", v.len()),
    }
}

fn dump_node(
    dev: &dyn BlockDev,
    sb: &crate::format::Superblock,
    addr: u64,
    depth: usize,
    out: &mut dyn Write,
) -> Result<()> {
    let mut buf = vec![0u8; sb.node_size as usize];
    dev.read_at(&mut buf, addr)?;
    let pad = "  ".repeat(depth);
    let (h, body) = match decode_node(&buf, addr, &sb.fsid) {
        Ok(x) => x,
        Err(e) => {
            writeln!(out, "{pad}node {addr:#x}: {e}")?;
            return Ok(());
        }
    };
    match body {
        NodeBody::Leaf(items) => {
            writeln!(
                out,
                "{pad}leaf {addr:#x} gen {} owner {} items {}",
                h.generation,
                h.owner,
                items.len()
            )?;
            for (k, v) in &items {
                writeln!(out, "{pad}  key {k:?} {}", describe(k, v))?;
            }
        }
        NodeBody::Internal(ptrs) => {
            writeln!(
                out,
                "{pad}node {addr:#x} level {} gen {} owner {} ptrs {}",
                h.level,
                h.generation,
                h.owner,
                ptrs.len()
            )?;
            for (k, child, g) in &ptrs {
                writeln!(out, "{pad}  key {k:?} child {child:#x} gen {g}")?;
                dump_node(dev, sb, *child, depth + 2, out)?;
            }
        }
    }
    Ok(())
}

/// Prints the superblock and every tree (or only `only`) to `out`.
pub fn dump(dev: &dyn BlockDev, only: Option<&str>, out: &mut dyn Write) -> Result<()> {
    let only = only.map(tree_id).transpose()?;
    let sb = Store::read_super(dev)?;
    writeln!(
        out,
        "superblock: generation {} size {} node_size {} root_tree {:#x} level {} log {:#x}+{} bytes_used {}",
        sb.generation, sb.total_bytes, sb.node_size, sb.root_tree, sb.root_level, sb.log_start, sb.log_len, sb.bytes_used
    )?;
    let mut buf = vec![0u8; sb.node_size as usize];
    dev.read_at(&mut buf, sb.root_tree)?;
    if only.is_none_or(|t| t == tree::ROOT) {
        writeln!(out, "root tree:")?;
        dump_node(dev, &sb, sb.root_tree, 1, out)?;
    }
    let (_, body) = decode_node(&buf, sb.root_tree, &sb.fsid)?;
    let mut roots = Vec::new();
    collect_root_items(dev, &sb, body, &mut roots)?;
    for (id, r) in roots {
        if only.is_none_or(|t| t == id) {
            writeln!(out, "tree {id}:")?;
            dump_node(dev, &sb, r.bytenr.get(), 1, out)?;
        }
    }
    if only.is_none_or(|t| t == LOG) {
        dump_log(dev, &sb, out)?;
    }
    Ok(())
}

/// Prints the log batches a mount would replay (fsyncs since the last commit), each
/// record as the item it inserts, the key it deletes or the data reference it moves.
fn dump_log(dev: &dyn BlockDev, sb: &crate::format::Superblock, out: &mut dyn Write) -> Result<()> {
    use crate::log::LogOp;
    let batches = crate::fs::log_batches(dev, sb, sb.generation + 1)?.batches;
    writeln!(
        out,
        "log: {} batches a mount would replay (generation {}, head {:#x})",
        batches.len(),
        sb.generation + 1,
        sb.log_head
    )?;
    let name = |t: u64| match t {
        tree::FS => "fs".to_string(),
        tree::CSUM => "csum".to_string(),
        t => format!("tree {t}"),
    };
    for (i, b) in batches.iter().enumerate() {
        writeln!(out, "  batch {i}: {} records", b.len())?;
        for op in b {
            match op {
                LogOp::Insert { tree: t, key, val } => writeln!(
                    out,
                    "    insert {} key {key:?} {}",
                    name(*t),
                    describe(key, val)
                )?,
                LogOp::Delete { tree: t, key } => {
                    writeln!(out, "    delete {} key {key:?}", name(*t))?
                }
                LogOp::DataRef { bytenr, len, delta } => {
                    writeln!(out, "    data_ref {bytenr:#x} len {len} refs {delta:+}")?
                }
            }
        }
    }
    Ok(())
}

fn collect_root_items(
    dev: &dyn BlockDev,
    sb: &crate::format::Superblock,
    body: NodeBody,
    out: &mut Vec<(u64, RootItem)>,
) -> Result<()> {
    match body {
        NodeBody::Leaf(items) => {
            for (k, v) in items {
                if let (kind::ROOT_ITEM, Ok(r)) = (k.ty, RootItem::read_from_bytes(&v)) {
                    out.push((k.objectid, r));
                }
            }
        }
        NodeBody::Internal(ptrs) => {
            for (_, child, _) in ptrs {
                let mut buf = vec![0u8; sb.node_size as usize];
                dev.read_at(&mut buf, child)?;
                let (_, b) = decode_node(&buf, child, &sb.fsid)?;
                collect_root_items(dev, sb, b, out)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::dev::MemDev;
    use crate::fs::{Fs, MkfsOptions, Options};

    #[test]
    fn the_root_tree_shows_snapshots_by_name_and_deleted_ones_with_their_progress() {
        let dev = Arc::new(MemDev::new(64 << 20));
        Fs::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
        let fs = Fs::open(dev.clone(), Options::default()).unwrap();
        fs.snapshot_create(b"keep").unwrap();
        fs.snapshot_create(b"gone").unwrap();
        fs.snapshot_delete(b"gone").unwrap();
        fs.unmount().unwrap();
        let mut out = Vec::new();
        super::dump(dev.as_ref(), Some("root"), &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        for want in [
            "SNAPSHOT \"keep\" gen",
            "read-only",
            "deleted",
            "DROP_PROGRESS dropped below",
            "SNAPSHOT_META next id 258",
        ] {
            assert!(text.contains(want), "{want:?} missing from:\n{text}");
        }
        assert!(!text.contains("\"gone\""), "{text}");
    }

    /// After a crash, `--tree log` shows the fsynced changes a mount would replay;
    /// after a clean unmount, none.
    #[test]
    fn the_log_shows_what_a_mount_would_replay() {
        let dev = Arc::new(MemDev::new(64 << 20));
        Fs::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
        let fs = Fs::open(dev.clone(), Options::default()).unwrap();
        let a = fs
            .mknod(
                crate::fs::ROOT_INO,
                b"fsynced",
                0o644,
                0,
                Default::default(),
            )
            .unwrap();
        fs.write(a.ino, 0, b"data").unwrap();
        fs.fsync(a.ino, false).unwrap();
        let crashed = MemDev::from_image(dev.image());
        let dump = |d: &MemDev| {
            let mut out = Vec::new();
            super::dump(d, Some("log"), &mut out).unwrap();
            String::from_utf8(out).unwrap()
        };
        let text = dump(&crashed);
        for want in [
            "log: 1 batches a mount would replay",
            "insert fs key",
            "DIR_ITEM",
            "\"fsynced\"",
            "EXTENT_DATA",
            "insert csum key",
            "data_ref",
        ] {
            assert!(text.contains(want), "{want:?} missing from:\n{text}");
        }
        assert!(
            !text.contains("tree 5:"),
            "only the log was asked for:\n{text}"
        );
        fs.unmount().unwrap();
        let text = dump(&dev);
        assert!(text.contains("log: 0 batches"), "{text}");
    }
}
