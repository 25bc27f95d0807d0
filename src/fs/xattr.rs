//! Extended attributes: XATTR_ITEMs keyed by name hash, each a list of (name, value).

use super::Inner;
use crate::error::{Error, Result};
use crate::format::{
    decode_xattrs, encode_xattrs, kind, name_hash, tree, Key, Timespec, XattrEntry,
};

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
        self.get_inode(ino)?;
        let mut list = self.xattr_list(ino, name)?;
        let pos = list.iter().position(|e| e.name == name);
        match (pos, create, replace) {
            (Some(_), true, _) => return Err(Error::Exists),
            (None, _, true) => return Err(Error::NoData),
            _ => {}
        }
        self.need_room()?;
        let e = XattrEntry {
            name: name.to_vec(),
            value: value.to_vec(),
        };
        match pos {
            Some(p) => list[p] = e,
            None => list.push(e),
        }
        let enc = encode_xattrs(&list);
        if enc.len() > self.store.max_item_size() {
            return Err(Error::NoSpace);
        }
        self.store.insert(tree::FS, xattr_key(ino, name), enc)?;
        self.touch_ctime(ino)
    }

    pub(crate) fn getxattr(&mut self, ino: u64, name: &[u8]) -> Result<Vec<u8>> {
        Self::check_xattr_name(name)?;
        if ino == super::SNAPSHOTS_INO {
            return Err(Error::NoData);
        }
        self.get_inode(ino)?;
        self.xattr_list(ino, name)?
            .into_iter()
            .find(|e| e.name == name)
            .map(|e| e.value)
            .ok_or(Error::NoData)
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
        list.remove(pos);
        let k = xattr_key(ino, name);
        if list.is_empty() {
            self.store.delete(tree::FS, &k)?;
        } else {
            self.store.insert(tree::FS, k, encode_xattrs(&list))?;
        }
        self.touch_ctime(ino)
    }
}
