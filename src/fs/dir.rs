//! Directories: entries by name hash (DIR_ITEM), by sequence (DIR_INDEX, readdir
//! order and stable offsets) and back-references (INODE_REF).
//!
//! Every name is in all three places; `check` verifies they agree. A readdir offset is
//! a DIR_INDEX sequence number, so it stays valid while entries come and go.

use super::inode::FileKind;
use super::snapshot::{is_reserved, join, split, SNAPSHOTS_INO};
use super::{Attr, Creds, DirEntryOut, Inner, RenameFlags};
use crate::error::{Error, Result};
use crate::format::{
    decode_dir_entries, decode_inode_extrefs, decode_inode_refs, encode_dir_entries,
    encode_inode_extrefs, encode_inode_refs, extref_hash, inode_flag, kind, name_hash, objectid,
    tree, DirEntry, InodeExtref, InodeItem, InodeRef, Key, Timespec, INCOMPAT_EXTREF, NAME_MAX,
    SYMLINK_MAX,
};

/// A name a directory entry may have (`.` and `..` are the callers' business).
pub(super) fn check_name(name: &[u8]) -> Result<()> {
    if name.len() > NAME_MAX {
        return Err(Error::NameTooLong);
    }
    if name.is_empty() || name.contains(&b'/') || name.contains(&0) {
        return Err(Error::Invalid("bad file name"));
    }
    Ok(())
}

fn dir_item_key(dir: u64, name: &[u8]) -> Key {
    Key::new(dir, kind::DIR_ITEM, name_hash(name))
}

fn dir_index_key(dir: u64, index: u64) -> Key {
    Key::new(dir, kind::DIR_INDEX, index)
}

fn inode_ref_key(ino: u64, parent: u64) -> Key {
    Key::new(ino, kind::INODE_REF, parent)
}

fn extref_key(ino: u64, parent: u64, name: &[u8]) -> Key {
    Key::new(ino, kind::INODE_EXTREF, extref_hash(parent, name))
}

fn is_dir(i: &InodeItem) -> bool {
    i.mode.get() & libc::S_IFMT == libc::S_IFDIR
}

/// The entries of a dir item or dir index of directory `dir`, each naming an inode
/// number a tree can hold (see `snapshot::LIVE_INO_LIMIT`).
fn entries(v: &[u8], dir: u64, what: &'static str) -> Result<Vec<DirEntry>> {
    let list = decode_dir_entries(v).ok_or_else(|| Error::corrupt(what, dir, "malformed"))?;
    match list
        .iter()
        .find(|e| e.ino >= super::snapshot::LIVE_INO_LIMIT)
    {
        Some(e) => Err(Error::corrupt(
            what,
            dir,
            format!("entry names inode {}, past the largest", e.ino),
        )),
        None => Ok(list),
    }
}

impl Inner {
    /// A directory's inode item, or ENOTDIR / ENOENT.
    fn dir_inode(&mut self, dir: u64) -> Result<InodeItem> {
        let d = self.get_inode(dir)?;
        if !is_dir(&d) {
            return Err(Error::NotDir);
        }
        Ok(d)
    }

    pub(crate) fn find_entry(&mut self, dir: u64, name: &[u8]) -> Result<Option<DirEntry>> {
        let (t, local) = split(dir);
        let Some(v) = self.store.search(t, &dir_item_key(local, name))? else {
            return Ok(None);
        };
        let list = entries(&v, dir, "dir item")?;
        Ok(list.into_iter().find(|e| e.name == name).map(|mut e| {
            e.ino = join(t, e.ino);
            e
        }))
    }

    /// The parent of a directory (the root is its own parent).
    pub(crate) fn parent_of(&mut self, dir: u64) -> Result<u64> {
        let (t, local) = split(dir);
        if local == objectid::ROOT_DIR {
            // A snapshot's root sits in `.snapshots`.
            return Ok(if t == tree::FS { dir } else { SNAPSHOTS_INO });
        }
        let r = self.store.range(
            t,
            &Key::new(local, kind::INODE_REF, 0),
            &Key::new(local, kind::INODE_REF + 1, 0),
            1,
        )?;
        r.first()
            .map(|(k, _)| join(t, k.offset))
            .ok_or_else(|| Error::corrupt("inode", dir, "directory without a parent"))
    }

