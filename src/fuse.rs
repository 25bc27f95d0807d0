//! The FUSE front door: maps kernel requests onto [`Fs`] and errors onto errno.
//!
//! Inode numbers: the kernel's root (1) is birchfs's root directory (256); every other
//! number is the same on both sides. Each entry handed to the kernel (lookup, create,
//! readdirplus) pins the inode until the kernel forgets it, so an unlinked inode lives
//! on while the kernel can still name it (DESIGN "FUSE inode lifetime").
//!
//! With the writeback cache on, the kernel owns mtime and size of cached files and
//! sends them back with setattr; it applies the umask itself before sending a mode.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fuser::{
    AccessFlags, CopyFileRangeFlags, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, InitFlags, KernelConfig, LockOwner, OpenFlags,
    RenameFlags as FuseRenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr,
    Request, TimeOrNow, WriteFlags,
};

use crate::error::Error;
use crate::fs::{
    is_snapshot_ino, without_suid, Attr, Creds, FallocMode, FileKind, Fs, RenameFlags, SetAttr,
    TimeSet, ROOT_INO,
};

const TTL: Duration = Duration::from_secs(1);

/// A virtual xattr of the mount's root: the daemon's statistics as JSON
/// (what `birchfs stats` reads). It is not listed and cannot be set.
pub const STATS_XATTR: &str = "birchfs.stats";

/// A virtual xattr of the mount's root: exclusive and shared data space as JSON, from
/// a walk over every file extent (what `birchfs stats --space` reads).
pub const SPACE_XATTR: &str = "birchfs.space";

/// A virtual xattr of each snapshot's root directory (`.snapshots/NAME`): the snapshot
/// as JSON (what `birchfs snapshot list` reads, one snapshot at a time).
pub const SNAPSHOT_XATTR: &str = "birchfs.snapshot";

/// An fsync waiting for the log: its target, its reply, when it arrived.
type PendingFsync = (u64, ReplyEmpty, std::time::Instant);

/// Adapts a [`Fs`] to fuser's `Filesystem` trait.
pub struct FuseFs {
    fs: Arc<Fs>,
    fsyncs: Arc<FsyncQueue>,
    workers: FsyncWorkers,
}

impl FuseFs {
    /// Serves `fs` through FUSE.
    pub fn new(fs: Arc<Fs>) -> FuseFs {
        let fsyncs = Arc::new(FsyncQueue::default());
        let workers = FsyncWorkers::start(&fs, &fsyncs);
        FuseFs {
            fs,
            fsyncs,
            workers,
        }
    }
}

/// An fsync handed to a worker: inode, datasync, reply, arrival.
type FsyncJob = (u64, bool, ReplyEmpty, std::time::Instant);

/// An fsync whose file has at least this much dirty data in birchfs's cache is handed
/// to a worker, since writing that data back blocks for the device.
const OFFLOAD_DIRTY: u64 = 64 << 10;

/// Threads that write back the data of large fsyncs.
const FSYNC_WORKERS: usize = 4;

