//! Writing a restored namespace out into a directory.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::at::{check, create_file, LongPaths};
use super::namespace::Namespace;
use super::Restored;
use crate::dev::BlockDev;
use crate::error::{Error, Result};
use crate::format::{
    objectid, InodeItem, Timespec, BLOCK_SIZE, FILE_EXTENT_REG, NAME_MAX, SYMLINK_MAX,
};

/// Why `dest` cannot take a restore ("is not empty", "is not a directory"), if it
/// cannot; a restore writes into a new or empty directory, never among other files.
pub fn unfit_dest(dest: &Path) -> Option<&'static str> {
    match std::fs::read_dir(dest) {
        Ok(mut d) => d.next().is_some().then_some("is not empty"),
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => Some("is not a directory"),
        Err(_) => None,
    }
}

/// Creates `dest`, or checks that it is an empty directory.
pub(super) fn make_dest(dest: &Path) -> Result<()> {
    if let Some(why) = unfit_dest(dest) {
        return Err(Error::Io(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{} {why}", dest.display()),
        )));
    }
    match std::fs::create_dir(dest) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(Error::Io(io::Error::new(
            e.kind(),
            format!("cannot create {}: {e}", dest.display()),
        ))),
    }
}

pub(super) fn geteuid_is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Writes a namespace out under the destination.
pub(super) struct Writer<'a> {
    dev: &'a dyn BlockDev,
    total_bytes: u64,
    ns: &'a Namespace,
    csums: &'a BTreeMap<u64, Vec<u8>>,
    pub(super) rep: Restored,
    /// Every path written, as a tree.
    names: Names,
    /// Inode -> where it was first written.
    placed: HashMap<u64, Name>,
    /// Inodes a name reached but that could not be written there.
    failed: HashSet<u64>,
    /// Directories made, in order, for their attributes at the end.
    dirs: Vec<(u64, Name)>,
    /// Directories whose entries are still to write.
    stack: Vec<(u64, Name)>,
    /// Whether owners can be set.
    root: bool,
    /// The way to paths longer than PATH_MAX.
    long: LongPaths,
}