    /// Up to `max` names of `ino`, as (parent, name), from its back-references.
    pub(crate) fn names_of(&mut self, ino: u64, max: usize) -> Result<Vec<(u64, Vec<u8>)>> {
        let (t, local) = split(ino);
        let bad = || Error::corrupt("inode ref", ino, "malformed");
        let mut out = Vec::new();
        let refs = self.store.range(
            t,
            &Key::new(local, kind::INODE_REF, 0),
            &Key::new(local, kind::INODE_REF + 1, 0),
            max,
        )?;
        for (k, v) in refs {
            for r in decode_inode_refs(&v).ok_or_else(bad)? {
                out.push((join(t, k.offset), r.name));
            }
        }
        if out.len() < max {
            let ext = self.store.range(
                t,
                &Key::new(local, kind::INODE_EXTREF, 0),
                &Key::new(local, kind::INODE_EXTREF + 1, 0),
                max - out.len(),
            )?;
            for (_, v) in ext {
                for r in decode_inode_extrefs(&v).ok_or_else(bad)? {
                    out.push((join(t, r.parent), r.name));
                }
            }
        }
        out.truncate(max);
        Ok(out)
    }

    /// Applies `f` to an inode item and writes it back.
    fn update_inode(&mut self, ino: u64, f: impl FnOnce(&mut InodeItem)) -> Result<InodeItem> {
        let mut i = self.get_inode(ino)?;
        f(&mut i);
        self.put_inode(ino, &mut i)?;
        Ok(i)
    }

    /// The entries of live directory `dir` that share `name`'s dir item (its hash).
    fn dir_item(&mut self, dir: u64, name: &[u8]) -> Result<Vec<DirEntry>> {
        match self.store.search(tree::FS, &dir_item_key(dir, name))? {
            Some(v) => entries(&v, dir, "dir item"),
            None => Ok(Vec::new()),
        }
    }

    fn add_entry(&mut self, dir: u64, name: &[u8], ino: u64, dtype: u8) -> Result<()> {
        let mut d = self.get_inode(dir)?;
        let list = self.dir_item(dir, name)?;
        self.add_entry_to(dir, &mut d, list, name, ino, dtype, false)
    }

    /// Adds `name` for `ino` to directory `dir`, given what the caller read under the
    /// same lock: `d`, the directory's inode item (stored here with the change, so
    /// the caller may change it too), and `list`, its dir item for `name`
    /// ([`Inner::dir_item`]). `fresh`: `ino` was just made and has no names yet.
    #[allow(clippy::too_many_arguments)]
    fn add_entry_to(
        &mut self,
        dir: u64,
        d: &mut InodeItem,
        mut list: Vec<DirEntry>,
        name: &[u8],
        ino: u64,
        dtype: u8,
        fresh: bool,
    ) -> Result<()> {
        let now = Timespec::now();
        let index = d.next_index.get();
        d.next_index = (index + 1).into();
        d.size = (d.size.get() + name.len() as u64 * 2).into();
        d.mtime = now;
        d.ctime = now;
        let entry = DirEntry {
            ino,
            dtype,
            index,
            name: name.to_vec(),
        };
        let ik = dir_item_key(dir, name);
        list.push(entry.clone());
        let enc = encode_dir_entries(&list);
        if enc.len() > self.store.max_item_size() {
            return Err(Error::Overflow);
        }
        let (back, extref) = self.back_ref(ino, dir, index, name, fresh)?;
        if extref {
            self.store.use_feature(INCOMPAT_EXTREF);
        }
        self.store.insert(tree::FS, ik, enc)?;
        self.store.insert(
            tree::FS,
            dir_index_key(dir, index),
            encode_dir_entries(&[entry]),
        )?;
        self.store.insert(tree::FS, back.0, back.1)?;
        self.put_inode(dir, d)?;
        // A directory's entries are its data: fdatasync of it needs them.
        self.store.log.mark_data(dir);
        Ok(())
    }

