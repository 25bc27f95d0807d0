//! Extended attributes: XATTR_ITEMs keyed by name hash, each a list of (name, value).
//!
//! A value too large for its item (more than about 7 KiB with 16 KiB nodes, up to
//! Linux's 64 KiB) goes into XATTR_CHUNK items of its own, each as large as an item
//! may be, keyed by a base plus the chunk's index; the entry names the base and the
//! length. The base is the name's hash with its low 16 bits clear, moved on by
//! 2^16 while another value's chunks are there, so two names never share chunks.

use super::Inner;
use crate::error::{Error, Result};
use crate::format::{
    decode_xattrs, encode_xattrs, kind, name_hash, tree, Key, Timespec, XattrEntry,
    INCOMPAT_XATTR_CHUNKS, XATTR_SIZE_MAX,
};

/// Chunk indexes one value's base leaves room for.
const CHUNK_SPAN: u64 = 1 << 16;

/// The keys of the chunks a value at `base` may have: from the first to the end.
fn chunk_range(ino: u64, base: u64) -> (Key, Key) {
    let start = Key::new(ino, kind::XATTR_CHUNK, base);
    let end = match base.checked_add(CHUNK_SPAN) {
        Some(e) => Key::new(ino, kind::XATTR_CHUNK, e),
        None => Key::new(ino, kind::XATTR_CHUNK + 1, 0),
    };
    (start, end)
}

/// Longest xattr name, as Linux limits it.
const XATTR_NAME_MAX: usize = 255;

fn xattr_key(ino: u64, name: &[u8]) -> Key {
    Key::new(ino, kind::XATTR_ITEM, name_hash(name))
}

impl Inner {
    fn xattr_list(&mut self, ino: u64, name: &[u8]) -> Result<Vec<XattrEntry>> {
        let (t, local) = super::snapshot::split(ino);
        match self.store.search(t, &xattr_key(local, name))? {
            None => Ok(Vec::new()),
            Some(v) => {
                decode_xattrs(&v).ok_or_else(|| Error::corrupt("xattr item", ino, "malformed"))
            }
        }
    }

    fn check_xattr_name(name: &[u8]) -> Result<()> {
        if name.is_empty() {
            return Err(Error::Invalid("empty xattr name"));
        }
        if name.len() > XATTR_NAME_MAX {
            return Err(Error::Range);
        }
        Ok(())
    }

    /// A name that a new xattr may take: in the `user.`, `trusted.` or `security.`
    /// namespace with a name after the prefix, or a POSIX ACL. Any other (no
    /// namespace, a `system.` one birchfs does not know) is EOPNOTSUPP, as a kernel
    /// filesystem's xattr handlers answer; a bare prefix is EINVAL.
    fn check_new_xattr_name(name: &[u8]) -> Result<()> {
        if super::acl::is_acl_name(name) {
            return Ok(());
        }
        let rest = [&b"user."[..], b"trusted.", b"security."]
            .iter()
            .find_map(|p| name.strip_prefix(*p));
        match rest {
            None => Err(Error::NotSupported),
            Some([]) => Err(Error::Invalid(
                "xattr name with nothing after its namespace",
            )),
            Some(_) => Ok(()),
        }
    }

    fn touch_ctime(&mut self, ino: u64) -> Result<()> {
        let mut i = self.get_inode(ino)?;
        i.ctime = Timespec::now();
        self.put_inode(ino, &mut i)
    }

    pub(crate) fn setxattr(
        &mut self,
        ino: u64,
        name: &[u8],
        value: &[u8],
        create: bool,
        replace: bool,
    ) -> Result<()> {
        Self::check_xattr_name(name)?;
        Self::check_new_xattr_name(name)?;
        if value.len() > XATTR_SIZE_MAX {
            return Err(Error::ArgTooBig);
        }
        self.get_inode(ino)?;
        let mut list = self.xattr_list(ino, name)?;
        let pos = list.iter().position(|e| e.name == name);
        match (pos, create, replace) {
            (Some(_), true, _) => return Err(Error::Exists),
            (None, _, true) => return Err(Error::NoData),
            _ => {}
        }
        self.need_room()?;
        let old = pos.and_then(|p| list[p].chunks);
        let p = match pos {
            Some(p) => p,
            None => {
                list.push(XattrEntry {
                    name: name.to_vec(),
                    value: Vec::new(),
                    chunks: None,
                });
                list.len() - 1
            }
        };
        list[p].value = value.to_vec();
        list[p].chunks = None;
        let max = self.store.max_item_size();
        let mut enc = encode_xattrs(&list);
        let mut written = None;
        if enc.len() > max {
            // Too large for the item: the value goes into chunks of its own.
            let base = self.free_chunk_base(ino, name, old.map(|(b, _)| b))?;
            list[p].value = Vec::new();
            list[p].chunks = Some((base, value.len() as u32));
            enc = encode_xattrs(&list);
            if enc.len() > max {
                // The names that share this one's hash fill their item.
                return Err(Error::Overflow);
            }
            self.write_chunks(ino, base, value, max)?;
            self.store.use_feature(INCOMPAT_XATTR_CHUNKS);
            written = Some(base);
        }
        if let Err(e) = self.store.insert(tree::FS, xattr_key(ino, name), enc) {
            if let Some(base) = written {
                let _ = self.delete_chunks(ino, base);
            }
            return Err(e);
        }
        if let Some((base, _)) = old {
            self.delete_chunks(ino, base)?;
        }
        self.touch_ctime(ino)
    }