/// The fsyncs that must write data back first run on worker threads, so the FUSE
/// request threads (one per CPU) stay free for the WRITE requests the kernel sends
/// meanwhile: with the writeback cache, every fsync is preceded by WRITEs of the
/// kernel's dirty pages, and those of other files waited behind a request thread
/// parked on its device writes (W2: 4 writers, 2 request threads).
struct FsyncWorkers {
    tx: Option<std::sync::mpsc::Sender<FsyncJob>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl FsyncWorkers {
    fn start(fs: &Arc<Fs>, queue: &Arc<FsyncQueue>) -> FsyncWorkers {
        let (tx, rx) = std::sync::mpsc::channel::<FsyncJob>();
        let rx = Arc::new(parking_lot::Mutex::new(rx));
        let mut threads = Vec::new();
        for n in 0..FSYNC_WORKERS {
            let (fs, queue, rx) = (fs.clone(), queue.clone(), rx.clone());
            let t = std::thread::Builder::new()
                .name(format!("fsync-{n}"))
                .spawn(move || loop {
                    let job = rx.lock().recv();
                    let Ok((ino, datasync, reply, t0)) = job else {
                        break;
                    };
                    sync_or_queue(&fs, &queue, ino, datasync, reply, t0);
                });
            match t {
                Ok(t) => threads.push(t),
                Err(e) => tracing::warn!("cannot start an fsync worker: {e}"),
            }
        }
        FsyncWorkers {
            tx: (!threads.is_empty()).then_some(tx),
            threads,
        }
    }
}

impl Drop for FsyncWorkers {
    /// Lets the workers finish what they hold, then waits for them.
    fn drop(&mut self) {
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Writes back the data of `ino`, then answers the fsync at once or queues it for
/// the group commit.
fn sync_or_queue(
    fs: &Fs,
    queue: &FsyncQueue,
    ino: u64,
    datasync: bool,
    reply: ReplyEmpty,
    t0: std::time::Instant,
) {
    match fs.fsync_target(ino, datasync) {
        Err(e) => {
            fs.record_fsync_latency(t0.elapsed());
            reply.error(errno(&e))
        }
        Ok(None) => {
            fs.record_fsync_latency(t0.elapsed());
            reply.ok()
        }
        Ok(Some(t)) => queue.submit(fs, (t, reply, t0)),
    }
}

/// Most groups being committed at once: while one group's batch flushes, the next
/// group's batch is written and flushed beside it (the device serves flushes in
/// parallel; see `Fs::sync_to`).
const COMMITTERS: usize = 1;

/// Group commit for FUSE (leader and followers). An fsync whose data and records
/// are ready joins the queue; if fewer than `COMMITTERS` groups are being committed,
/// its own request thread becomes a committer: it takes everything queued, makes the
/// log durable up to the highest target with one batch and one flush, answers every
/// fsync of the group, and goes on while more are queued. Otherwise the request
/// thread returns at once and a committer answers the fsync later. No request thread
/// ever waits for another's fsync, and no thread hop delays the first one.
#[derive(Default)]
struct FsyncQueue {
    state: parking_lot::Mutex<(Vec<PendingFsync>, usize)>,
}

impl FsyncQueue {
    fn submit(&self, fs: &Fs, p: PendingFsync) {
        {
            let mut st = self.state.lock();
            st.0.push(p);
            if st.1 >= COMMITTERS {
                return;
            }
            st.1 += 1;
        }
        loop {
            let group = {
                let mut st = self.state.lock();
                if st.0.is_empty() {
                    st.1 -= 1;
                    break;
                }
                std::mem::take(&mut st.0)
            };
            let target = group.iter().map(|b| b.0).max().unwrap_or(0);
            let r = fs.sync_to(target);
            for (_, reply, t0) in group {
                fs.record_fsync_latency(t0.elapsed());
                match &r {
                    Ok(()) => reply.ok(),
                    Err(e) => reply.error(errno(e)),
                }
            }
        }
        if let Err(e) = fs.commit_if_log_full() {
            tracing::error!("commit of a full log failed: {e}");
        }
    }
}

/// The capability that lets a process modify a set-id file and keep its set-id bits.
const CAP_FSETID: u32 = 4;

/// Whether the process (or thread) `pid` has CAP_FSETID in its effective set; unknown
/// (it has exited) counts as no, which errs toward clearing the bits.
fn has_fsetid(pid: u32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_FSETID) != 0)
}

fn to_ino(fuse: INodeNo) -> u64 {
    if fuse.0 == 1 {
        ROOT_INO
    } else {
        fuse.0
    }
}

fn to_fuse(ino: u64) -> INodeNo {
    if ino == ROOT_INO {
        INodeNo(1)
    } else {
        INodeNo(ino)
    }
}

fn errno(e: &Error) -> Errno {
    match e {
        Error::Corrupt { .. } | Error::Io(_) | Error::BadImage(_) => tracing::error!("{e}"),
        _ => tracing::debug!("{e}"),
    }
    Errno::from_i32(e.errno())
}

fn kind(k: FileKind) -> FileType {
    match k {
        FileKind::File => FileType::RegularFile,
        FileKind::Dir => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
        FileKind::Fifo => FileType::NamedPipe,
        FileKind::CharDev => FileType::CharDevice,
        FileKind::BlockDev => FileType::BlockDevice,
        FileKind::Socket => FileType::Socket,
    }
}

fn fattr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: to_fuse(a.ino),
        size: a.size,
        blocks: a.blocks,
        atime: a.atime,
        mtime: a.mtime,
        ctime: a.ctime,
        crtime: a.crtime,
        kind: kind(a.kind),
        perm: a.perm,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev as u32,
        blksize: 4096,
        flags: 0,
    }
}

fn time_set(t: TimeOrNow) -> TimeSet {
    match t {
        TimeOrNow::Now => TimeSet::Now,
        TimeOrNow::SpecificTime(s) => TimeSet::At(s),
    }
}

impl FuseFs {
    /// Owner of a new inode: the caller, or the directory's group under setgid.
    fn creds(&self, req: &Request, parent: u64) -> (Creds, bool) {
        let mut c = Creds {
            uid: req.uid(),
            gid: req.gid(),
        };
        let mut sgid = false;
        if let Ok(p) = self.fs.getattr(parent) {
            if p.perm & libc::S_ISGID as u16 != 0 {
                c.gid = p.gid;
                sgid = true;
            }
        }
        (c, sgid)
    }

