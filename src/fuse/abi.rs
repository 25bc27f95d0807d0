//! The kernel's FUSE ABI (`include/uapi/linux/fuse.h`, 7.42) as far as the io_uring
//! transport needs it: request opcodes (and their names, for the request counters),
//! the fixed parts of requests, and the reply bodies it encodes itself. (Requests
//! from `/dev/fuse` are fuser's to decode.)
//!
//! A request through a ring entry comes in three parts (`struct fuse_uring_req_header`
//! plus the payload buffer):
//!
//! ```text
//! header buffer:  0 ..128  fuse_in_header (40 bytes) / fuse_out_header (16 bytes)
//!                 128..256  the opcode's fixed argument (fuse_*_in), if it has one
//!                 256..288  fuse_uring_ent_in_out: flags, commit_id, payload_sz
//! payload buffer:           the rest of the request (names, written data); for the
//!                           reply, the reply body (fuse_*_out, read data, dirents)
//! ```
//!
//! All integers are in the host's byte order, as the kernel writes them.

// The FUSE ABI is the host's byte order, not the disk format's little-endian.
#![allow(clippy::host_endian_bytes)]

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{FileAttr, FileType};

pub(crate) const LOOKUP: u32 = 1;
pub(crate) const FORGET: u32 = 2;
pub(crate) const GETATTR: u32 = 3;
pub(crate) const SETATTR: u32 = 4;
pub(crate) const READLINK: u32 = 5;
pub(crate) const SYMLINK: u32 = 6;
pub(crate) const MKNOD: u32 = 8;
pub(crate) const MKDIR: u32 = 9;
pub(crate) const UNLINK: u32 = 10;
pub(crate) const RMDIR: u32 = 11;
pub(crate) const RENAME: u32 = 12;
pub(crate) const LINK: u32 = 13;
pub(crate) const OPEN: u32 = 14;
pub(crate) const READ: u32 = 15;
pub(crate) const WRITE: u32 = 16;
pub(crate) const STATFS: u32 = 17;
pub(crate) const RELEASE: u32 = 18;
pub(crate) const FSYNC: u32 = 20;
pub(crate) const SETXATTR: u32 = 21;
pub(crate) const GETXATTR: u32 = 22;
pub(crate) const LISTXATTR: u32 = 23;
pub(crate) const REMOVEXATTR: u32 = 24;
pub(crate) const FLUSH: u32 = 25;
pub(crate) const INIT: u32 = 26;
pub(crate) const OPENDIR: u32 = 27;
pub(crate) const READDIR: u32 = 28;
pub(crate) const RELEASEDIR: u32 = 29;
pub(crate) const FSYNCDIR: u32 = 30;
pub(crate) const GETLK: u32 = 31;
pub(crate) const SETLK: u32 = 32;
pub(crate) const SETLKW: u32 = 33;
pub(crate) const ACCESS: u32 = 34;
pub(crate) const CREATE: u32 = 35;
pub(crate) const INTERRUPT: u32 = 36;
pub(crate) const BMAP: u32 = 37;
pub(crate) const DESTROY: u32 = 38;
pub(crate) const IOCTL: u32 = 39;
pub(crate) const POLL: u32 = 40;
pub(crate) const NOTIFY_REPLY: u32 = 41;
pub(crate) const BATCH_FORGET: u32 = 42;
pub(crate) const FALLOCATE: u32 = 43;
pub(crate) const READDIRPLUS: u32 = 44;
pub(crate) const RENAME2: u32 = 45;
pub(crate) const LSEEK: u32 = 46;
pub(crate) const COPY_FILE_RANGE: u32 = 47;
pub(crate) const SETUPMAPPING: u32 = 48;
pub(crate) const REMOVEMAPPING: u32 = 49;
pub(crate) const SYNCFS: u32 = 50;
pub(crate) const TMPFILE: u32 = 51;
pub(crate) const STATX: u32 = 52;