    fn remove_entry(&mut self, dir: u64, name: &[u8]) -> Result<DirEntry> {
        let now = Timespec::now();
        let ik = dir_item_key(dir, name);
        let v = self.store.search(tree::FS, &ik)?.ok_or(Error::NotFound)?;
        let mut list = entries(&v, dir, "dir item")?;
        let pos = list
            .iter()
            .position(|e| e.name == name)
            .ok_or(Error::NotFound)?;
        let e = list.remove(pos);
        if list.is_empty() {
            self.store.delete(tree::FS, &ik)?;
        } else {
            self.store.insert(tree::FS, ik, encode_dir_entries(&list))?;
        }
        self.store.delete(tree::FS, &dir_index_key(dir, e.index))?;
        let rk = inode_ref_key(e.ino, dir);
        let mut found = false;
        if let Some(v) = self.store.search(tree::FS, &rk)? {
            let mut refs = decode_inode_refs(&v)
                .ok_or_else(|| Error::corrupt("inode ref", e.ino, "malformed"))?;
            let had = refs.len();
            refs.retain(|r| r.index != e.index);
            found = refs.len() != had;
            if refs.is_empty() {
                self.store.delete(tree::FS, &rk)?;
            } else if found {
                self.store.insert(tree::FS, rk, encode_inode_refs(&refs))?;
            }
        }
        if !found {
            self.drop_extref(e.ino, dir, e.index, name)?;
        }
        self.update_inode(dir, |d| {
            d.size = d.size.get().saturating_sub(name.len() as u64 * 2).into();
            d.mtime = now;
            d.ctime = now;
        })?;
        self.store.log.mark_data(dir);
        Ok(e)
    }

    /// Refuses (EOVERFLOW) the names `adding` when their dir item, `list` less the
    /// entry named `leaving`, has no room for them.
    ///
    /// `leaving` is removed by the same operation first. Checked before anything
    /// changes, so that no operation is left half done.
    fn check_entry_room(
        &self,
        list: &[DirEntry],
        adding: &[&[u8]],
        leaving: Option<&[u8]>,
    ) -> Result<()> {
        let mut l: Vec<DirEntry> = list
            .iter()
            .filter(|e| Some(e.name.as_slice()) != leaving)
            .cloned()
            .collect();
        l.extend(adding.iter().map(|name| DirEntry {
            ino: 0,
            dtype: 0,
            index: 0,
            name: name.to_vec(),
        }));
        if encode_dir_entries(&l).len() > self.store.max_item_size() {
            return Err(Error::Overflow);
        }
        Ok(())
    }

    /// The item that holds `name` (with `index`) as one of `ino`'s names in `dir`,
    /// with the names it shares, as (key, value) to insert, and whether it is an
    /// extended ref; EMLINK when neither has room.
    ///
    /// It changes nothing: rename calls it before any change, for that check alone.
    /// `fresh`: `ino` was just made and has no names yet.
    fn back_ref(
        &mut self,
        ino: u64,
        dir: u64,
        index: u64,
        name: &[u8],
        fresh: bool,
    ) -> Result<((Key, Vec<u8>), bool)> {
        let rk = inode_ref_key(ino, dir);
        let found = if fresh {
            None
        } else {
            self.store.search(tree::FS, &rk)?
        };
        let mut refs = match found {
            Some(v) => decode_inode_refs(&v)
                .ok_or_else(|| Error::corrupt("inode ref", ino, "malformed"))?,
            None => Vec::new(),
        };
        refs.push(InodeRef {
            index,
            name: name.to_vec(),
        });
        let enc = encode_inode_refs(&refs);
        if enc.len() <= self.store.max_item_size() {
            return Ok(((rk, enc), false));
        }
        // The file's names in this directory fill their item: this one goes to an
        // extended ref of its own (as btrfs's INODE_EXTREF).
        Ok((self.extref_with(ino, dir, index, name)?, true))
    }

    /// The INODE_EXTREF item that holds `name` of `ino` in `dir` (with `index`), with
    /// the names whose hashes it shares, as (key, value) to insert. The first one to
    /// be inserted makes the image's feature flag, which reaches the disk by a commit.
    fn extref_with(
        &mut self,
        ino: u64,
        dir: u64,
        index: u64,
        name: &[u8],
    ) -> Result<(Key, Vec<u8>)> {
        let k = extref_key(ino, dir, name);
        let mut list = match self.store.search(tree::FS, &k)? {
            Some(v) => decode_inode_extrefs(&v)
                .ok_or_else(|| Error::corrupt("inode extref", ino, "malformed"))?,
            None => Vec::new(),
        };
        list.push(InodeExtref {
            parent: dir,
            index,
            name: name.to_vec(),
        });
        let enc = encode_inode_extrefs(&list);
        if enc.len() > self.store.max_item_size() {
            return Err(Error::TooManyLinks);
        }
        Ok((k, enc))
    }