impl<'a> Writer<'a> {
    /// A writer of `ns`, whose data is on `dev`.
    pub(super) fn new(
        dev: &'a dyn BlockDev,
        total_bytes: u64,
        ns: &'a Namespace,
        csums: &'a BTreeMap<u64, Vec<u8>>,
        rep: Restored,
    ) -> Writer<'a> {
        Writer {
            dev,
            total_bytes,
            ns,
            csums,
            rep,
            names: Names::default(),
            placed: HashMap::new(),
            failed: HashSet::new(),
            dirs: Vec::new(),
            stack: Vec::new(),
            root: geteuid_is_root(),
            long: LongPaths::default(),
        }
    }

    /// Writes everything out under `dest`, which exists and is empty.
    pub(super) fn run(&mut self, dest: &Path) {
        if !self.ns.inodes.contains_key(&objectid::ROOT_DIR) {
            self.rep
                .problem("the root directory's inode is lost; its attributes are not set".into());
        }
        let root = self.names.add(None, dest.as_os_str());
        self.placed.insert(objectid::ROOT_DIR, root);
        self.dirs.push((objectid::ROOT_DIR, root));
        self.stack.push((objectid::ROOT_DIR, root));
        self.drain();
        self.lost_and_found(dest);
        // Directories' attributes last (their children changed their times), deepest
        // first (a read-only directory would refuse the ones below it).
        for (ino, n) in std::mem::take(&mut self.dirs).into_iter().rev() {
            if let Some(i) = self.ns.inodes.get(&ino) {
                let p = self.names.path(n);
                self.attrs(&p, ino, i, false);
            }
        }
    }

    fn drain(&mut self) {
        while let Some((dir, at)) = self.stack.pop() {
            let Some(entries) = self.ns.entries.get(&dir) else {
                continue;
            };
            for (name, &ino) in entries {
                if !name_ok(name) {
                    self.rep.problem(format!(
                        "{}: entry {:?} is no valid name; skipped",
                        self.names.path(at).display(),
                        String::from_utf8_lossy(name)
                    ));
                    continue;
                }
                let n = self.names.add(Some(at), OsStr::from_bytes(name));
                self.place(ino, n);
            }
        }
    }

    /// Inodes nothing readable names, under `lost+found/#INO`: directories no other
    /// lost directory holds first (with what they hold), then the rest.
    fn lost_and_found(&mut self, dest: &Path) {
        let ns = self.ns;
        let lost = |w: &Self, ino: &u64| {
            *ino != objectid::ROOT_DIR
                && !w.placed.contains_key(ino)
                && !w.failed.contains(ino)
                && !ns.orphans.contains(ino)
        };
        let lost_dirs: Vec<u64> = ns
            .inodes
            .iter()
            .filter(|(ino, i)| lost(self, ino) && is_dir(i))
            .map(|(&ino, _)| ino)
            .collect();
        let held: HashSet<u64> = lost_dirs
            .iter()
            .filter_map(|d| ns.entries.get(d))
            .flat_map(|e| e.values().copied())
            .collect();
        let order: Vec<u64> = lost_dirs
            .iter()
            .filter(|d| !held.contains(d))
            .chain(lost_dirs.iter().filter(|d| held.contains(d)))
            .chain(
                ns.inodes
                    .iter()
                    .filter(|(_, i)| !is_dir(i))
                    .map(|(ino, _)| ino),
            )
            .copied()
            .collect();
        if !order.iter().any(|ino| lost(self, ino)) {
            return;
        }
        let lf = match lost_found_dir(dest) {
            Ok(p) => p,
            Err(e) => {
                self.rep.problem(format!(
                    "cannot make a lost+found in {}: {e}; lost inodes not restored",
                    dest.display()
                ));
                return;
            }
        };
        for ino in order {
            if !lost(self, &ino) {
                continue;
            }
            self.rep.lost_found += 1;
            let p = lf.join(format!("#{ino}"));
            self.rep.problem(format!(
                "inode {ino}: no name left; restored as {}",
                p.display()
            ));
            let n = self.names.add(None, p.as_os_str());
            self.place(ino, n);
            self.drain();
        }
    }

    /// Makes inode `ino` at `name`.
    fn place(&mut self, ino: u64, name: Name) {
        let ns = self.ns;
        let path = self.names.path(name);
        let p = path.as_path();
        let Some(inode) = ns.inodes.get(&ino) else {
            self.rep.problem(format!(
                "{}: its inode {ino} is lost; not restored",
                p.display()
            ));
            return;
        };
        if let Some(&first) = self.placed.get(&ino) {
            let first = self.names.path(first);
            if is_dir(inode) {
                self.rep.problem(format!(
                    "{}: directory {ino} is already restored as {}; skipped",
                    p.display(),
                    first.display()
                ));
                return;
            }
            match self.hard_link(&first, p) {
                Ok(()) => self.rep.hard_links += 1,
                Err(e) => self
                    .rep
                    .problem(format!("{}: cannot link: {e}", p.display())),
            }
            return;
        }
        let made = match inode.mode.get() & libc::S_IFMT {
            libc::S_IFDIR => self.mkdir(p).map(|()| {
                self.rep.dirs += 1;
                self.dirs.push((ino, name));
                self.stack.push((ino, name));
            }),
            libc::S_IFREG => self.write_file(p, ino, inode).map(|()| self.rep.files += 1),
            libc::S_IFLNK => match ns.symlinks.get(&ino) {
                Some(t) if !t.is_empty() && t.len() <= SYMLINK_MAX && !t.contains(&0) => {
                    self.symlink(t, p).map(|()| self.rep.symlinks += 1)
                }
                _ => {
                    self.rep.problem(format!(
                        "{}: symlink {ino} has lost its target; not restored",
                        p.display()
                    ));
                    return;
                }
            },
            libc::S_IFCHR | libc::S_IFBLK | libc::S_IFIFO | libc::S_IFSOCK => self
                .mknod(p, inode.mode.get(), inode.rdev.get())
                .map(|()| self.rep.specials += 1),
            m => {
                self.rep.problem(format!(
                    "{}: inode {ino} has unknown type {m:#o}; not restored",
                    p.display()
                ));
                return;
            }
        };
        match made {
            Ok(()) => {
                self.placed.insert(ino, name);
                if !is_dir(inode) {
                    self.attrs(
                        p,
                        ino,
                        inode,
                        inode.mode.get() & libc::S_IFMT == libc::S_IFLNK,
                    );
                }
            }
            Err(e) => {
                // Named, but not restored: not a lost inode to put in lost+found.
                self.failed.insert(ino);
                self.rep
                    .problem(format!("{}: cannot create: {e}", p.display()))
            }
        }
    }

    /// Writes a regular file's data, checking each block.
    fn write_file(&mut self, p: &Path, ino: u64, inode: &InodeItem) -> io::Result<()> {
        let f = create_file(&self.long.at(p)?)?;
        let size = inode.size.get();
        let (mut bad, mut first_bad) = (0u64, None);
        for &(off, fe) in self.ns.extents.get(&ino).map(Vec::as_slice).unwrap_or(&[]) {
            if fe.kind != FILE_EXTENT_REG || off >= size {
                continue;
            }
            let n = fe.num_bytes.get().min(size - off);
            let disk = fe.disk_bytenr.get().checked_add(fe.offset.get());
            let Some(disk) =
                disk.filter(|d| d.checked_add(n).is_some_and(|e| e <= self.total_bytes))
            else {
                self.rep.problem(format!(
                    "{}: extent at offset {off} points outside the device; left a hole",
                    p.display()
                ));
                continue;
            };
            // Whole blocks, a MiB at a time, so each can be checked.
            let (a0, a1) = (
                disk / BLOCK_SIZE * BLOCK_SIZE,
                (disk + n).next_multiple_of(BLOCK_SIZE),
            );
            let mut at = a0;
            while at < a1 {
                let len = (a1 - at).min(1 << 20);
                let mut buf = vec![0u8; len as usize];
                if let Err(e) = self.dev.read_at(&mut buf, at) {
                    self.rep.problem(format!(
                        "{}: read error at device {at:#x}: {e}; left a hole",
                        p.display()
                    ));
                    at += len;
                    continue;
                }
                for (i, blk) in buf.chunks(BLOCK_SIZE as usize).enumerate() {
                    let b = at + i as u64 * BLOCK_SIZE;
                    match self.csum_of(b) {
                        None => self.rep.unverified_blocks += 1,
                        Some(c) if c == crate::format::csum(blk) => {}
                        Some(_) => {
                            bad += 1;
                            first_bad.get_or_insert(off + b.max(disk) - disk);
                        }
                    }
                }
                let (s, e) = (at.max(disk), (at + len).min(disk + n));
                f.write_all_at(&buf[(s - at) as usize..(e - at) as usize], off + (s - disk))?;
                self.rep.bytes += e - s;
                at += len;
            }
        }
        f.set_len(size)?;
        if bad > 0 {
            self.rep.bad_blocks += bad;
            self.rep.problem(format!(
                "{}: {bad} data blocks fail their checksums (the first at offset {}); written as read",
                p.display(),
                first_bad.unwrap_or(0)
            ));
        }
        Ok(())
    }

    fn csum_of(&self, block: u64) -> Option<u32> {
        let (&start, sums) = self.csums.range(..=block).next_back()?;
        let i = ((block - start) / BLOCK_SIZE) as usize;
        let c = sums.get(i * 4..i * 4 + 4)?;
        Some(u32::from_le_bytes(c.try_into().ok()?))
    }

    /// Extended attributes, owner, permissions and times of `p`.
    fn attrs(&mut self, p: &Path, ino: u64, inode: &InodeItem, symlink: bool) {
        let Ok(at) = self.long.at(p) else {
            self.rep.attrs_refused += 1;
            return;
        };
        let (fd, c) = (at.fd(), &at.name);
        // Owner, then mode (chown clears set-id bits), then xattrs (chown of a file
        // also drops its security.capability), then times.
        // SAFETY: a valid C string.
        let chown = || unsafe {
            libc::fchownat(
                fd,
                c.as_ptr(),
                inode.uid.get(),
                inode.gid.get(),
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        if self.root && chown() != 0 {
            self.rep.attrs_refused += 1;
        }
        let mode = (inode.mode.get() & 0o7777) as libc::mode_t;
        // SAFETY: a valid C string.
        if !symlink && unsafe { libc::fchmodat(fd, c.as_ptr(), mode, 0) } != 0 {
            self.rep.attrs_refused += 1;
        }
        let xattrs = self.ns.xattrs.get(&ino).map(Vec::as_slice).unwrap_or(&[]);
        // A long path has no name to set xattrs by: its O_PATH descriptor's
        // /proc/self/fd link leads to it (to a symlink itself, not its target).
        let by_fd = match (xattrs.is_empty(), at.is_whole()) {
            (false, false) => at.open_path().ok(),
            _ => None,
        };
        let target = match &by_fd {
            Some(d) => CString::new(format!("/proc/self/fd/{}", d.as_raw_fd())).ok(),
            None => at.is_whole().then(|| at.name.clone()),
        };
        for e in xattrs {
            let (Some(v), Ok(n)) = (self.ns.xattr_value(ino, e), CString::new(e.name.clone()))
            else {
                self.rep.problem(format!(
                    "{}: xattr {:?} lost its value; not restored",
                    p.display(),
                    String::from_utf8_lossy(&e.name)
                ));
                continue;
            };
            let Some(t) = &target else {
                self.rep.attrs_refused += 1;
                continue;
            };
            // SAFETY: valid C strings and a buffer of the given length.
            let r = unsafe {
                if by_fd.is_some() {
                    libc::setxattr(t.as_ptr(), n.as_ptr(), v.as_ptr().cast(), v.len(), 0)
                } else {
                    libc::lsetxattr(t.as_ptr(), n.as_ptr(), v.as_ptr().cast(), v.len(), 0)
                }
            };
            if r != 0 {
                self.rep.attrs_refused += 1;
            }
        }
        let ts = |t: Timespec| libc::timespec {
            tv_sec: t.sec.get(),
            tv_nsec: t.nsec.get().min(999_999_999) as _,
        };
        let times = [ts(inode.atime), ts(inode.mtime)];
        // SAFETY: a valid C string and two timespecs.
        let r =
            unsafe { libc::utimensat(fd, c.as_ptr(), times.as_ptr(), libc::AT_SYMLINK_NOFOLLOW) };
        if r != 0 {
            self.rep.attrs_refused += 1;
        }
    }

    /// mkdir(2) of `p`, however long.
    fn mkdir(&mut self, p: &Path) -> io::Result<()> {
        let at = self.long.at(p)?;
        // SAFETY: a valid C string.
        check(unsafe { libc::mkdirat(at.fd(), at.name.as_ptr(), 0o777) })
    }

    /// symlink(2): `p`, however long, pointing to `target`.
    fn symlink(&mut self, target: &[u8], p: &Path) -> io::Result<()> {
        let t = CString::new(target)?;
        let at = self.long.at(p)?;
        // SAFETY: valid C strings.
        check(unsafe { libc::symlinkat(t.as_ptr(), at.fd(), at.name.as_ptr()) })
    }

    /// mknod(2) of `p`, however long.
    fn mknod(&mut self, p: &Path, mode: u32, rdev: u64) -> io::Result<()> {
        let at = self.long.at(p)?;
        // SAFETY: a valid C string.
        let rc = unsafe {
            libc::mknodat(
                at.fd(),
                at.name.as_ptr(),
                mode as libc::mode_t,
                rdev as libc::dev_t,
            )
        };
        check(rc)
    }

    /// link(2): `p` as a new name of `first`, either of them however long.
    fn hard_link(&mut self, first: &Path, p: &Path) -> io::Result<()> {
        let old = self.long.at(first)?;
        let new = self.long.at(p)?;
        // SAFETY: valid C strings.
        check(unsafe { libc::linkat(old.fd(), old.name.as_ptr(), new.fd(), new.name.as_ptr(), 0) })
    }
}

/// A path written, by its index in [`Names`].
type Name = usize;

/// The paths written, each as its parent's index and its own name: a deep tree
/// costs memory in proportion to its entries, where whole paths cost the square of
/// its depth (900 MiB for a chain of 20,000 directories).
#[derive(Default)]
struct Names {
    nodes: Vec<(Option<Name>, std::ffi::OsString)>,
}

impl Names {
    /// A path: `name` under `parent`, or `name` itself for none.
    fn add(&mut self, parent: Option<Name>, name: &OsStr) -> Name {
        self.nodes.push((parent, name.to_os_string()));
        self.nodes.len() - 1
    }

    /// The whole path of `n`.
    fn path(&self, n: Name) -> PathBuf {
        let mut parts = Vec::new();
        let mut at = Some(n);
        while let Some(i) = at {
            let (parent, name) = &self.nodes[i];
            parts.push(name.as_os_str());
            at = *parent;
        }
        parts.iter().rev().collect()
    }
}

/// `DEST/lost+found`, made unless it is a directory restored from the image; when that
/// name is something else (a symlink could point out of DEST), `lost+found.N`.
fn lost_found_dir(dest: &Path) -> io::Result<PathBuf> {
    for n in 0..100 {
        let p = match n {
            0 => dest.join("lost+found"),
            n => dest.join(format!("lost+found.{n}")),
        };
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_dir() => return Ok(p),
            Ok(_) => continue,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                std::fs::create_dir(&p)?;
                return Ok(p);
            }
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        "lost+found and lost+found.1 to .99 are all taken",
    ))
}

fn is_dir(i: &InodeItem) -> bool {
    i.mode.get() & libc::S_IFMT == libc::S_IFDIR
}

/// Whether `name` can be one path component.
fn name_ok(name: &[u8]) -> bool {
    !name.is_empty()
        && name.len() <= NAME_MAX
        && name != b"."
        && name != b".."
        && !name.contains(&b'/')
        && !name.contains(&0)
}
