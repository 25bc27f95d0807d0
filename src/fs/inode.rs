//! Inodes: attributes, creation, freeing, orphans and permission checks.

use std::time::SystemTime;

use zerocopy::{FromBytes, IntoBytes};

use super::Inner;
use crate::error::{Error, Result};
use crate::format::{
    inode_flag, kind, objectid, tree, FileExtent, InodeItem, Key, Timespec, BLOCK_SIZE,
    MAX_FILE_SIZE,
};

/// The type of an inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link.
    Symlink,
    /// Named pipe.
    Fifo,
    /// Character device.
    CharDev,
    /// Block device.
    BlockDev,
    /// Unix socket.
    Socket,
}

impl FileKind {
    /// From the type bits of a mode.
    pub fn from_mode(mode: u32) -> Option<FileKind> {
        Some(match mode & libc::S_IFMT {
            libc::S_IFREG => FileKind::File,
            libc::S_IFDIR => FileKind::Dir,
            libc::S_IFLNK => FileKind::Symlink,
            libc::S_IFIFO => FileKind::Fifo,
            libc::S_IFCHR => FileKind::CharDev,
            libc::S_IFBLK => FileKind::BlockDev,
            libc::S_IFSOCK => FileKind::Socket,
            _ => return None,
        })
    }

    /// The DT_* value stored in directory entries.
    pub fn dtype(self) -> u8 {
        match self {
            FileKind::File => libc::DT_REG,
            FileKind::Dir => libc::DT_DIR,
            FileKind::Symlink => libc::DT_LNK,
            FileKind::Fifo => libc::DT_FIFO,
            FileKind::CharDev => libc::DT_CHR,
            FileKind::BlockDev => libc::DT_BLK,
            FileKind::Socket => libc::DT_SOCK,
        }
    }

    /// From a DT_* value.
    pub fn from_dtype(d: u8) -> Option<FileKind> {
        Some(match d {
            libc::DT_REG => FileKind::File,
            libc::DT_DIR => FileKind::Dir,
            libc::DT_LNK => FileKind::Symlink,
            libc::DT_FIFO => FileKind::Fifo,
            libc::DT_CHR => FileKind::CharDev,
            libc::DT_BLK => FileKind::BlockDev,
            libc::DT_SOCK => FileKind::Socket,
            _ => return None,
        })
    }
}

/// Attributes of an inode, as stat reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr {
    /// Inode number.
    pub ino: u64,
    /// Generation the inode was created in (with `ino`, unique for the life of the fs).
    pub generation: u64,
    /// Size in bytes.
    pub size: u64,
    /// 512-byte blocks allocated.
    pub blocks: u64,
    /// Last access.
    pub atime: SystemTime,
    /// Last data change.
    pub mtime: SystemTime,
    /// Last attribute change.
    pub ctime: SystemTime,
    /// Creation.
    pub crtime: SystemTime,
    /// File type.
    pub kind: FileKind,
    /// Permission bits including setuid, setgid and sticky.
    pub perm: u16,
    /// Hard links.
    pub nlink: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Device number (device nodes).
    pub rdev: u64,
    /// Inode flags, as `FS_*_FL` bits ([`crate::format::inode_flag`]).
    pub flags: u32,
}

/// A time to set: now, or a given time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeSet {
    /// The current time.
    Now,
    /// This time.
    At(SystemTime),
}

/// Attribute changes; `None` leaves a field as it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SetAttr {
    /// New permission bits (type bits are ignored).
    pub mode: Option<u32>,
    /// New owner.
    pub uid: Option<u32>,
    /// New group.
    pub gid: Option<u32>,
    /// New size (truncate or extend).
    pub size: Option<u64>,
    /// New access time.
    pub atime: Option<TimeSet>,
    /// New modification time.
    pub mtime: Option<TimeSet>,
    /// New change time (otherwise ctime becomes now on any change).
    pub ctime: Option<SystemTime>,
    /// Clears S_ISUID, and S_ISGID where the group may execute, of a non-directory
    /// (before `mode` applies): what a chown, or a write or truncate by a caller
    /// without CAP_FSETID, does.
    pub kill_suid: bool,
    /// With `kill_suid`, clears S_ISGID also where the group may not execute: the
    /// caller is neither in the file's group nor has CAP_FSETID.
    pub kill_sgid: bool,
}

/// `mode` after a write, truncate or chown that drops privileges: without S_ISUID, and
/// without S_ISGID where the group may execute or `outsider` (the caller is neither
/// in the file's group nor has CAP_FSETID, Linux 6.2's rule); directories keep both.
pub fn without_suid(mode: u32, outsider: bool) -> u32 {
    if mode & libc::S_IFMT == libc::S_IFDIR {
        return mode;
    }
    let mut kill = libc::S_ISUID;
    if mode & libc::S_IXGRP != 0 || outsider {
        kill |= libc::S_ISGID;
    }
    mode & !kill
}