    /// Removes the extended ref of `ino`'s name `name` (with `index`) in `dir`.
    fn drop_extref(&mut self, ino: u64, dir: u64, index: u64, name: &[u8]) -> Result<()> {
        let k = extref_key(ino, dir, name);
        let Some(v) = self.store.search(tree::FS, &k)? else {
            return Ok(());
        };
        let mut list = decode_inode_extrefs(&v)
            .ok_or_else(|| Error::corrupt("inode extref", ino, "malformed"))?;
        list.retain(|x| !(x.parent == dir && x.index == index));
        if list.is_empty() {
            self.store.delete(tree::FS, &k)?;
        } else {
            self.store
                .insert(tree::FS, k, encode_inode_extrefs(&list))?;
        }
        Ok(())
    }

    pub(crate) fn lookup(&mut self, parent: u64, name: &[u8]) -> Result<Attr> {
        if name.len() > NAME_MAX {
            return Err(Error::NameTooLong);
        }
        if name == b"." {
            // Any inode: the kernel looks up "." of a node id to decode a file handle
            // (NFS export, open_by_handle_at) of a file as well as a directory.
            return self.getattr(parent);
        }
        if parent == SNAPSHOTS_INO {
            return self.lookup_snapshot(name);
        }
        if is_reserved(parent, name) {
            return self.snapshots_dir_attr();
        }
        self.dir_inode(parent)?;
        let ino = match name {
            b"." => parent,
            b".." => self.parent_of(parent)?,
            _ => self.find_entry(parent, name)?.ok_or(Error::NotFound)?.ino,
        };
        self.getattr(ino)
    }

    /// Makes a node `name` in `parent`, owned by `cr`, except that under a setgid
    /// directory it takes the directory's group (and a new directory its setgid bit),
    /// as on a kernel filesystem.
    pub(crate) fn create_node(
        &mut self,
        parent: u64,
        name: &[u8],
        mode: u32,
        rdev: u64,
        cr: Creds,
        target: Option<&[u8]>,
    ) -> Result<Attr> {
        self.make_node(parent, name, mode, rdev, cr, target, true)
    }

    /// [`Inner::create_node`]; without `check_room`, for a caller that checked for
    /// room before changes of its own.
    #[allow(clippy::too_many_arguments)]
    fn make_node(
        &mut self,
        parent: u64,
        name: &[u8],
        mode: u32,
        rdev: u64,
        cr: Creds,
        target: Option<&[u8]>,
        check_room: bool,
    ) -> Result<Attr> {
        check_name(name)?;
        let mut p = self.dir_inode(parent)?;
        if p.nlink.get() == 0 {
            return Err(Error::NotFound);
        }
        if p.flags.get() & inode_flag::IMMUTABLE != 0 {
            return Err(Error::Perm);
        }
        if name == b"." || name == b".." || is_reserved(parent, name) {
            return Err(Error::Exists);
        }
        let list = self.dir_item(parent, name)?;
        if list.iter().any(|e| e.name == name) {
            return Err(Error::Exists);
        }
        let (cr, mode) = if p.mode.get() & libc::S_ISGID != 0 {
            let dir = mode & libc::S_IFMT == libc::S_IFDIR;
            let cr = Creds {
                gid: p.gid.get(),
                ..cr
            };
            (cr, if dir { mode | libc::S_ISGID } else { mode })
        } else {
            (cr, mode)
        };
        if let Some(t) = target {
            if t.is_empty() {
                return Err(Error::NotFound);
            }
            // The target is one item: with small nodes it is shorter than PATH_MAX.
            if t.len() > SYMLINK_MAX.min(self.store.max_item_size()) {
                return Err(Error::NameTooLong);
            }
        }
        if check_room {
            self.need_room()?;
        }
        self.check_entry_room(&list, &[name], None)?;
        let mode = if mode & libc::S_IFMT == 0 {
            mode | libc::S_IFREG
        } else {
            mode
        };
        let kind = FileKind::from_mode(mode).ok_or(Error::Invalid("bad file type"))?;
        let (ino, mut item) = self.new_inode(mode, rdev, cr.uid, cr.gid)?;
        if let Some(t) = target {
            self.store
                .insert(tree::FS, Key::new(ino, kind::SYMLINK, 0), t.to_vec())?;
            item.size = (t.len() as u64).into();
            self.put_inode(ino, &mut item)?;
        }
        if kind == FileKind::Dir {
            p.nlink = (p.nlink.get() + 1).into();
        }
        self.add_entry_to(parent, &mut p, list, name, ino, kind.dtype(), true)?;
        // A new inode and its name are what any read of it needs first.
        self.store.log.mark_data(ino);
        self.attr_of(ino, &item)
    }