/// The name of request opcode `op`: the kernel's `FUSE_*` name in lower case.
pub(crate) fn opcode_name(op: u32) -> Option<&'static str> {
    Some(match op {
        LOOKUP => "lookup",
        FORGET => "forget",
        GETATTR => "getattr",
        SETATTR => "setattr",
        READLINK => "readlink",
        SYMLINK => "symlink",
        MKNOD => "mknod",
        MKDIR => "mkdir",
        UNLINK => "unlink",
        RMDIR => "rmdir",
        RENAME => "rename",
        LINK => "link",
        OPEN => "open",
        READ => "read",
        WRITE => "write",
        STATFS => "statfs",
        RELEASE => "release",
        FSYNC => "fsync",
        SETXATTR => "setxattr",
        GETXATTR => "getxattr",
        LISTXATTR => "listxattr",
        REMOVEXATTR => "removexattr",
        FLUSH => "flush",
        INIT => "init",
        OPENDIR => "opendir",
        READDIR => "readdir",
        RELEASEDIR => "releasedir",
        FSYNCDIR => "fsyncdir",
        GETLK => "getlk",
        SETLK => "setlk",
        SETLKW => "setlkw",
        ACCESS => "access",
        CREATE => "create",
        INTERRUPT => "interrupt",
        BMAP => "bmap",
        DESTROY => "destroy",
        IOCTL => "ioctl",
        POLL => "poll",
        NOTIFY_REPLY => "notify_reply",
        BATCH_FORGET => "batch_forget",
        FALLOCATE => "fallocate",
        READDIRPLUS => "readdirplus",
        RENAME2 => "rename2",
        LSEEK => "lseek",
        COPY_FILE_RANGE => "copy_file_range",
        SETUPMAPPING => "setupmapping",
        REMOVEMAPPING => "removemapping",
        SYNCFS => "syncfs",
        TMPFILE => "tmpfile",
        STATX => "statx",
        _ => return None,
    })
}

/// `fuse_getattr_in.getattr_flags`: the kernel asks on behalf of an open file, `fh`.
pub(crate) const GETATTR_FH: u32 = 1;

/// setattr's `valid` bits.
pub(crate) const FATTR_MODE: u32 = 1 << 0;
pub(crate) const FATTR_UID: u32 = 1 << 1;
pub(crate) const FATTR_GID: u32 = 1 << 2;
pub(crate) const FATTR_SIZE: u32 = 1 << 3;
pub(crate) const FATTR_ATIME: u32 = 1 << 4;
pub(crate) const FATTR_MTIME: u32 = 1 << 5;
pub(crate) const FATTR_ATIME_NOW: u32 = 1 << 7;
pub(crate) const FATTR_MTIME_NOW: u32 = 1 << 8;
pub(crate) const FATTR_CTIME: u32 = 1 << 10;

/// fsync's flag for fdatasync.
pub(crate) const FSYNC_FDATASYNC: u32 = 1;

/// Size of the in/out header area and of the argument area of a ring entry's header.
pub(crate) const IN_OUT_SIZE: usize = 128;
pub(crate) const OP_SIZE: usize = 128;
/// Size of `struct fuse_uring_req_header`.
pub(crate) const RING_HEADER_SIZE: usize = IN_OUT_SIZE + OP_SIZE + 32;
/// Offset of `fuse_uring_ent_in_out` in it.
pub(crate) const ENT_IN_OUT: usize = IN_OUT_SIZE + OP_SIZE;

/// `struct fuse_in_header`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct InHeader {
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
}

/// Reads fixed-size little pieces out of a request's bytes; past the end reads zeros
/// (the kernel never sends short arguments, and a zero is harmless where it would).
pub(crate) struct Args<'a> {
    bytes: &'a [u8],
}