    /// A base for new chunks of `name`'s value on `ino`: one no other value's chunks
    /// use, and not `avoid` (the value's old chunks, deleted only once the new ones
    /// are in place).
    fn free_chunk_base(&mut self, ino: u64, name: &[u8], avoid: Option<u64>) -> Result<u64> {
        let mut base = name_hash(name) & !(CHUNK_SPAN - 1);
        loop {
            let (start, end) = chunk_range(ino, base);
            if Some(base) != avoid && self.store.range(tree::FS, &start, &end, 1)?.is_empty() {
                return Ok(base);
            }
            base = base.wrapping_add(CHUNK_SPAN);
        }
    }

    /// Writes `value` as chunks of at most `max` bytes from `base`; on an error,
    /// removes the ones written.
    fn write_chunks(&mut self, ino: u64, base: u64, value: &[u8], max: usize) -> Result<()> {
        for (i, piece) in value.chunks(max).enumerate() {
            let k = Key::new(ino, kind::XATTR_CHUNK, base + i as u64);
            if let Err(e) = self.store.insert(tree::FS, k, piece.to_vec()) {
                let _ = self.delete_chunks(ino, base);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Deletes the chunks of the value at `base`.
    fn delete_chunks(&mut self, ino: u64, base: u64) -> Result<()> {
        let (start, end) = chunk_range(ino, base);
        for (k, _) in self.store.range(tree::FS, &start, &end, usize::MAX)? {
            self.store.delete(tree::FS, &k)?;
        }
        Ok(())
    }

    /// The value of entry `e` of `ino`: its own, or read from its chunks.
    fn xattr_value(&mut self, ino: u64, e: XattrEntry) -> Result<Vec<u8>> {
        let Some((base, len)) = e.chunks else {
            return Ok(e.value);
        };
        let (t, local) = super::snapshot::split(ino);
        let (start, end) = chunk_range(local, base);
        let mut value = Vec::with_capacity((len as usize).min(XATTR_SIZE_MAX));
        for (i, (k, v)) in self
            .store
            .range(t, &start, &end, usize::MAX)?
            .into_iter()
            .enumerate()
        {
            if k.offset != base.wrapping_add(i as u64) {
                return Err(Error::corrupt("xattr chunk", ino, "missing chunk"));
            }
            value.extend_from_slice(&v);
        }
        if value.len() != len as usize {
            return Err(Error::corrupt("xattr chunk", ino, "wrong length"));
        }
        Ok(value)
    }

    pub(crate) fn getxattr(&mut self, ino: u64, name: &[u8]) -> Result<Vec<u8>> {
        Self::check_xattr_name(name)?;
        if ino == super::SNAPSHOTS_INO {
            return Err(Error::NoData);
        }
        self.get_inode(ino)?;
        let e = self
            .xattr_list(ino, name)?
            .into_iter()
            .find(|e| e.name == name)
            .ok_or(Error::NoData)?;
        self.xattr_value(ino, e)
    }

    pub(crate) fn listxattr(&mut self, ino: u64) -> Result<Vec<Vec<u8>>> {
        if ino == super::SNAPSHOTS_INO {
            return Ok(Vec::new());
        }
        self.get_inode(ino)?;
        let (t, local) = super::snapshot::split(ino);
        let items = self.store.range(
            t,
            &Key::new(local, kind::XATTR_ITEM, 0),
            &Key::new(local, kind::XATTR_ITEM + 1, 0),
            usize::MAX,
        )?;
        let mut names = Vec::new();
        for (_, v) in items {
            let l =
                decode_xattrs(&v).ok_or_else(|| Error::corrupt("xattr item", ino, "malformed"))?;
            names.extend(l.into_iter().map(|e| e.name));
        }
        Ok(names)
    }

    pub(crate) fn removexattr(&mut self, ino: u64, name: &[u8]) -> Result<()> {
        Self::check_xattr_name(name)?;
        self.get_inode(ino)?;
        let mut list = self.xattr_list(ino, name)?;
        let pos = list
            .iter()
            .position(|e| e.name == name)
            .ok_or(Error::NoData)?;
        let gone = list.remove(pos);
        let k = xattr_key(ino, name);
        if list.is_empty() {
            self.store.delete(tree::FS, &k)?;
        } else {
            self.store.insert(tree::FS, k, encode_xattrs(&list))?;
        }
        if let Some((base, _)) = gone.chunks {
            self.delete_chunks(ino, base)?;
        }
        self.touch_ctime(ino)
    }
}