    pub(crate) fn readlink(&mut self, ino: u64) -> Result<Vec<u8>> {
        let i = self.get_inode(ino)?;
        if i.mode.get() & libc::S_IFMT != libc::S_IFLNK {
            return Err(Error::Invalid("not a symlink"));
        }
        let (t, local) = split(ino);
        self.store
            .search(t, &Key::new(local, kind::SYMLINK, 0))?
            .ok_or_else(|| Error::corrupt("symlink", ino, "target missing"))
    }

    pub(crate) fn link(&mut self, ino: u64, parent: u64, name: &[u8]) -> Result<Attr> {
        check_name(name)?;
        let i = self.get_inode(ino)?;
        if is_dir(&i) {
            return Err(Error::Perm);
        }
        if i.nlink.get() == 0 {
            return Err(Error::NotFound);
        }
        if i.flags.get() & super::FIXED != 0 {
            return Err(Error::Perm);
        }
        if i.nlink.get() >= 65000 {
            return Err(Error::TooManyLinks);
        }
        let p = self.dir_inode(parent)?;
        if p.nlink.get() == 0 {
            return Err(Error::NotFound);
        }
        if p.flags.get() & inode_flag::IMMUTABLE != 0 {
            return Err(Error::Perm);
        }
        if name == b"."
            || name == b".."
            || is_reserved(parent, name)
            || self.find_entry(parent, name)?.is_some()
        {
            return Err(Error::Exists);
        }
        self.need_room()?;
        let dtype = self.attr_of(ino, &i)?.kind.dtype();
        self.add_entry(parent, name, ino, dtype)?;
        let i = self.update_inode(ino, |i| {
            i.nlink = (i.nlink.get() + 1).into();
            i.ctime = Timespec::now();
        })?;
        self.attr_of(ino, &i)
    }

    fn dir_is_empty(&mut self, dir: u64) -> Result<bool> {
        Ok(self
            .store
            .range(
                tree::FS,
                &Key::new(dir, kind::DIR_INDEX, 0),
                &Key::new(dir, kind::DIR_INDEX + 1, 0),
                1,
            )?
            .is_empty())
    }

    /// Drops one link of `ino` (already removed from its directory); a directory loses
    /// both of its links. Frees the inode at zero unless it is pinned.
    fn drop_link(&mut self, ino: u64) -> Result<()> {
        let mut i = self.get_inode(ino)?;
        let n = if is_dir(&i) {
            0
        } else {
            i.nlink.get().saturating_sub(1)
        };
        i.nlink = n.into();
        i.ctime = Timespec::now();
        if n == 0 && !self.pinned(ino) {
            return self.free_inode(ino);
        }
        if n == 0 {
            // Before the item is stored: should that or the orphan item fail, the
            // last release still looks (and frees it only at no links).
            self.open_orphans.insert(ino);
        }
        self.put_inode(ino, &mut i)?;
        if n == 0 {
            self.add_orphan(ino)?;
        }
        Ok(())
    }

    /// The index the next entry made in directory `ino` will get.
    pub(crate) fn next_dir_index(&mut self, ino: u64) -> Result<u64> {
        Ok(self.dir_inode(ino)?.next_index.get())
    }

    pub(crate) fn unlink(&mut self, parent: u64, name: &[u8], rmdir: bool) -> Result<()> {
        if name.len() > NAME_MAX {
            return Err(Error::NameTooLong);
        }
        let pi = self.dir_inode(parent)?;
        if is_reserved(parent, name) {
            return Err(Error::Perm);
        }
        if rmdir && name == b"." {
            return Err(Error::Invalid("rmdir of ."));
        }
        if rmdir && name == b".." {
            return Err(Error::NotEmpty);
        }
        let e = self.find_entry(parent, name)?.ok_or(Error::NotFound)?;
        let child = self.get_inode(e.ino)?;
        if (pi.flags.get() | child.flags.get()) & super::FIXED != 0 {
            return Err(Error::Perm);
        }
        if rmdir {
            if !is_dir(&child) {
                return Err(Error::NotDir);
            }
            if !self.dir_is_empty(e.ino)? {
                return Err(Error::NotEmpty);
            }
        } else if is_dir(&child) {
            return Err(Error::IsDir);
        }
        self.remove_entry(parent, name)?;
        if rmdir {
            self.update_inode(parent, |p| {
                p.nlink = (p.nlink.get().saturating_sub(1)).into()
            })?;
        }
        self.drop_link(e.ino)
    }