pub(crate) fn inode_key(ino: u64) -> Key {
    Key::new(ino, kind::INODE_ITEM, 0)
}

fn attr_of(ino: u64, i: &InodeItem) -> Result<Attr> {
    let mode = i.mode.get();
    let kind = FileKind::from_mode(mode)
        .ok_or_else(|| Error::corrupt("inode", ino, format!("bad mode {mode:o}")))?;
    Ok(Attr {
        ino,
        generation: i.generation.get(),
        size: i.size.get(),
        blocks: i.nbytes.get() / 512,
        atime: i.atime.to_system(),
        mtime: i.mtime.to_system(),
        ctime: i.ctime.to_system(),
        crtime: i.crtime.to_system(),
        kind,
        perm: (mode & 0o7777) as u16,
        nlink: i.nlink.get(),
        uid: i.uid.get(),
        gid: i.gid.get(),
        rdev: i.rdev.get(),
        flags: (i.flags.get() & inode_flag::KNOWN) as u32,
    })
}

/// POSIX permission check for `mask` (R_OK=4, W_OK=2, X_OK=1).
pub(crate) fn check_access(a: &Attr, mask: i32, uid: u32, gid: u32, groups: &[u32]) -> Result<()> {
    let mask = (mask & 7) as u16;
    if mask == 0 {
        return Ok(());
    }
    if uid == 0 {
        // root: everything but execute needs no bit; execute needs one x bit or a dir.
        if mask & 1 == 0 || a.kind == FileKind::Dir || a.perm & 0o111 != 0 {
            return Ok(());
        }
        return Err(Error::Access);
    }
    let bits = if a.uid == uid {
        (a.perm >> 6) & 7
    } else if a.gid == gid || groups.contains(&a.gid) {
        (a.perm >> 3) & 7
    } else {
        a.perm & 7
    };
    if bits & mask == mask {
        Ok(())
    } else {
        Err(Error::Access)
    }
}

impl Inner {
    /// The inode item of `ino`, with the size and times of cached writes not yet in
    /// the tree (see `PendingAttr`).
    pub(crate) fn get_inode_opt(&mut self, ino: u64) -> Result<Option<InodeItem>> {
        let (t, local) = super::snapshot::split(ino);
        match self.store.search(t, &inode_key(local))? {
            None => Ok(None),
            Some(v) => {
                let mut i = InodeItem::read_from_bytes(&v)
                    .map_err(|_| Error::corrupt("inode", ino, "bad inode item size"))?;
                if let Some(p) = self.pending.get(&ino) {
                    i.size = p.size.into();
                    i.mtime = p.mtime;
                    i.ctime = p.ctime;
                }
                Ok(Some(i))
            }
        }
    }

    pub(crate) fn get_inode(&mut self, ino: u64) -> Result<InodeItem> {
        self.get_inode_opt(ino)?.ok_or(Error::NotFound)
    }

    /// Stores the inode item of `ino` (which includes what was pending). A size that
    /// came from cached writes whose data is not all written back is stored only up
    /// to that data's end, and the rest stays pending.
    pub(crate) fn put_inode(&mut self, ino: u64, item: &mut InodeItem) -> Result<()> {
        // Snapshot inode numbers are not keys of the live tree (every change of an
        // inode stores it, so this guards all write paths).
        if super::snapshot::is_snapshot_ino(ino) {
            return Err(Error::ReadOnly);
        }
        item.transid = self.store.generation.into();
        match self.pending.get_mut(&ino) {
            // The caller kept the cached size (it did not set one of its own).
            Some(p) if p.size == item.size.get() && p.disk_size < p.size => {
                p.mtime = item.mtime;
                p.ctime = item.ctime;
                let mut stored = *item;
                stored.size = p.disk_size.into();
                self.store
                    .insert(tree::FS, inode_key(ino), stored.as_bytes().to_vec())
            }
            _ => {
                self.pending.remove(&ino);
                self.store
                    .insert(tree::FS, inode_key(ino), item.as_bytes().to_vec())
            }
        }
    }

    pub(crate) fn getattr(&mut self, ino: u64) -> Result<Attr> {
        if ino == super::snapshot::SNAPSHOTS_INO {
            return self.snapshots_dir_attr();
        }
        let i = self.get_inode(ino)?;
        self.attr_of(ino, &i)
    }

