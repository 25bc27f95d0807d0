//! POSIX ACLs: the `system.posix_acl_access` and `system.posix_acl_default` xattrs,
//! kept in step with the mode. The kernel enforces them (FUSE_POSIX_ACL); the
//! filesystem stores them, derives the mode from an access ACL, updates the ACL on
//! chmod, and gives new nodes their parent's default ACL.

use super::Inner;
use crate::error::{Error, Result};

/// The access ACL's xattr name.
pub const ACCESS: &[u8] = b"system.posix_acl_access";
/// The default ACL's xattr name (directories only).
pub const DEFAULT: &[u8] = b"system.posix_acl_default";

const VERSION: u32 = 2;
const USER_OBJ: u16 = 0x01;
const USER: u16 = 0x02;
const GROUP_OBJ: u16 = 0x04;
const GROUP: u16 = 0x08;
const MASK: u16 = 0x10;
const OTHER: u16 = 0x20;

/// One ACL entry: tag, permission bits (rwx), and the uid or gid of named entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    tag: u16,
    perm: u16,
    id: u32,
}

/// A parsed ACL, in the kernel's xattr order (by tag, then id).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Acl(Vec<Entry>);

/// Whether `name` is one of the two ACL xattrs.
pub fn is_acl_name(name: &[u8]) -> bool {
    name == ACCESS || name == DEFAULT
}