    /// Whether `ino` is a non-directory with set-id bits that a change would clear.
    fn has_suid(&self, ino: u64) -> bool {
        self.fs.getattr(ino).is_ok_and(|a| {
            let perm = u32::from(a.perm);
            a.kind != FileKind::Dir && without_suid(perm) != perm
        })
    }

    /// Clears the set-id bits of `ino` (and with `caps` its file capabilities) after a
    /// change of its data: the kernel leaves this to the filesystem
    /// (FUSE_HANDLE_KILLPRIV_V2). Failures are logged; the change itself stands.
    fn drop_privs(&self, ino: u64, caps: bool) {
        if self.has_suid(ino) {
            self.clear_suid(ino);
        }
        if caps {
            match self.fs.removexattr(ino, b"security.capability") {
                Ok(()) | Err(Error::NoData) => {}
                Err(e) => tracing::warn!("dropping the capabilities of inode {ino} failed: {e}"),
            }
        }
    }

    /// [`FuseFs::drop_privs`] for a change the kernel does not flag (fallocate,
    /// copy_file_range): when the caller lacks CAP_FSETID, as the VFS decides.
    fn drop_privs_unless_fsetid(&self, req: &Request, ino: u64) {
        if self.has_suid(ino) && !has_fsetid(req.pid()) {
            self.clear_suid(ino);
        }
    }

    /// Clears the set-id bits of `ino`; a failure is logged.
    fn clear_suid(&self, ino: u64) {
        let set = SetAttr {
            kill_suid: true,
            ..Default::default()
        };
        if let Err(e) = self.fs.setattr(ino, &set) {
            tracing::warn!("clearing the set-id bits of inode {ino} failed: {e}");
        }
    }

    /// fsync and fdatasync: answered at once when nothing they need is new, else by the
    /// group commit; one with much data to write back first goes to a worker.
    fn queue_fsync(&self, ino: u64, datasync: bool, reply: ReplyEmpty) {
        let t0 = std::time::Instant::now();
        let reply = match &self.workers.tx {
            Some(tx) if self.fs.dirty_bytes_of(ino) >= OFFLOAD_DIRTY => {
                match tx.send((ino, datasync, reply, t0)) {
                    Ok(()) => return,
                    Err(std::sync::mpsc::SendError((_, _, reply, _))) => reply,
                }
            }
            _ => reply,
        };
        sync_or_queue(&self.fs, &self.fsyncs, ino, datasync, reply, t0)
    }