impl<'a> Args<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Args<'a> {
        Args { bytes }
    }

    fn at<const N: usize>(&self, off: usize) -> [u8; N] {
        let mut b = [0u8; N];
        if let Some(s) = self.bytes.get(off..off + N) {
            b.copy_from_slice(s);
        }
        b
    }

    pub(crate) fn u32(&self, off: usize) -> u32 {
        u32::from_ne_bytes(self.at(off))
    }

    pub(crate) fn u64(&self, off: usize) -> u64 {
        u64::from_ne_bytes(self.at(off))
    }
}

/// The FITRIM ioctl's number: _IOWR('X', 121, struct fstrim_range).
pub const FITRIM: u32 = 0xc018_5879;

/// birchfs's own ioctl, on any file or directory of a mount: commit everything the
/// daemon holds now, as `sync` does on a kernel filesystem; _IO(0xbf, 1), no argument.
pub const BIRCHFS_IOC_SYNC: u32 = 0xbf01;

/// birchfs's ioctl that grows a mounted filesystem, on any file or directory of the
/// mount (root or the user who mounted): _IOWR(0xbf, 2, three u64s). In: an
/// operation ([`RESIZE_QUERY`] or [`RESIZE_GROW`]) and the size to grow to. Out: the
/// filesystem's size, its device's size now, and 1 for a block device (0 for an image
/// file), after the grow if any.
pub const BIRCHFS_IOC_RESIZE: u32 = 0xc018_bf02;

/// [`BIRCHFS_IOC_RESIZE`] only reports the sizes.
pub const RESIZE_QUERY: u64 = 0;

/// [`BIRCHFS_IOC_RESIZE`] grows the filesystem (an image file is lengthened first).
pub const RESIZE_GROW: u64 = 1;

/// Decodes [`BIRCHFS_IOC_RESIZE`]'s argument: operation and size (None if short).
pub(crate) fn resize_args(b: &[u8]) -> Option<(u64, u64)> {
    let a = Args::new(b.get(..24)?);
    Some((a.u64(0), a.u64(8)))
}

/// Encodes [`BIRCHFS_IOC_RESIZE`]'s answer.
pub(crate) fn resize_answer(fs_size: u64, dev_size: u64, bdev: bool) -> [u8; 24] {
    three_u64s([fs_size, dev_size, u64::from(bdev)])
}

/// Decodes a `struct fstrim_range`: start, len, minlen (None if short).
pub(crate) fn fstrim_range(b: &[u8]) -> Option<(u64, u64, u64)> {
    let a = Args::new(b.get(..24)?);
    Some((a.u64(0), a.u64(8), a.u64(16)))
}

/// Encodes a `struct fstrim_range`.
pub(crate) fn fstrim_range_bytes(start: u64, len: u64, min_len: u64) -> [u8; 24] {
    three_u64s([start, len, min_len])
}

/// FS_IOC_GETFLAGS (`lsattr`): _IOR('f', 1, long); through FUSE the kernel's
/// fileattr call asks it with a 4-byte word of `FS_*_FL` bits.
pub const FS_IOC_GETFLAGS: u32 = 0x8008_6601;

/// FS_IOC_SETFLAGS (`chattr`): _IOW('f', 2, long), a 4-byte word through FUSE.
pub const FS_IOC_SETFLAGS: u32 = 0x4008_6602;

/// FS_IOC_FSGETXATTR (`xfs_io chattr`): _IOR('X', 31, struct fsxattr).
pub const FS_IOC_FSGETXATTR: u32 = 0x801c_581f;

/// FS_IOC_FSSETXATTR: _IOW('X', 32, struct fsxattr).
pub const FS_IOC_FSSETXATTR: u32 = 0x401c_5820;

/// Size of a `struct fsxattr`.
pub const FSXATTR_SIZE: usize = 28;

/// Each `FS_XFLAG_*` bit birchfs keeps, with the `FS_*_FL` bit it stands for:
/// immutable, append, noatime, nodump.
const XFLAGS: [(u32, u32); 4] = [(0x8, 0x10), (0x10, 0x20), (0x40, 0x80), (0x80, 0x40)];

/// `FS_XFLAG_HASATTR`, which only reports that a file has extended attributes.
const XFLAG_HASATTR: u32 = 0x8000_0000;