    /// The attributes of `ino`; its blocks count the dirty cached blocks that
    /// writeback will allocate, as a disk-usage or sparse-file check expects.
    pub(crate) fn attr_of(&mut self, ino: u64, i: &InodeItem) -> Result<Attr> {
        let mut a = attr_of(ino, i)?;
        a.blocks += self.new_dirty_blocks(ino) * (BLOCK_SIZE / 512);
        Ok(a)
    }

    /// Dirty cached blocks of `ino` over no extent yet: an overwrite of allocated
    /// or preallocated blocks replaces them and adds nothing (btrfs's "new
    /// delalloc bytes"). With dirty blocks in many folios, or an extent lookup that
    /// fails, every dirty block counts.
    fn new_dirty_blocks(&mut self, ino: u64) -> u64 {
        let all = self.cache.dirty_blocks_of(ino);
        if all == 0 {
            return 0;
        }
        let Some(ranges) = self.cache.dirty_ranges_of(ino, 64) else {
            return all;
        };
        let mut new = 0;
        for (off, len) in ranges {
            let Ok(covered) = self.mapped_bytes(ino, off, off + len, |_, _| true) else {
                return all;
            };
            new += len.saturating_sub(covered) / BLOCK_SIZE;
        }
        new
    }

    /// Room that cached writes hold: their dirty data and the data held beside it
    /// (`PageCache::hold`), and the margin for the tree nodes its writeback copies (as
    /// `write_begin` counts them when it admits them).
    pub(crate) fn promised_room(&self) -> u64 {
        let d = self.cache.promised_bytes();
        if d == 0 {
            0
        } else {
            d + d / 32 + 2 * BLOCK_SIZE
        }
    }

    /// Refuses operations that add data or names when only the reserve and the room
    /// cached writes hold are left (a name taking that room would make their
    /// writeback fail after `write()` said yes).
    pub(crate) fn need_room(&self) -> Result<()> {
        if self.store.alloc.has_room(self.promised_room()) {
            Ok(())
        } else {
            Err(Error::NoSpace)
        }
    }