    fn entry(&self, r: crate::Result<Attr>, reply: ReplyEntry) {
        match r {
            Ok(a) => reply.entry(&TTL, &fattr(&a), Generation(a.generation)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    /// Creates a node; directories under a setgid directory inherit the bit.
    fn make(
        &self,
        req: &Request,
        parent: u64,
        name: &OsStr,
        mode: u32,
        rdev: u64,
    ) -> crate::Result<Attr> {
        let (c, sgid) = self.creds(req, parent);
        let mut mode = mode;
        if sgid && mode & libc::S_IFMT == libc::S_IFDIR {
            mode |= libc::S_ISGID;
        }
        if mode & libc::S_IFMT == libc::S_IFDIR {
            self.fs.mkdir(parent, name.as_bytes(), mode, c)
        } else {
            self.fs.mknod(parent, name.as_bytes(), mode, rdev, c)
        }
    }
}

impl Filesystem for FuseFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        if config
            .capabilities()
            .contains(InitFlags::FUSE_WRITEBACK_CACHE)
        {
            let _ = config.add_capabilities(InitFlags::FUSE_WRITEBACK_CACHE);
        }
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        // We clear set-id bits on write, truncate and chown ourselves; in return the
        // kernel stops asking for security.capability before every write() (one
        // GETXATTR round trip per write without it).
        let _ = config.add_capabilities(InitFlags::FUSE_HANDLE_KILLPRIV_V2);
        let _ = config.set_max_write(1 << 20);
        let _ = config.set_max_readahead(1 << 20);
        let _ = config.set_max_background(64);
        let _ = config.set_time_granularity(Duration::from_nanos(1));
        Ok(())
    }

    fn destroy(&mut self) {
        if let Err(e) = self.fs.commit() {
            tracing::error!("commit at unmount failed: {e}");
        }
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        self.entry(self.fs.lookup(to_ino(parent), name.as_bytes()), reply)
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.fs.forget(to_ino(ino), nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.fs.getattr(to_ino(ino)) {
            Ok(a) => reply.attr(&TTL, &fattr(&a)),
            Err(e) => reply.error(errno(&e)),
        }
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
        let ino = to_ino(ino);
        // A chown clears set-id bits always, a truncate unless the caller has
        // CAP_FSETID (the kernel leaves both to us: FUSE_HANDLE_KILLPRIV_V2).
        let chown = uid.is_some() || gid.is_some();
        let kill_suid = chown || (size.is_some() && self.has_suid(ino) && !has_fsetid(req.pid()));
        let set = SetAttr {
            mode,
            uid,
            gid,
            size,
            atime: atime.map(time_set),
            mtime: mtime.map(time_set),
            ctime,
            kill_suid,
        };
        match self.fs.setattr(ino, &set) {
            Ok(a) => reply.attr(&TTL, &fattr(&a)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.fs.readlink(to_ino(ino)) {
            Ok(t) => reply.data(&t),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        self.entry(
            self.make(req, to_ino(parent), name, mode, rdev as u64),
            reply,
        )
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
        let mode = libc::S_IFDIR | (mode & 0o7777);
        self.entry(self.make(req, to_ino(parent), name, mode, 0), reply)
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.fs.unlink(to_ino(parent), name.as_bytes()) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.fs.rmdir(to_ino(parent), name.as_bytes()) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let p = to_ino(parent);
        let (c, _) = self.creds(req, p);
        let r = self
            .fs
            .symlink(p, link_name.as_bytes(), target.as_os_str().as_bytes(), c);
        self.entry(r, reply)
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: FuseRenameFlags,
        reply: ReplyEmpty,
    ) {
        if flags.contains(FuseRenameFlags::RENAME_WHITEOUT) {
            return reply.error(Errno::from_i32(libc::EINVAL));
        }
        let f = RenameFlags {
            noreplace: flags.contains(FuseRenameFlags::RENAME_NOREPLACE),
            exchange: flags.contains(FuseRenameFlags::RENAME_EXCHANGE),
        };
        match self.fs.rename(
            to_ino(parent),
            name.as_bytes(),
            to_ino(newparent),
            newname.as_bytes(),
            f,
        ) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let p = to_ino(newparent);
        let r = self.fs.link(to_ino(ino), p, newname.as_bytes());
        self.entry(r, reply)
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let writes = flags.0 & libc::O_ACCMODE != libc::O_RDONLY || flags.0 & libc::O_TRUNC != 0;
        if writes && is_snapshot_ino(to_ino(ino)) {
            return reply.error(Errno::from_i32(libc::EROFS));
        }
        match self.fs.open_ino(to_ino(ino)) {
            Ok(a) if a.kind == FileKind::Dir => {
                let _ = self.fs.release(a.ino);
                reply.error(Errno::from_i32(libc::EISDIR))
            }
            Ok(_) => reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE),
            Err(e) => reply.error(errno(&e)),
        }
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
        thread_local! {
            /// Each request thread's reply buffer, kept across reads.
            static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        BUF.with(|b| {
            let mut b = b.borrow_mut();
            match self.fs.read_into(to_ino(ino), offset, size, &mut b) {
                Ok(()) => reply.data(&b),
                Err(e) => reply.error(errno(&e)),
            }
        })
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let ino = to_ino(ino);
        if write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID) {
            self.drop_privs(ino, true);
        }
        // Page-cache writeback: the kernel owns the times of what it cached.
        let r = if write_flags.contains(WriteFlags::FUSE_WRITE_CACHE) {
            self.fs.write_cached(ino, offset, data)
        } else {
            self.fs.write(ino, offset, data)
        };
        match r {
            Ok(n) => reply.written(n as u32),
            Err(e) => reply.error(errno(&e)),
        }
    }

    /// Nothing to do at close: the kernel writes back its dirty pages itself (and
    /// reports their errors) before it would send this. ENOSYS makes it stop sending
    /// FLUSH, which saves a round trip on every close.
    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::from_i32(libc::ENOSYS))
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        match self.fs.release(to_ino(ino)) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.queue_fsync(to_ino(ino), datasync, reply)
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.fs.getattr(to_ino(ino)) {
            Ok(a) if a.kind != FileKind::Dir => reply.error(Errno::from_i32(libc::ENOTDIR)),
            Ok(_) => reply.opened(FileHandle(0), FopenFlags::empty()),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        match self.fs.readdir(to_ino(ino), offset, 512) {
            Ok(list) => {
                for e in list {
                    if reply.add(
                        to_fuse(e.ino),
                        e.next_offset,
                        kind(e.kind),
                        OsStr::from_bytes(&e.name),
                    ) {
                        break;
                    }
                }
                reply.ok()
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        match self.fs.readdir(to_ino(ino), offset, 256) {
            Ok(list) => {
                for e in list {
                    // An entry removed since readdir looked is skipped, not an error.
                    let Ok(a) = self.fs.getattr(e.ino) else {
                        continue;
                    };
                    let full = reply.add(
                        to_fuse(e.ino),
                        e.next_offset,
                        OsStr::from_bytes(&e.name),
                        &TTL,
                        &fattr(&a),
                        Generation(a.generation),
                    );
                    if full {
                        break;
                    }
                }
                reply.ok()
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.queue_fsync(to_ino(ino), datasync, reply)
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let s = self.fs.statfs();
        reply.statfs(
            s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.bsize,
        )
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let create = flags & libc::XATTR_CREATE != 0;
        let replace = flags & libc::XATTR_REPLACE != 0;
        match self
            .fs
            .setxattr(to_ino(ino), name.as_bytes(), value, create, replace)
        {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let r = if ino.0 == 1 && name.as_bytes() == STATS_XATTR.as_bytes() {
            Ok(self.fs.stats().to_json().into_bytes())
        } else if ino.0 == 1 && name.as_bytes() == SPACE_XATTR.as_bytes() {
            self.fs.space_usage().map(|u| u.to_json().into_bytes())
        } else if name.as_bytes() == SNAPSHOT_XATTR.as_bytes() && is_snapshot_ino(to_ino(ino)) {
            self.fs
                .snapshot_info(to_ino(ino))
                .map(|s| s.to_json().to_string().into_bytes())
                .ok_or(Error::NoData)
        } else {
            self.fs.getxattr(to_ino(ino), name.as_bytes())
        };
        match r {
            Ok(v) if size == 0 => reply.size(v.len() as u32),
            Ok(v) if v.len() > size as usize => reply.error(Errno::from_i32(libc::ERANGE)),
            Ok(v) => reply.data(&v),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        match self.fs.listxattr(to_ino(ino)) {
            Ok(names) => {
                let mut buf = Vec::new();
                for n in names {
                    buf.extend_from_slice(&n);
                    buf.push(0);
                }
                if size == 0 {
                    reply.size(buf.len() as u32)
                } else if buf.len() > size as usize {
                    reply.error(Errno::from_i32(libc::ERANGE))
                } else {
                    reply.data(&buf)
                }
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.fs.removexattr(to_ino(ino), name.as_bytes()) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn access(&self, req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        match self
            .fs
            .access(to_ino(ino), mask.bits(), req.uid(), req.gid(), &[])
        {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
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
        let p = to_ino(parent);
        let r = self.make(req, p, name, mode, 0).and_then(|a| {
            self.fs.open_ino(a.ino)?;
            Ok(a)
        });
        match r {
            Ok(a) => reply.created(
                &TTL,
                &fattr(&a),
                Generation(a.generation),
                FileHandle(0),
                FopenFlags::FOPEN_KEEP_CACHE,
            ),
            Err(e) => reply.error(errno(&e)),
        }
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
        let known = libc::FALLOC_FL_KEEP_SIZE | libc::FALLOC_FL_PUNCH_HOLE;
        if mode & !known != 0 {
            return reply.error(Errno::from_i32(libc::EOPNOTSUPP));
        }
        let m = FallocMode {
            keep_size: mode & libc::FALLOC_FL_KEEP_SIZE != 0,
            punch_hole: mode & libc::FALLOC_FL_PUNCH_HOLE != 0,
        };
        match self.fs.fallocate(to_ino(ino), offset, length, m) {
            Ok(()) => {
                self.drop_privs_unless_fsetid(req, to_ino(ino));
                reply.ok()
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    /// Shares whole blocks instead of copying them (the kernel does not pass FICLONE
    /// to FUSE, so this is how `cp` gets a reflink); it has written back both ranges
    /// from its cache and drops the target's pages afterwards.
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
        if !flags.is_empty() {
            return reply.error(Errno::from_i32(libc::EINVAL));
        }
        // The reply counts in 32 bits; a short copy is allowed.
        let len = len.min(u64::from(u32::MAX) / 4096 * 4096);
        if len == 0 {
            return reply.written(0);
        }
        match self
            .fs
            .copy_file_range(to_ino(ino_in), offset_in, to_ino(ino_out), offset_out, len)
        {
            Ok(n) => {
                self.drop_privs_unless_fsetid(req, to_ino(ino_out));
                reply.written(n as u32)
            }
            Err(e) => reply.error(errno(&e)),
        }
    }
}