/// Decodes a `struct fsxattr` into `FS_*_FL` bits: EINVAL if short, EOPNOTSUPP for
/// a flag birchfs does not keep or an extent size, project or CoW extent size hint.
pub(crate) fn fsxattr_flags(b: &[u8]) -> std::result::Result<u32, i32> {
    let a = Args::new(b.get(..FSXATTR_SIZE).ok_or(libc::EINVAL)?);
    let (xflags, extsize, projid, cowextsize) = (a.u32(0), a.u32(4), a.u32(12), a.u32(16));
    let mut flags = 0;
    let mut left = xflags & !XFLAG_HASATTR;
    for (x, f) in XFLAGS {
        if left & x != 0 {
            flags |= f;
            left &= !x;
        }
    }
    if left != 0 || extsize != 0 || projid != 0 || cowextsize != 0 {
        return Err(libc::EOPNOTSUPP);
    }
    Ok(flags)
}

/// Decodes the 4-byte word of `FS_*_FL` bits of FS_IOC_SETFLAGS (None if short).
pub(crate) fn flags_word(b: &[u8]) -> Option<u32> {
    Some(Args::new(b.get(..4)?).u32(0))
}

/// Encodes `FS_*_FL` bits as FS_IOC_GETFLAGS answers them through FUSE.
pub(crate) fn flags_word_bytes(flags: u32) -> [u8; 4] {
    flags.to_ne_bytes()
}

/// Encodes `FS_*_FL` bits as a `struct fsxattr` (no hints, no project).
pub(crate) fn fsxattr_bytes(flags: u32) -> [u8; FSXATTR_SIZE] {
    let xflags = XFLAGS
        .iter()
        .filter(|(_, f)| flags & f != 0)
        .fold(0, |x, (b, _)| x | b);
    let mut out = [0u8; FSXATTR_SIZE];
    out[..4].copy_from_slice(&u32::to_ne_bytes(xflags));
    out
}

/// Three u64s as an ioctl struct holds them.
pub(crate) fn three_u64s(v: [u64; 3]) -> [u8; 24] {
    let mut out = [0u8; 24];
    for (i, v) in v.into_iter().enumerate() {
        out[i * 8..i * 8 + 8].copy_from_slice(&v.to_ne_bytes());
    }
    out
}

impl InHeader {
    /// Decodes a `fuse_in_header`.
    pub(crate) fn parse(b: &[u8]) -> InHeader {
        let a = Args::new(b);
        InHeader {
            opcode: a.u32(4),
            unique: a.u64(8),
            nodeid: a.u64(16),
            uid: a.u32(24),
            gid: a.u32(28),
            pid: a.u32(32),
        }
    }
}

/// Splits the NUL-terminated strings at the start of a payload: the first `N`, or
/// None when one has no terminator.
pub(crate) fn strings<const N: usize>(payload: &[u8]) -> Option<([&[u8]; N], &[u8])> {
    let mut out = [&payload[..0]; N];
    let mut rest = payload;
    for slot in out.iter_mut() {
        let end = rest.iter().position(|&b| b == 0)?;
        *slot = &rest[..end];
        rest = &rest[end + 1..];
    }
    Some((out, rest))
}

/// A reply body being written: into a ring entry's payload buffer, or into a staging
/// buffer (copied into the payload once the request's own bytes are no longer read).
pub(crate) struct Body<'a> {
    out: Out<'a>,
    len: usize,
    limit: usize,
}

