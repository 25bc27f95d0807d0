//! Requests read from `/dev/fuse` by fuser: its `Filesystem` trait, forwarded to the
//! operations in [`super::ops`]. With FUSE over io_uring agreed, only INIT, FORGET
//! and INTERRUPT still come this way.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    AccessFlags, CopyFileRangeFlags, Errno, FileHandle, Filesystem, INodeNo, InitFlags, IoctlFlags,
    KernelConfig, LockOwner, OpenFlags, PollEvents, PollFlags, PollNotifier, RenameFlags,
    ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry,
    ReplyIoctl, ReplyLseek, ReplyOpen, ReplyPoll, ReplyStatfs, ReplyWrite, ReplyXattr, Request,
    TimeOrNow, WriteFlags,
};

use super::abi;
use super::ops::{Caller, FuseFs, SetAttrIn};
use super::standby::Served;

/// A request being served; dropped after its handler, it lets a standby thread park
/// (see `fuse::standby`).
struct Serving<'a>(&'a FuseFs);

impl Drop for Serving<'_> {
    fn drop(&mut self) {
        match self.0.standby.after_request() {
            Served::ByCore => {}
            Served::ByStandby => self.0.fs.count_standby_request(false),
            Served::ThenParked => self.0.fs.count_standby_request(true),
        }
    }
}

impl FuseFs {
    /// Counts a request with opcode `op` and returns its [`Serving`].
    fn serving(&self, op: u32) -> Serving<'_> {
        self.fs.count_fuse_request(op);
        Serving(self)
    }
}

/// The time the kernel sent, from fuser's decoding of it. fuser turns a time before
/// the epoch, which the kernel sends as whole seconds (negative) plus nanoseconds
/// (forward), into seconds minus nanoseconds: -2.75 s, sent as (-3, 0.25), became
/// -3.25 s. Its seconds and nanoseconds are still apart, so the sent time is found.
fn sent_time(t: SystemTime) -> SystemTime {
    match t.duration_since(UNIX_EPOCH) {
        Ok(_) => t,
        Err(e) => {
            let d = e.duration();
            UNIX_EPOCH - Duration::from_secs(d.as_secs())
                + Duration::from_nanos(u64::from(d.subsec_nanos()))
        }
    }
}

fn sent(t: TimeOrNow) -> TimeOrNow {
    match t {
        TimeOrNow::SpecificTime(t) => TimeOrNow::SpecificTime(sent_time(t)),
        now => now,
    }
}

fn caller(req: &Request) -> Caller {
    Caller {
        uid: req.uid(),
        gid: req.gid(),
        pid: req.pid(),
    }
}