    fn is_ancestor(&mut self, anc: u64, mut dir: u64) -> Result<bool> {
        for _ in 0..100_000 {
            if dir == anc {
                return Ok(true);
            }
            if dir == objectid::ROOT_DIR {
                return Ok(false);
            }
            dir = self.parent_of(dir)?;
        }
        Err(Error::corrupt("directory", dir, "parent chain loops"))
    }

    /// Refuses (EPERM) a rename that inode flags forbid: taking `src` out of
    /// directory `p`, or replacing `dst` in `np`, when either the name or its
    /// directory is immutable or append-only; adding a name to an immutable `np`.
    fn check_rename_allowed(&mut self, p: u64, src: u64, np: u64, dst: Option<u64>) -> Result<()> {
        self.refuse_if_flagged(p, super::FIXED)?;
        self.refuse_if_flagged(src, super::FIXED)?;
        match dst {
            Some(d) => {
                self.refuse_if_flagged(np, super::FIXED)?;
                self.refuse_if_flagged(d, super::FIXED)
            }
            None => self.refuse_if_flagged(np, inode_flag::IMMUTABLE),
        }
    }

    /// Renames `n` in `p` to `nn` in `np` and leaves a whiteout (a 0/0 character
    /// device) in its place (RENAME_WHITEOUT). The room for the whiteout, in space
    /// and in its dir item, is checked first, so that the rename never stands without
    /// it.
    pub(crate) fn rename_whiteout(
        &mut self,
        p: u64,
        n: &[u8],
        np: u64,
        nn: &[u8],
        noreplace: bool,
        cr: Creds,
    ) -> Result<()> {
        check_name(n)?;
        check_name(nn)?;
        self.need_room()?;
        // The whiteout's dir item as the rename leaves it: without `n`, and with `nn`
        // when that lands in it (new there).
        let list = self.dir_item(p, n)?;
        let lands = np == p
            && dir_item_key(p, nn) == dir_item_key(p, n)
            && !list.iter().any(|e| e.name == nn);
        let adding: &[&[u8]] = if lands { &[nn, n] } else { &[n] };
        self.check_entry_room(&list, adding, Some(n))?;
        let flags = RenameFlags {
            noreplace,
            exchange: false,
        };
        self.rename(p, n, np, nn, flags)?;
        self.make_node(p, n, libc::S_IFCHR, 0, cr, None, false)
            .map(|_| ())
    }