enum Out<'a> {
    Slice(&'a mut [u8]),
    Vec(&'a mut Vec<u8>),
}

/// The reply did not fit the payload buffer.
#[derive(Debug)]
pub(crate) struct Overflow;

impl<'a> Body<'a> {
    /// A body written into `buf`, `len` bytes of it written already.
    pub(crate) fn new(buf: &'a mut [u8], len: usize) -> Body<'a> {
        let limit = buf.len();
        Body {
            out: Out::Slice(buf),
            len,
            limit,
        }
    }

    /// A body written into `v` (its first `len` bytes kept), at most `limit` bytes.
    pub(crate) fn staged(v: &'a mut Vec<u8>, len: usize, limit: usize) -> Body<'a> {
        Body {
            out: Out::Vec(v),
            len,
            limit,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn bytes(&mut self, b: &[u8]) -> Result<(), Overflow> {
        let end = self.len + b.len();
        if end > self.limit {
            return Err(Overflow);
        }
        match &mut self.out {
            Out::Slice(s) => s.get_mut(self.len..end).ok_or(Overflow)?.copy_from_slice(b),
            Out::Vec(v) => {
                v.resize(self.len, 0);
                v.extend_from_slice(b);
            }
        }
        self.len = end;
        Ok(())
    }

    pub(crate) fn u32(&mut self, v: u32) -> Result<(), Overflow> {
        self.bytes(&v.to_ne_bytes())
    }

    pub(crate) fn u64(&mut self, v: u64) -> Result<(), Overflow> {
        self.bytes(&v.to_ne_bytes())
    }

    /// `struct fuse_attr` (88 bytes).
    pub(crate) fn attr(&mut self, a: &FileAttr) -> Result<(), Overflow> {
        let (at, mt, ct) = (time(a.atime), time(a.mtime), time(a.ctime));
        for v in [
            a.ino.0,
            a.size,
            a.blocks,
            at.0 as u64,
            mt.0 as u64,
            ct.0 as u64,
        ] {
            self.u64(v)?;
        }
        for v in [
            at.1,
            mt.1,
            ct.1,
            mode(a),
            a.nlink,
            a.uid,
            a.gid,
            a.rdev,
            a.blksize,
            a.flags,
        ] {
            self.u32(v)?;
        }
        Ok(())
    }

    /// `struct fuse_entry_out` (128 bytes).
    pub(crate) fn entry(&mut self, ttl: &Duration, a: &FileAttr, gen: u64) -> Result<(), Overflow> {
        self.u64(a.ino.0)?;
        self.u64(gen)?;
        self.u64(ttl.as_secs())?;
        self.u64(ttl.as_secs())?;
        self.u32(ttl.subsec_nanos())?;
        self.u32(ttl.subsec_nanos())?;
        self.attr(a)
    }

    /// `struct fuse_attr_out` (104 bytes).
    pub(crate) fn attr_out(&mut self, ttl: &Duration, a: &FileAttr) -> Result<(), Overflow> {
        self.u64(ttl.as_secs())?;
        self.u32(ttl.subsec_nanos())?;
        self.u32(0)?;
        self.attr(a)
    }

    /// `struct fuse_open_out` (16 bytes).
    pub(crate) fn open_out(&mut self, fh: u64, flags: u32) -> Result<(), Overflow> {
        self.u64(fh)?;
        self.u32(flags)?;
        self.u32(0)
    }

    /// `struct fuse_dirent` and its name, padded to 8 bytes; with `plus` a
    /// `fuse_entry_out` first (`struct fuse_direntplus`). Overflow leaves the body as
    /// it was.
    pub(crate) fn dirent(
        &mut self,
        ino: u64,
        off: u64,
        typ: u32,
        name: &[u8],
        plus: Option<(&Duration, &FileAttr, u64)>,
    ) -> Result<(), Overflow> {
        let head = if plus.is_some() { 128 } else { 0 };
        let size = head + (24 + name.len()).next_multiple_of(8);
        if self.len + size > self.limit {
            return Err(Overflow);
        }
        if let Some((ttl, a, gen)) = plus {
            self.entry(ttl, a, gen)?;
        }
        self.u64(ino)?;
        self.u64(off)?;
        self.u32(name.len() as u32)?;
        self.u32(typ)?;
        self.bytes(name)?;
        let pad = (24 + name.len()).next_multiple_of(8) - (24 + name.len());
        self.bytes(&[0u8; 8][..pad])
    }
}

/// Seconds and nanoseconds since the epoch, negative before it.
fn time(t: SystemTime) -> (i64, u32) {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (d.as_secs() as i64, d.subsec_nanos()),
        Err(e) => {
            let d = e.duration();
            match d.subsec_nanos() {
                0 => (-(d.as_secs() as i64), 0),
                n => (-(d.as_secs() as i64) - 1, 1_000_000_000 - n),
            }
        }
    }
}

/// The time `secs`.`nsecs` after (or before) the epoch.
pub(crate) fn system_time(secs: u64, nsecs: u32) -> SystemTime {
    let secs = secs as i64;
    let nanos = Duration::from_nanos(u64::from(nsecs.min(999_999_999)));
    if secs >= 0 {
        UNIX_EPOCH + Duration::from_secs(secs as u64) + nanos
    } else {
        UNIX_EPOCH - Duration::from_secs(secs.unsigned_abs()) + nanos
    }
}

/// The directory-entry type (DT_*) of a file type.
pub(crate) fn dirent_type(k: FileType) -> u32 {
    type_bits(k) >> 12
}

fn type_bits(k: FileType) -> u32 {
    match k {
        FileType::NamedPipe => libc::S_IFIFO,
        FileType::CharDevice => libc::S_IFCHR,
        FileType::BlockDevice => libc::S_IFBLK,
        FileType::Directory => libc::S_IFDIR,
        FileType::RegularFile => libc::S_IFREG,
        FileType::Symlink => libc::S_IFLNK,
        FileType::Socket => libc::S_IFSOCK,
    }
}

fn mode(a: &FileAttr) -> u32 {
    type_bits(a.kind) | u32::from(a.perm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use fuser::INodeNo;

    fn attr() -> FileAttr {
        FileAttr {
            ino: INodeNo(300),
            size: 5000,
            blocks: 16,
            atime: UNIX_EPOCH + Duration::new(10, 5),
            mtime: UNIX_EPOCH - Duration::new(2, 250_000_000),
            ctime: UNIX_EPOCH + Duration::new(30, 7),
            crtime: UNIX_EPOCH,
            kind: FileType::RegularFile,
            perm: 0o4755,
            nlink: 2,
            uid: 1000,
            gid: 100,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    #[test]
    fn entry_out_has_the_kernels_layout() {
        let mut buf = [0u8; 256];
        let mut b = Body::new(&mut buf, 0);
        b.entry(&Duration::new(1, 500), &attr(), 7).unwrap();
        assert_eq!(b.len(), 128);
        let a = Args::new(&buf);
        assert_eq!(a.u64(0), 300, "nodeid");
        assert_eq!(a.u64(8), 7, "generation");
        assert_eq!((a.u64(16), a.u32(32)), (1, 500), "entry_valid");
        // fuse_attr at 40: ino, size, blocks, atime, mtime, ctime, then the u32s.
        assert_eq!(a.u64(40), 300);
        assert_eq!(a.u64(48), 5000);
        assert_eq!(a.u64(56), 16);
        assert_eq!(a.u64(64), 10);
        assert_eq!(
            a.u64(72) as i64,
            -3,
            "2.25 s before the epoch is -3 s + 0.75 s"
        );
        assert_eq!(a.u32(88), 5, "atimensec");
        assert_eq!(a.u32(92), 750_000_000, "mtimensec");
        assert_eq!(a.u32(100), libc::S_IFREG | 0o4755, "mode");
        assert_eq!(a.u32(104), 2, "nlink");
        assert_eq!((a.u32(108), a.u32(112)), (1000, 100));
        assert_eq!(a.u32(120), 4096, "blksize");
    }

    #[test]
    fn times_survive_the_round_trip_through_the_abi() {
        for t in [
            UNIX_EPOCH + Duration::new(1_700_000_000, 123),
            UNIX_EPOCH - Duration::new(2, 250_000_000),
            UNIX_EPOCH - Duration::new(5, 0),
        ] {
            let (s, n) = time(t);
            assert_eq!(system_time(s as u64, n), t);
        }
    }

    #[test]
    fn dirents_are_padded_and_refused_whole_when_full() {
        let mut buf = [0u8; 64];
        let mut b = Body::new(&mut buf, 0);
        b.dirent(5, 1, 8, b"abc", None).unwrap();
        assert_eq!(b.len(), 32, "24 + 3 rounded up to 8");
        assert!(b.dirent(6, 2, 8, b"0123456789", None).is_err());
        assert_eq!(b.len(), 32, "a refused entry leaves nothing behind");
        b.dirent(6, 2, 4, b"d", None).unwrap();
        assert_eq!(b.len(), 64);
        let a = Args::new(&buf);
        assert_eq!((a.u64(0), a.u64(8), a.u32(16), a.u32(20)), (5, 1, 3, 8));
        assert_eq!(&buf[24..27], b"abc");
    }

    #[test]
    fn a_staged_body_has_the_same_bytes_and_limit_as_a_slice() {
        let mut buf = [0u8; 40];
        let mut v = Vec::new();
        for mut body in [Body::new(&mut buf, 0), Body::staged(&mut v, 0, 40)] {
            body.dirent(5, 1, 8, b"abc", None).unwrap();
            assert!(body.u64(1).is_ok() && body.bytes(&[0u8; 1]).is_err());
            assert_eq!(body.len(), 40);
        }
        assert_eq!(&buf[..], &v[..]);
    }

    #[test]
    fn strings_split_at_nul_and_refuse_unterminated_ones() {
        let (s, rest) = strings::<2>(b"old\0new\0value").unwrap();
        assert_eq!(s, [&b"old"[..], &b"new"[..]]);
        assert_eq!(rest, b"value");
        assert!(strings::<2>(b"old\0new").is_none());
    }

    #[test]
    fn in_header_fields_sit_where_the_kernel_puts_them() {
        let mut b = [0u8; 40];
        b[4..8].copy_from_slice(&16u32.to_ne_bytes());
        b[8..16].copy_from_slice(&99u64.to_ne_bytes());
        b[16..24].copy_from_slice(&1u64.to_ne_bytes());
        b[24..28].copy_from_slice(&1000u32.to_ne_bytes());
        b[28..32].copy_from_slice(&100u32.to_ne_bytes());
        b[32..36].copy_from_slice(&4242u32.to_ne_bytes());
        let h = InHeader::parse(&b);
        assert_eq!(
            (h.opcode, h.unique, h.nodeid, h.uid, h.gid, h.pid),
            (WRITE, 99, 1, 1000, 100, 4242)
        );
    }

    /// Every kept flag goes through a `struct fsxattr` and back; HASATTR is ignored
    /// on the way in, any other bit refused.
    #[test]
    fn fsxattr_flags_round_trip() {
        for flags in [0, 0x10, 0x20, 0x40, 0x80, 0xf0] {
            assert_eq!(
                fsxattr_flags(&fsxattr_bytes(flags)),
                Ok(flags),
                "{flags:#x}"
            );
        }
        // FS_XFLAG_IMMUTABLE and FS_XFLAG_APPEND, as xfs_io reads them.
        assert_eq!(fsxattr_bytes(0x10)[..4], 8u32.to_ne_bytes());
        assert_eq!(fsxattr_bytes(0x20)[..4], 0x10u32.to_ne_bytes());
        assert_eq!(flags_word(&flags_word_bytes(0x30)), Some(0x30));
        let mut b = fsxattr_bytes(0x10);
        b[3] |= 0x80; // FS_XFLAG_HASATTR
        assert_eq!(fsxattr_flags(&b), Ok(0x10));
        b[0] |= 0x1; // FS_XFLAG_REALTIME
        assert_eq!(fsxattr_flags(&b), Err(libc::EOPNOTSUPP));
        assert_eq!(fsxattr_flags(&b[..27]), Err(libc::EINVAL));
    }
}