    pub(crate) fn new_inode(
        &mut self,
        mode: u32,
        rdev: u64,
        uid: u32,
        gid: u32,
    ) -> Result<(u64, InodeItem)> {
        if self.next_ino >= objectid::LAST_INODE.min(super::snapshot::LIVE_INO_LIMIT) {
            return Err(Error::NoSpace);
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        let mut item = self.fresh_inode(mode, rdev, uid, gid);
        self.put_inode(ino, &mut item)?;
        Ok((ino, item))
    }

    /// An inode item as a new inode of `mode` starts: all times now, one link (two
    /// for a directory), the first readdir index after `.` and `..`.
    fn fresh_inode(&self, mode: u32, rdev: u64, uid: u32, gid: u32) -> InodeItem {
        let now = Timespec::now();
        let dir = mode & libc::S_IFMT == libc::S_IFDIR;
        InodeItem {
            generation: self.store.generation.into(),
            nlink: (if dir { 2 } else { 1 }).into(),
            uid: uid.into(),
            gid: gid.into(),
            mode: mode.into(),
            rdev: rdev.into(),
            next_index: 3.into(),
            atime: now,
            mtime: now,
            ctime: now,
            crtime: now,
            ..Default::default()
        }
    }

    pub(crate) fn make_root_dir(&mut self, (uid, gid): (u32, u32)) -> Result<()> {
        let mut item = self.fresh_inode(libc::S_IFDIR | 0o755, 0, uid, gid);
        self.put_inode(objectid::ROOT_DIR, &mut item)
    }

    pub(crate) fn setattr(&mut self, ino: u64, set: &super::SetAttr) -> Result<Attr> {
        let mut i = self.get_inode(ino)?;
        let now = Timespec::now();
        if let Some(size) = set.size {
            let kind = attr_of(ino, &i)?.kind;
            match kind {
                FileKind::Dir => return Err(Error::IsDir),
                FileKind::File => {}
                _ => return Err(Error::Invalid("size of a special file")),
            }
            if size > MAX_FILE_SIZE {
                return Err(Error::TooBig);
            }
            if size > i.size.get() {
                self.need_room()?;
            }
            self.truncate(ino, &mut i, size)?;
            i.mtime = now;
        }
        if set.kill_suid {
            i.mode = without_suid(i.mode.get(), set.kill_sgid).into();
        }
        if let Some(m) = set.mode {
            i.mode = ((i.mode.get() & libc::S_IFMT) | (m & 0o7777)).into();
        }
        if let Some(u) = set.uid {
            i.uid = u.into();
        }
        if let Some(g) = set.gid {
            i.gid = g.into();
        }
        let ts = |t: TimeSet| match t {
            TimeSet::Now => now,
            TimeSet::At(s) => Timespec::from_system(s),
        };
        if let Some(t) = set.atime {
            i.atime = ts(t);
        }
        if let Some(t) = set.mtime {
            i.mtime = ts(t);
        }
        i.ctime = set.ctime.map(Timespec::from_system).unwrap_or(now);
        self.put_inode(ino, &mut i)?;
        if let Some(m) = set.mode {
            self.chmod_acl(ino, m)?;
        }
        if set.size.is_some() {
            // After the inode record: an fdatasync must take the new size along.
            self.store.log.mark_data(ino);
        }
        self.attr_of(ino, &i)
    }

    /// Refuses (EPERM) a change to `ino` when it has any of inode `flags`.
    pub(crate) fn refuse_if_flagged(&mut self, ino: u64, flags: u64) -> Result<()> {
        if self.get_inode(ino)?.flags.get() & flags != 0 {
            return Err(Error::Perm);
        }
        Ok(())
    }

    /// Refuses (EPERM) what `set` would change that `ino`'s flags forbid: anything
    /// of an immutable inode. Of an append-only one, as Linux: no size, mode or owner
    /// change and no access time but now; a modification time only forward (the
    /// kernel's writeback cache sends the time of an append as a given time), so
    /// `touch` works and setting an old time does not. A write's loss of setuid is
    /// not refused.
    pub(crate) fn check_setattr_allowed(&mut self, ino: u64, set: &super::SetAttr) -> Result<()> {
        let i = self.get_inode(ino)?;
        let f = i.flags.get();
        if f & inode_flag::IMMUTABLE != 0 {
            return Err(Error::Perm);
        }
        if f & inode_flag::APPEND == 0 {
            return Ok(());
        }
        let at = |t: Option<TimeSet>| match t {
            Some(TimeSet::At(s)) => Some(Timespec::from_system(s)),
            _ => None,
        };
        let key = |t: Timespec| (t.sec.get(), t.nsec.get());
        let back = at(set.mtime).is_some_and(|t| key(t) < key(i.mtime));
        if set.size.is_some()
            || set.mode.is_some()
            || set.uid.is_some()
            || set.gid.is_some()
            || at(set.atime).is_some()
            || back
        {
            return Err(Error::Perm);
        }
        Ok(())
    }

    /// Sets the flags of `ino` (`chattr`); bits outside [`inode_flag::KNOWN`] are
    /// not supported. The change time becomes now.
    pub(crate) fn set_flags(&mut self, ino: u64, flags: u64) -> Result<Attr> {
        if flags & !inode_flag::KNOWN != 0 {
            return Err(Error::NotSupported);
        }
        let mut i = self.get_inode(ino)?;
        i.flags = ((i.flags.get() & !inode_flag::KNOWN) | flags).into();
        i.ctime = Timespec::now();
        self.put_inode(ino, &mut i)?;
        self.attr_of(ino, &i)
    }

    /// Deletes every item of `ino` and drops its extents' references.
    pub(crate) fn free_inode(&mut self, ino: u64) -> Result<()> {
        self.cache.discard(ino, 0, u64::MAX);
        self.pending.remove(&ino);
        self.maps.forget(ino);
        let start = Key::new(ino, 0, 0);
        let end = Key::new(ino + 1, 0, 0);
        loop {
            let batch = self.store.range(tree::FS, &start, &end, 512)?;
            if batch.is_empty() {
                break;
            }
            for (k, v) in batch {
                if k.ty == kind::EXTENT_DATA {
                    let fe = FileExtent::read_from_bytes(&v)
                        .map_err(|_| Error::corrupt("file extent", ino, "bad size"))?;
                    self.store
                        .data_ref(fe.disk_bytenr.get(), fe.disk_len.get(), -1);
                }
                self.store.delete(tree::FS, &k)?;
            }
        }
        self.store.delete(
            tree::FS,
            &Key::new(objectid::ORPHAN, kind::ORPHAN_ITEM, ino),
        )?;
        Ok(())
    }

    /// Marks an unlinked but still open inode, so a crash frees it at the next mount.
    pub(crate) fn add_orphan(&mut self, ino: u64) -> Result<()> {
        self.store.insert(
            tree::FS,
            Key::new(objectid::ORPHAN, kind::ORPHAN_ITEM, ino),
            Vec::new(),
        )
    }

    /// Frees every orphan inode (at mount); returns how many.
    pub(crate) fn free_orphans(&mut self) -> Result<usize> {
        let start = Key::new(objectid::ORPHAN, kind::ORPHAN_ITEM, 0);
        let end = Key::new(objectid::ORPHAN, kind::ORPHAN_ITEM + 1, 0);
        let list = self.store.range(tree::FS, &start, &end, usize::MAX)?;
        for (k, _) in &list {
            self.free_inode(k.offset)?;
        }
        Ok(list.len())
    }
}