impl Filesystem for FuseFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        self.fs.count_fuse_request(abi::INIT);
        if config
            .capabilities()
            .contains(InitFlags::FUSE_WRITEBACK_CACHE)
        {
            let _ = config.add_capabilities(InitFlags::FUSE_WRITEBACK_CACHE);
        }
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        // File handles (NFS export, open_by_handle_at) hold the node id, which is the
        // inode number, never reused: the kernel finds an uncached inode again by
        // looking up "." of it, and a directory's parent by "..".
        let _ = config.add_capabilities(InitFlags::FUSE_EXPORT_SUPPORT);
        // Direct reads (`fuse::direct`) only where the kernel writes a range's dirty
        // cached pages back before a direct read of it and allows shared mappings.
        if self.direct.enabled_by_config() {
            let ok = config
                .add_capabilities(InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP)
                .is_ok();
            self.direct.set_agreed(ok);
        }
        // We clear set-id bits on write, truncate and chown ourselves; in return the
        // kernel stops asking for security.capability before every write() (one
        // GETXATTR round trip per write without it).
        let _ = config.add_capabilities(InitFlags::FUSE_HANDLE_KILLPRIV_V2);
        // POSIX ACLs: the kernel enforces them and caches them; we store them, keep
        // the mode in step, and give new nodes their parent's default ACL, for which
        // the kernel must leave the umask to us.
        if config.add_capabilities(InitFlags::FUSE_POSIX_ACL).is_ok()
            && config.add_capabilities(InitFlags::FUSE_DONT_MASK).is_ok()
        {
            self.acls.store(true, Ordering::SeqCst);
        }
        // The kernel offers io_uring queues only with fuse's enable_uring parameter on.
        // Once agreed, every request waits until the queues are registered, which the
        // mount does right after INIT (see `uring::Rings::start`).
        if self.uring
            && config
                .add_capabilities(InitFlags::FUSE_OVER_IO_URING)
                .is_ok()
        {
            self.uring_agreed.store(true, Ordering::SeqCst);
        }
        let _ = config.set_max_write(1 << 20);
        let _ = config.set_max_readahead(1 << 20);
        let _ = config.set_max_background(64);
        let _ = config.set_time_granularity(Duration::from_nanos(1));
        Ok(())
    }

    fn destroy(&mut self) {
        self.fs.count_fuse_request(abi::DESTROY);
        FuseFs::destroy(self)
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let _served = self.serving(abi::LOOKUP);
        FuseFs::lookup(self, parent.0, name.as_bytes(), reply)
    }

    /// Not a place to park: fuser calls it once for each inode of a BATCH_FORGET.
    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.fs.count_fuse_request(abi::FORGET);
        FuseFs::forget(self, ino.0, nlookup)
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        let _served = self.serving(abi::GETATTR);
        FuseFs::getattr(self, ino.0, fh.map(|h| h.0), reply)
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let _served = self.serving(abi::SETATTR);
        let s = SetAttrIn {
            mode,
            uid,
            gid,
            size,
            atime: atime.map(sent),
            mtime: mtime.map(sent),
            ctime: ctime.map(sent_time),
        };
        FuseFs::setattr(self, &caller(req), ino.0, s, reply)
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let _served = self.serving(abi::READLINK);
        FuseFs::readlink(self, ino.0, reply)
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let _served = self.serving(abi::MKNOD);
        let c = caller(req);
        FuseFs::mknod(
            self,
            &c,
            parent.0,
            name.as_bytes(),
            mode,
            rdev,
            umask,
            reply,
        )
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let _served = self.serving(abi::MKDIR);
        FuseFs::mkdir(
            self,
            &caller(req),
            parent.0,
            name.as_bytes(),
            mode,
            umask,
            reply,
        )
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _served = self.serving(abi::UNLINK);
        FuseFs::unlink(self, parent.0, name.as_bytes(), reply)
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _served = self.serving(abi::RMDIR);
        FuseFs::rmdir(self, parent.0, name.as_bytes(), reply)
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let _served = self.serving(abi::SYMLINK);
        let (name, target) = (link_name.as_bytes(), target.as_os_str().as_bytes());
        FuseFs::symlink(self, &caller(req), parent.0, name, target, reply)
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let op = if flags.bits() != 0 {
            abi::RENAME2
        } else {
            abi::RENAME
        };
        self.fs.count_fuse_request(op);
        let (name, newname) = (name.as_bytes(), newname.as_bytes());
        FuseFs::rename(
            self,
            &caller(req),
            parent.0,
            name,
            newparent.0,
            newname,
            flags.bits(),
            reply,
        )
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let _served = self.serving(abi::LINK);
        FuseFs::link(self, ino.0, newparent.0, newname.as_bytes(), reply)
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let _served = self.serving(abi::OPEN);
        FuseFs::open(self, ino.0, flags.0, reply)
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let _served = self.serving(abi::READ);
        FuseFs::read(self, ino.0, fh.0, offset, size, reply)
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let _served = self.serving(abi::WRITE);
        FuseFs::write(self, &caller(req), ino.0, offset, data, write_flags, reply)
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        let _served = self.serving(abi::FLUSH);
        FuseFs::flush(self, reply)
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let _served = self.serving(abi::RELEASE);
        FuseFs::release(self, ino.0, fh.0, flags.0, reply)
    }

    fn fsync(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let _served = self.serving(abi::FSYNC);
        FuseFs::fsync(self, req.pid(), ino.0, datasync, reply)
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let _served = self.serving(abi::OPENDIR);
        FuseFs::opendir(self, ino.0, reply)
    }

    fn releasedir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        let _served = self.serving(abi::RELEASEDIR);
        FuseFs::releasedir(self, ino.0, fh.0, reply)
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        reply: ReplyDirectory,
    ) {
        let _served = self.serving(abi::READDIR);
        FuseFs::readdir(self, ino.0, fh.0, offset, reply)
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        reply: ReplyDirectoryPlus,
    ) {
        let _served = self.serving(abi::READDIRPLUS);
        FuseFs::readdirplus(self, ino.0, fh.0, offset, reply)
    }

    fn fsyncdir(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let _served = self.serving(abi::FSYNCDIR);
        FuseFs::fsync(self, req.pid(), ino.0, datasync, reply)
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let _served = self.serving(abi::STATFS);
        FuseFs::statfs(self, reply)
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let _served = self.serving(abi::SETXATTR);
        FuseFs::setxattr(
            self,
            &caller(req),
            ino.0,
            name.as_bytes(),
            value,
            flags,
            reply,
        )
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let _served = self.serving(abi::GETXATTR);
        FuseFs::getxattr(self, ino.0, name.as_bytes(), size, reply)
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let _served = self.serving(abi::LISTXATTR);
        FuseFs::listxattr(self, ino.0, size, reply)
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _served = self.serving(abi::REMOVEXATTR);
        FuseFs::removexattr(self, ino.0, name.as_bytes(), reply)
    }

    fn access(&self, req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        let _served = self.serving(abi::ACCESS);
        FuseFs::access(self, &caller(req), ino.0, mask.bits(), reply)
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let _served = self.serving(abi::CREATE);
        FuseFs::create(
            self,
            &caller(req),
            parent.0,
            name.as_bytes(),
            mode,
            umask,
            flags,
            reply,
        )
    }

    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let _served = self.serving(abi::FALLOCATE);
        FuseFs::fallocate(self, &caller(req), ino.0, offset, length, mode, reply)
    }

    /// FITRIM, BIRCHFS_IOC_SYNC, BIRCHFS_IOC_RESIZE and the inode flags' ioctls;
    /// ENOTTY for the rest (see `FuseFs::ioctl`).
    fn ioctl(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        cmd: u32,
        in_data: &[u8],
        out_size: u32,
        reply: ReplyIoctl,
    ) {
        let _served = self.serving(abi::IOCTL);
        FuseFs::ioctl(self, &caller(req), ino.0, cmd, in_data, out_size, reply)
    }

    /// No poll of its own: ENOSYS, after which the kernel stops asking and treats
    /// every file as always ready, as it does a regular file on a kernel filesystem
    /// (fuser's default also logs a warning).
    fn poll(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _ph: PollNotifier,
        _events: PollEvents,
        _flags: PollFlags,
        reply: ReplyPoll,
    ) {
        let _served = self.serving(abi::POLL);
        reply.error(Errno::ENOSYS);
    }

    fn lseek(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        let _served = self.serving(abi::LSEEK);
        match u64::try_from(offset) {
            Ok(off) => FuseFs::lseek(self, ino.0, off, whence, reply),
            Err(_) => reply.error(Errno::ENXIO),
        }
    }

    fn copy_file_range(
        &self,
        req: &Request,
        ino_in: INodeNo,
        _fh_in: FileHandle,
        offset_in: u64,
        ino_out: INodeNo,
        _fh_out: FileHandle,
        offset_out: u64,
        len: u64,
        flags: CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        let _served = self.serving(abi::COPY_FILE_RANGE);
        let c = caller(req);
        let (i, o, f) = (ino_in.0, ino_out.0, flags.bits());
        FuseFs::copy_file_range(self, &c, i, offset_in, o, offset_out, len, f, reply)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_before_the_epoch_are_the_ones_the_kernel_sent() {
        // What fuser 0.18 makes of (secs, nsecs) with secs < 0.
        let fuser = |secs: u64, nsecs: u32| UNIX_EPOCH - Duration::new(secs, nsecs);
        let at = |secs: i64, nsecs: u32| {
            UNIX_EPOCH - Duration::from_secs(secs.unsigned_abs())
                + Duration::from_nanos(nsecs.into())
        };
        assert_eq!(sent_time(fuser(3, 250_000_000)), at(-3, 250_000_000));
        assert_eq!(sent_time(fuser(1, 999_999_999)), at(-1, 999_999_999));
        assert_eq!(sent_time(fuser(5, 0)), at(-5, 0));
        let after = UNIX_EPOCH + Duration::new(7, 5);
        assert_eq!(
            sent_time(after),
            after,
            "times after the epoch pass unchanged"
        );
    }
}