    pub(crate) fn rename(
        &mut self,
        p: u64,
        n: &[u8],
        np: u64,
        nn: &[u8],
        flags: RenameFlags,
    ) -> Result<()> {
        check_name(n)?;
        check_name(nn)?;
        if flags.exchange && flags.noreplace {
            return Err(Error::Invalid("NOREPLACE with EXCHANGE"));
        }
        if is_reserved(p, n) || is_reserved(np, nn) {
            return Err(Error::Perm);
        }
        self.dir_inode(p)?;
        let npi = self.dir_inode(np)?;
        if n == b"." || n == b".." || nn == b"." || nn == b".." {
            return Err(Error::Invalid("rename of . or .."));
        }
        let src = self.find_entry(p, n)?.ok_or(Error::NotFound)?;
        let dst = self.find_entry(np, nn)?;
        if flags.exchange && dst.is_none() {
            return Err(Error::NotFound);
        }
        if let Some(d) = &dst {
            if flags.noreplace {
                return Err(Error::Exists);
            }
            if d.ino == src.ino {
                return Ok(());
            }
        }
        self.check_rename_allowed(p, src.ino, np, dst.as_ref().map(|d| d.ino))?;
        let src_dir = src.dtype == libc::DT_DIR;
        let dst_dir = dst.as_ref().is_some_and(|d| d.dtype == libc::DT_DIR);
        if src_dir && p != np && self.is_ancestor(src.ino, np)? {
            return Err(Error::Invalid("directory into its own subtree"));
        }
        if flags.exchange && dst_dir && p != np && self.is_ancestor(dst.as_ref().unwrap().ino, p)? {
            return Err(Error::Invalid("directory into its own subtree"));
        }
        if npi.nlink.get() == 0 {
            return Err(Error::NotFound);
        }
        self.need_room()
            .or_else(|e| if dst.is_some() { Ok(()) } else { Err(e) })?;
        let now = Timespec::now();
        if flags.exchange {
            let d = dst.unwrap();
            // The names stay, so their dir items keep their sizes; each inode's new
            // name must fit among its names before anything changes.
            self.back_ref(d.ino, p, 0, n, false)?;
            self.back_ref(src.ino, np, 0, nn, false)?;
            self.remove_entry(p, n)?;
            self.remove_entry(np, nn)?;
            self.add_entry(p, n, d.ino, d.dtype)?;
            self.add_entry(np, nn, src.ino, src.dtype)?;
            if p != np && src_dir != dst_dir {
                let (from, to) = if src_dir { (p, np) } else { (np, p) };
                self.update_inode(from, |i| i.nlink = (i.nlink.get() - 1).into())?;
                self.update_inode(to, |i| i.nlink = (i.nlink.get() + 1).into())?;
            }
            self.update_inode(src.ino, |i| i.ctime = now)?;
            self.update_inode(d.ino, |i| i.ctime = now)?;
            return Ok(());
        }
        if let Some(d) = &dst {
            if src_dir && !dst_dir {
                return Err(Error::NotDir);
            }
            if !src_dir && dst_dir {
                return Err(Error::IsDir);
            }
            if dst_dir && !self.dir_is_empty(d.ino)? {
                return Err(Error::NotEmpty);
            }
        } else {
            // A replaced entry leaves room for its successor; a new one needs it.
            let list = self.dir_item(np, nn)?;
            self.check_entry_room(&list, &[nn], (p == np).then_some(n))?;
        }
        self.back_ref(src.ino, np, 0, nn, false)?;
        if let Some(d) = &dst {
            self.remove_entry(np, nn)?;
            if dst_dir {
                self.update_inode(np, |i| i.nlink = (i.nlink.get() - 1).into())?;
            }
            self.drop_link(d.ino)?;
        }
        self.remove_entry(p, n)?;
        self.add_entry(np, nn, src.ino, src.dtype)?;
        if src_dir && p != np {
            self.update_inode(p, |i| i.nlink = (i.nlink.get() - 1).into())?;
            self.update_inode(np, |i| i.nlink = (i.nlink.get() + 1).into())?;
        }
        self.update_inode(src.ino, |i| i.ctime = now)?;
        Ok(())
    }

    /// Up to `max` entries of `ino` from `offset`, leaving out those whose index is
    /// `end` or more (entries made after an opendir that saw `end` as next index).
    pub(crate) fn readdir(
        &mut self,
        ino: u64,
        offset: u64,
        max: usize,
        end: u64,
    ) -> Result<Vec<DirEntryOut>> {
        if ino == SNAPSHOTS_INO {
            return self.readdir_snapshots(offset, max);
        }
        self.dir_inode(ino)?;
        let mut out = Vec::new();
        if offset == 0 && out.len() < max {
            out.push(DirEntryOut {
                ino,
                kind: FileKind::Dir,
                name: b".".to_vec(),
                next_offset: 1,
            });
        }
        if offset <= 1 && out.len() < max {
            let parent = self.parent_of(ino)?;
            out.push(DirEntryOut {
                ino: parent,
                kind: FileKind::Dir,
                name: b"..".to_vec(),
                next_offset: 2,
            });
        }
        let want = max - out.len();
        if want == 0 {
            return Ok(out);
        }
        let (t, local) = split(ino);
        let items = self.store.range(
            t,
            &dir_index_key(local, offset.max(3)),
            &match end {
                u64::MAX => Key::new(local, kind::DIR_INDEX + 1, 0),
                e => dir_index_key(local, e),
            },
            want,
        )?;
        for (k, v) in items {
            let mut l = entries(&v, ino, "dir index")?;
            let (Some(e), true) = (l.pop(), l.is_empty()) else {
                return Err(Error::corrupt("dir index", ino, "malformed"));
            };
            let kind = FileKind::from_dtype(e.dtype)
                .ok_or_else(|| Error::corrupt("dir index", ino, "bad type"))?;
            out.push(DirEntryOut {
                ino: join(t, e.ino),
                kind,
                name: e.name,
                next_offset: k.offset + 1,
            });
        }
        Ok(out)
    }
}