impl Acl {
    /// Parses and checks an ACL xattr: version 2, entries sorted, exactly one
    /// USER_OBJ, GROUP_OBJ and OTHER, and a MASK when there are named entries.
    pub(crate) fn parse(v: &[u8]) -> Result<Acl> {
        let bad = || Error::Invalid("malformed POSIX ACL");
        if v.len() < 4 || (v.len() - 4) % 8 != 0 {
            return Err(bad());
        }
        let u16_at = |o: usize| u16::from_le_bytes([v[o], v[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes([v[o], v[o + 1], v[o + 2], v[o + 3]]);
        if u32_at(0) != VERSION {
            return Err(bad());
        }
        let entries: Vec<Entry> = (4..v.len())
            .step_by(8)
            .map(|o| Entry {
                tag: u16_at(o),
                perm: u16_at(o + 2),
                id: u32_at(o + 4),
            })
            .collect();
        let count = |t: u16| entries.iter().filter(|e| e.tag == t).count();
        let named = count(USER) + count(GROUP);
        let known = [USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER];
        if entries
            .iter()
            .any(|e| !known.contains(&e.tag) || e.perm & !7 != 0)
            || count(USER_OBJ) != 1
            || count(GROUP_OBJ) != 1
            || count(OTHER) != 1
            || count(MASK) > 1
            || (named > 0 && count(MASK) == 0)
            || entries
                .windows(2)
                .any(|w| (w[0].tag, w[0].id) >= (w[1].tag, w[1].id) && w[0].tag != USER_OBJ)
        {
            return Err(bad());
        }
        Ok(Acl(entries))
    }

    /// The xattr bytes of the ACL.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = VERSION.to_le_bytes().to_vec();
        for e in &self.0 {
            v.extend_from_slice(&e.tag.to_le_bytes());
            v.extend_from_slice(&e.perm.to_le_bytes());
            v.extend_from_slice(&e.id.to_le_bytes());
        }
        v
    }

    fn perm(&self, tag: u16) -> Option<u16> {
        self.0.iter().find(|e| e.tag == tag).map(|e| e.perm)
    }

    fn set_perm(&mut self, tag: u16, f: impl Fn(u16) -> u16) {
        if let Some(e) = self.0.iter_mut().find(|e| e.tag == tag) {
            e.perm = f(e.perm);
        }
    }

    /// The entry that stands for the group in the mode: MASK, or GROUP_OBJ without one.
    fn group_tag(&self) -> u16 {
        if self.perm(MASK).is_some() {
            MASK
        } else {
            GROUP_OBJ
        }
    }

    /// The permission bits (0o777) the ACL gives the mode: owner from USER_OBJ,
    /// group from MASK (or GROUP_OBJ without one), other from OTHER.
    pub(crate) fn mode_bits(&self) -> u32 {
        let p = |t| u32::from(self.perm(t).unwrap_or(0));
        (p(USER_OBJ) << 6) | (p(self.group_tag()) << 3) | p(OTHER)
    }

    /// Whether the mode alone says all the ACL says (three entries, no mask).
    pub(crate) fn is_minimal(&self) -> bool {
        self.0.len() == 3
    }

    /// Sets the owner, group (see [`Acl::group_tag`]) and other entries to
    /// `f(their perm, the mode's bits for them)`.
    fn apply_mode(&mut self, mode: u32, f: impl Fn(u16, u16) -> u16) {
        let bits = |shift: u32| ((mode >> shift) & 7) as u16;
        let group = self.group_tag();
        for (tag, shift) in [(USER_OBJ, 6), (group, 3), (OTHER, 0)] {
            self.set_perm(tag, |p| f(p, bits(shift)));
        }
    }

    /// chmod: the mode's permission bits go into USER_OBJ, MASK (or GROUP_OBJ
    /// without one) and OTHER (the kernel's posix_acl_chmod).
    pub(crate) fn chmod(&mut self, mode: u32) {
        self.apply_mode(mode, |_, bits| bits);
    }

    /// A new node's access ACL from its parent's default ACL (`self`) and the mode
    /// it was created with: each base entry masked by the mode's bits
    /// (posix_acl_create); gives the ACL and the mode's new permission bits.
    pub(crate) fn for_new_node(&self, mode: u32) -> (Acl, u32) {
        let mut a = self.clone();
        a.apply_mode(mode, |p, bits| p & bits);
        let perms = a.mode_bits();
        (a, perms)
    }
}

/// What a new node gets from its parent: its mode, and the xattrs to store with it.
pub(crate) struct Inherited {
    /// The mode with its permission bits settled.
    pub mode: u32,
    /// (name, value) of the ACLs to store.
    pub xattrs: Vec<(&'static [u8], Vec<u8>)>,
}

impl Inner {
    /// The ACL `name` of `ino`, if it has one.
    fn acl_of(&mut self, ino: u64, name: &[u8]) -> Result<Option<Acl>> {
        match self.getxattr(ino, name) {
            Ok(v) => Acl::parse(&v).map(Some),
            Err(Error::NoData) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The mode and ACLs of a node made in `parent` with `mode` by a caller whose
    /// umask is `umask`: without a default ACL in the parent the umask applies;
    /// with one, the ACL masked by the mode does instead, and a directory inherits
    /// the default ACL itself.
    pub(crate) fn inherit(&mut self, parent: u64, mode: u32, umask: u32) -> Result<Inherited> {
        let Some(def) = self.acl_of(parent, DEFAULT)? else {
            return Ok(Inherited {
                mode: mode & !(umask & 0o777),
                xattrs: Vec::new(),
            });
        };
        let (access, perms) = def.for_new_node(mode);
        let mut xattrs = Vec::new();
        if !access.is_minimal() {
            xattrs.push((ACCESS, access.encode()));
        }
        if mode & libc::S_IFMT == libc::S_IFDIR {
            xattrs.push((DEFAULT, def.encode()));
        }
        Ok(Inherited {
            mode: (mode & !0o777) | perms,
            xattrs,
        })
    }

    /// Sets ACL `name` of `ino` from its xattr bytes. An access ACL sets the mode's
    /// permission bits (and clears S_ISGID unless `keep_sgid`), and is not stored
    /// when the mode says it all.
    pub(crate) fn set_acl(
        &mut self,
        ino: u64,
        name: &[u8],
        value: &[u8],
        keep_sgid: bool,
    ) -> Result<()> {
        let acl = Acl::parse(value)?;
        if name == DEFAULT {
            return self.setxattr(ino, name, &acl.encode(), false, false);
        }
        if acl.is_minimal() {
            match self.removexattr(ino, ACCESS) {
                Ok(()) | Err(Error::NoData) => {}
                Err(e) => return Err(e),
            }
        } else {
            self.setxattr(ino, ACCESS, &acl.encode(), false, false)?;
        }
        // Read after the xattr change, which stored the inode with a new ctime.
        let mut i = self.get_inode(ino)?;
        let kept = if keep_sgid {
            !0o777
        } else {
            !0o777 & !libc::S_ISGID
        };
        i.mode = ((i.mode.get() & kept) | acl.mode_bits()).into();
        i.ctime = crate::format::Timespec::now();
        self.put_inode(ino, &mut i)
    }

    /// After a chmod of `ino` to `mode`: its access ACL, if any, takes the new bits.
    pub(crate) fn chmod_acl(&mut self, ino: u64, mode: u32) -> Result<()> {
        if let Some(mut acl) = self.acl_of(ino, ACCESS)? {
            acl.chmod(mode);
            self.setxattr(ino, ACCESS, &acl.encode(), false, false)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acl(entries: &[(u16, u16, u32)]) -> Vec<u8> {
        let mut v = VERSION.to_le_bytes().to_vec();
        for &(t, p, id) in entries {
            v.extend_from_slice(&t.to_le_bytes());
            v.extend_from_slice(&p.to_le_bytes());
            v.extend_from_slice(&id.to_le_bytes());
        }
        v
    }

    const U: u32 = u32::MAX;

    #[test]
    fn parse_checks_the_entries_and_round_trips() {
        let ok = acl(&[
            (USER_OBJ, 6, U),
            (USER, 7, 1000),
            (GROUP_OBJ, 4, U),
            (MASK, 5, U),
            (OTHER, 0, U),
        ]);
        assert_eq!(Acl::parse(&ok).unwrap().encode(), ok);
        for bad in [
            acl(&[(USER_OBJ, 6, U), (GROUP_OBJ, 4, U)]),
            acl(&[
                (USER_OBJ, 6, U),
                (USER, 7, 1000),
                (GROUP_OBJ, 4, U),
                (OTHER, 0, U),
            ]),
            acl(&[(USER_OBJ, 6, U), (GROUP_OBJ, 4, U), (OTHER, 8, U)]),
            acl(&[
                (USER_OBJ, 6, U),
                (GROUP_OBJ, 4, U),
                (0x40, 0, U),
                (OTHER, 0, U),
            ]),
            acl(&[(GROUP_OBJ, 4, U), (USER_OBJ, 6, U), (OTHER, 0, U)]),
            acl(&[
                (USER_OBJ, 6, U),
                (USER, 7, 9),
                (USER, 7, 3),
                (GROUP_OBJ, 4, U),
                (MASK, 7, U),
                (OTHER, 0, U),
            ]),
            vec![2, 0, 0, 0, 1],
            vec![1, 0, 0, 0],
        ] {
            assert!(Acl::parse(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_mode_follows_the_mask_and_chmod_sets_it() {
        let mut a = Acl::parse(&acl(&[
            (USER_OBJ, 6, U),
            (USER, 7, 1000),
            (GROUP_OBJ, 4, U),
            (MASK, 5, U),
            (OTHER, 1, U),
        ]))
        .unwrap();
        assert_eq!(a.mode_bits(), 0o651);
        assert!(!a.is_minimal());
        a.chmod(0o700);
        assert_eq!(a.mode_bits(), 0o700);
        assert_eq!(
            a.perm(GROUP_OBJ),
            Some(4),
            "chmod changes the mask, not the group"
        );
        assert_eq!(a.perm(USER), Some(7));
        let mut m =
            Acl::parse(&acl(&[(USER_OBJ, 7, U), (GROUP_OBJ, 5, U), (OTHER, 5, U)])).unwrap();
        assert!(m.is_minimal());
        m.chmod(0o640);
        assert_eq!(m.mode_bits(), 0o640);
    }

    #[test]
    fn a_new_node_takes_the_default_acl_masked_by_its_mode() {
        let def = Acl::parse(&acl(&[
            (USER_OBJ, 7, U),
            (USER, 7, 1000),
            (GROUP_OBJ, 5, U),
            (MASK, 7, U),
            (OTHER, 5, U),
        ]))
        .unwrap();
        let (a, perms) = def.for_new_node(0o100644);
        assert_eq!(perms, 0o644);
        assert_eq!(a.perm(USER), Some(7), "named entries stay");
        assert_eq!(a.perm(MASK), Some(4));
        let (_, perms) = def.for_new_node(0o040777);
        assert_eq!(perms, 0o775);
    }
}
