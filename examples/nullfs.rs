//! A FUSE filesystem that stores nothing: names and sizes live in memory, written
//! data is dropped, reads return zeros, and fsync returns at once. It is mounted the
//! way birchfs mounts (writeback cache, POSIX ACLs and `default_permissions`, the
//! same number of threads), so the kernel sends it the same requests for the same
//! workload. What it reaches is the ceiling of what any filesystem served through
//! `/dev/fuse` can reach on that machine: the cost of the round trips alone.
//!
//! With a third argument, a file of the host, each fsync also writes a 4 KiB block
//! of that file and flushes it (fdatasync), one flush per fsync with no group
//! commit, as a kernel filesystem on that disk pays: the ceiling with the disk's
//! flush in it.
//!
//! Run: `cargo run --release --example nullfs -- MOUNTPOINT [THREADS [FLUSH_FILE]]`,
//! then the workload in MOUNTPOINT, then `umount MOUNTPOINT`.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyEmpty, ReplyEntry,
    ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};

const TTL: Duration = Duration::from_secs(1);

/// Names and attributes of every node.
#[derive(Default)]
struct Tree {
    attrs: HashMap<u64, FileAttr>,
    names: HashMap<(u64, OsString), u64>,
    next: u64,
}

/// Attributes of a new node, made now.
fn new_attr(ino: u64, kind: FileType, mode: u32, uid: u32, gid: u32) -> FileAttr {
    let now = SystemTime::now();
    FileAttr {
        ino: INodeNo(ino),
        size: 0,
        blocks: 0,
        atime: now,
        mtime: now,
        ctime: now,
        crtime: now,
        kind,
        perm: (mode & 0o7777) as u16,
        nlink: if kind == FileType::Directory { 2 } else { 1 },
        uid,
        gid,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

impl Tree {
    fn add(
        &mut self,
        parent: u64,
        name: &OsStr,
        kind: FileType,
        mode: u32,
        req: &Request,
    ) -> FileAttr {
        self.next += 1;
        let a = new_attr(self.next, kind, mode, req.uid(), req.gid());
        self.attrs.insert(self.next, a);
        self.names.insert((parent, name.to_os_string()), self.next);
        a
    }
}

struct NullFs {
    tree: Mutex<Tree>,
    /// The host file each fsync writes a block of and flushes, if any.
    flush: Option<std::fs::File>,
    /// Which block of `flush` the next fsync writes (64 of them, in turn).
    next_block: std::sync::atomic::AtomicU64,
}

impl Filesystem for NullFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // The capabilities birchfs asks for that change which requests come.
        let _ = config.add_capabilities(InitFlags::FUSE_WRITEBACK_CACHE);
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        let _ = config.add_capabilities(InitFlags::FUSE_HANDLE_KILLPRIV_V2);
        let _ = config.add_capabilities(InitFlags::FUSE_POSIX_ACL);
        let _ = config.add_capabilities(InitFlags::FUSE_DONT_MASK);
        let _ = config.set_max_write(1 << 20);
        let _ = config.set_max_readahead(1 << 20);
        let _ = config.set_max_background(64);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let t = self.tree.lock().unwrap();
        match t.names.get(&(parent.0, name.to_os_string())) {
            Some(ino) => reply.entry(&TTL, &t.attrs[ino], Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.tree.lock().unwrap().attrs.get(&ino.0) {
            Some(a) => reply.attr(&TTL, a),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let mut t = self.tree.lock().unwrap();
        let Some(a) = t.attrs.get_mut(&ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        if let Some(m) = mode {
            a.perm = (m & 0o7777) as u16;
        }
        if let Some(s) = size {
            a.size = s;
        }
        reply.attr(&TTL, a)
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        let a = self
            .tree
            .lock()
            .unwrap()
            .add(parent.0, name, FileType::Directory, mode, req);
        reply.entry(&TTL, &a, Generation(0))
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let a = self
            .tree
            .lock()
            .unwrap()
            .add(parent.0, name, FileType::RegularFile, mode, req);
        reply.created(&TTL, &a, Generation(0), FileHandle(0), FopenFlags::empty())
    }

    fn open(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        reply.opened(FileHandle(0), FopenFlags::empty())
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let len = self
            .tree
            .lock()
            .unwrap()
            .attrs
            .get(&ino.0)
            .map_or(0, |a| a.size);
        let n = len.saturating_sub(offset).min(u64::from(size));
        reply.data(&vec![0; n as usize])
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if let Some(a) = self.tree.lock().unwrap().attrs.get_mut(&ino.0) {
            a.size = a.size.max(offset + data.len() as u64);
        }
        reply.written(data.len() as u32)
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // As birchfs: the kernel then stops sending FLUSH.
        reply.error(Errno::ENOSYS)
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok()
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        use std::os::unix::fs::FileExt;
        if let Some(f) = &self.flush {
            let n = self.next_block.fetch_add(1, Ordering::Relaxed) % 64;
            let block = [n as u8; 4096];
            if f.write_all_at(&block, n * 4096)
                .and_then(|()| f.sync_data())
                .is_err()
            {
                return reply.error(Errno::EIO);
            }
        }
        reply.ok()
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        _mode: i32,
        reply: ReplyEmpty,
    ) {
        if let Some(a) = self.tree.lock().unwrap().attrs.get_mut(&ino.0) {
            a.size = a.size.max(offset + length);
        }
        reply.ok()
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        reply.statfs(1 << 24, 1 << 24, 1 << 24, 1 << 20, 1 << 20, 4096, 255, 4096)
    }

    fn getxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: ReplyXattr,
    ) {
        reply.error(Errno::ENODATA)
    }
}

fn main() -> std::io::Result<()> {
    let mut args = std::env::args_os().skip(1);
    let mountpoint = args
        .next()
        .expect("usage: nullfs MOUNTPOINT [THREADS [FLUSH_FILE]]");
    let threads = args
        .next()
        .and_then(|t| t.to_str()?.parse().ok())
        .unwrap_or(2);
    let flush = match args.next() {
        Some(path) => {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(path)?;
            // Written once whole, so that no fsync allocates on the host.
            f.write_all_at(&[0; 64 * 4096], 0)?;
            f.sync_all()?;
            Some(f)
        }
        None => None,
    };
    let mut tree = Tree {
        next: 1,
        ..Default::default()
    };
    tree.attrs
        .insert(1, new_attr(1, FileType::Directory, 0o755, 0, 0));
    let mut cfg = fuser::Config::default();
    cfg.mount_options = vec![
        fuser::MountOption::FSName("nullfs".into()),
        fuser::MountOption::DefaultPermissions,
    ];
    cfg.acl = fuser::SessionACL::All;
    cfg.n_threads = Some(threads);
    let fs = NullFs {
        tree: Mutex::new(tree),
        flush,
        next_block: Default::default(),
    };
    fuser::Session::new(fs, mountpoint, &cfg)?.run()
}
