//! The FUSE operations: each maps one kernel request onto [`Fs`] and its errors onto
//! errno, and answers through whichever transport brought the request (see
//! [`super::answer`]).
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
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, FopenFlags, Generation, INodeNo, TimeOrNow, WriteFlags,
};

use super::abi;
use super::answer::{
    done, AnswerAttr, AnswerCreate, AnswerData, AnswerDir, AnswerDirPlus, AnswerEmpty, AnswerEntry,
    AnswerIoctl, AnswerLseek, AnswerOpen, AnswerStatfs, AnswerWrite, AnswerXattr, Done,
};
use super::direct::{opens_to_write, DirectReads, DIRECT_FH};
use super::group::{FsyncQueue, PendingFsync, Preparing};
use super::standby::Standby;
use crate::error::Error;
use crate::fs::{
    is_acl_name, is_snapshot_ino, without_suid, Attr, Creds, FallocMode, FileKind, Fs, RenameFlags,
    SetAttr, TimeSet, ACL_ACCESS, ROOT_INO,
};

/// How long the kernel may trust what it was told, without asking again.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timeouts {
    /// Names and attributes (`timeout=`).
    pub entry: Duration,
    /// Names that do not exist (`negative_timeout=`); zero: ask every time.
    pub negative: Duration,
}

impl Default for Timeouts {
    /// One second for names and attributes, nothing for names that do not exist.
    fn default() -> Timeouts {
        Timeouts {
            entry: Duration::from_secs(1),
            negative: Duration::ZERO,
        }
    }
}

/// A virtual xattr of the mount's root: the daemon's statistics as JSON
/// (what `birchfs stats` reads). It is not listed and cannot be set.
pub const STATS_XATTR: &str = "birchfs.stats";

/// A virtual xattr of the mount's root: exclusive and shared data space as JSON, from
/// a walk over every file extent (what `birchfs stats --space` reads).
pub const SPACE_XATTR: &str = "birchfs.space";

/// A virtual xattr of each snapshot's root directory (`.snapshots/NAME`): the snapshot
/// as JSON (what `birchfs snapshot list` reads, one snapshot at a time).
pub const SNAPSHOT_XATTR: &str = "birchfs.snapshot";

/// Who sent a request: the caller's fs uid and gid, and its thread id.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Caller {
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
}

/// Longest a SEEK_DATA or SEEK_HOLE waits for the releases of a file's writers: a
/// close sends its RELEASE in the background, after close() has returned, so a seek
/// right after a writer closed the file can arrive first.
const WRITERS_WAIT: Duration = Duration::from_millis(50);

/// Handles open for writing, per inode; a release wakes who waits for none.
#[derive(Default)]
struct Writers {
    open: parking_lot::Mutex<std::collections::HashMap<u64, u32>>,
    released: parking_lot::Condvar,
    /// Inodes whose writeback failed for want of space, until a writer hears of it
    /// (see [`FuseFs::getattr`]) or the last writer closes.
    no_space: parking_lot::Mutex<std::collections::HashSet<u64>>,
}

/// Whether a handle opened with `flags` (the kernel's own, as at open and release)
/// can write.
fn writes(flags: i32) -> bool {
    flags & libc::O_ACCMODE != libc::O_RDONLY
}

impl Writers {
    /// Counts a handle of `ino` opened with `flags` if it writes.
    fn opened(&self, ino: u64, flags: i32) {
        if writes(flags) {
            *self.open.lock().entry(ino).or_default() += 1;
        }
    }

    /// Uncounts a handle of `ino` opened with `flags`, as [`Writers::opened`] counted it.
    fn released(&self, ino: u64, flags: i32) {
        if !writes(flags) {
            return;
        }
        let mut w = self.open.lock();
        if let Some(n) = w.get_mut(&ino) {
            *n -= 1;
            if *n == 0 {
                w.remove(&ino);
                self.no_space.lock().remove(&ino);
                self.released.notify_all();
            }
        }
    }

    /// Notes that a writeback of `ino` found no space; whether that is news (a
    /// writer is open and was not told yet). Held under the count's lock, so a
    /// release meanwhile cannot leave the note behind for a later writer.
    fn owe_no_space(&self, ino: u64) -> bool {
        let w = self.open.lock();
        w.contains_key(&ino) && self.no_space.lock().insert(ino)
    }

    /// Takes the note of [`Writers::owe_no_space`] for `ino`: whether there was one.
    fn take_no_space(&self, ino: u64) -> bool {
        self.no_space.lock().remove(&ino)
    }

    /// Whether `ino` has no handle open for writing, waiting up to `max` for that.
    fn none_within(&self, ino: u64, max: Duration) -> bool {
        let deadline = std::time::Instant::now() + max;
        let mut w = self.open.lock();
        while w.contains_key(&ino) {
            if self.released.wait_until(&mut w, deadline).timed_out() {
                return !w.contains_key(&ino);
            }
        }
        true
    }
}

/// The open directory handles of a mount and the index bound of each readdir.
#[derive(Default)]
struct DirHandles {
    next: std::sync::atomic::AtomicU64,
    bounds: parking_lot::Mutex<std::collections::HashMap<u64, u64>>,
}

impl DirHandles {
    /// A new handle, with no bound until its first read.
    fn open(&self) -> u64 {
        self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    fn set(&self, fh: u64, end: u64) {
        self.bounds.lock().insert(fh, end);
    }

    /// The bound of `fh`; none (everything listed) for a handle never read from 0.
    fn get(&self, fh: u64) -> u64 {
        self.bounds.lock().get(&fh).copied().unwrap_or(u64::MAX)
    }

    fn close(&self, fh: u64) {
        self.bounds.lock().remove(&fh);
    }
}

/// Serves a [`Fs`] through FUSE, over `/dev/fuse` or io_uring queues. Clones share
/// everything (the io_uring threads hold clones).
#[derive(Clone)]
pub struct FuseFs {
    pub(crate) fs: Arc<Fs>,
    fsyncs: Arc<FsyncQueue>,
    workers: Arc<FsyncWorkers>,
    /// Whether to offer the kernel FUSE over io_uring at INIT.
    pub(crate) uring: bool,
    /// Set at INIT when the kernel took FUSE over io_uring.
    pub(crate) uring_agreed: Arc<std::sync::atomic::AtomicBool>,
    /// Set at INIT when the kernel took POSIX ACLs (FUSE_POSIX_ACL with
    /// FUSE_DONT_MASK): it enforces them, and sends modes without the umask.
    pub(crate) acls: Arc<std::sync::atomic::AtomicBool>,
    /// Which opens read past the kernel's page cache.
    pub(crate) direct: Arc<DirectReads>,
    /// Open directory handles.
    dirs: Arc<DirHandles>,
    /// Handles open for writing, per inode (see [`FuseFs::lseek`]).
    writers: Arc<Writers>,
    /// Tells the kernel of changes the daemon makes on its own (set once mounted).
    notifier: Arc<std::sync::OnceLock<fuser::Notifier>>,
    /// How long the kernel may cache names and attributes.
    ttl: Timeouts,
    /// Which request threads park while no fsync comes (none by default).
    pub(crate) standby: Arc<Standby>,
}

/// Answers SEEK_DATA (`data`) or SEEK_HOLE from `offset` of `ino`, from birchfs's
/// extents.
fn answer_seek(fs: &Fs, ino: u64, offset: u64, data: bool, reply: impl AnswerLseek) {
    match fs.seek_data_hole(ino, offset, data) {
        Ok(p) => reply.offset(p),
        Err(e) => reply.error(errno(&e)),
    }
}

/// Declines SEEK_DATA or SEEK_HOLE of `ino` (ENOSYS): the kernel answers them itself
/// for the rest of the mount.
fn decline_seek(ino: u64, why: impl std::fmt::Display, reply: impl AnswerLseek) {
    tracing::info!(
        "SEEK_DATA/SEEK_HOLE on inode {ino}, open for writing ({why}): the kernel answers \
         them itself from now on"
    );
    reply.error(err(libc::ENOSYS))
}

impl FuseFs {
    /// Serves `fs` through FUSE over `/dev/fuse`.
    pub fn new(fs: Arc<Fs>) -> FuseFs {
        let fsyncs = Arc::new(FsyncQueue::default());
        let workers = Arc::new(FsyncWorkers::start(&fs, &fsyncs));
        FuseFs {
            fs,
            fsyncs,
            workers,
            uring: false,
            uring_agreed: Default::default(),
            acls: Default::default(),
            direct: Arc::new(DirectReads::new(None)),
            dirs: Default::default(),
            writers: Default::default(),
            notifier: Default::default(),
            ttl: Timeouts::default(),
            standby: Default::default(),
        }
    }

    /// Sets how long the kernel may cache names, attributes and missing names.
    pub fn timeouts(&mut self, t: Timeouts) {
        self.ttl = t;
    }

    /// Gives the session's notifier, through which the kernel hears of attribute
    /// changes it did not ask for (set-id bits cleared by a write).
    pub fn set_notifier(&self, n: fuser::Notifier) {
        let _ = self.notifier.set(n);
    }

    /// Lets read-only opens of files of at least `min_size` bytes read past the
    /// kernel's page cache (see `fuse::direct`); `None` (the default here) never.
    pub fn direct_reads(&mut self, min_size: Option<u64>) {
        self.direct = Arc::new(DirectReads::new(min_size));
    }

    /// Puts the `/dev/fuse` request threads beyond the first `core` on standby: they
    /// serve only while fsyncs arrive (see `fuse::standby`).
    pub fn standby_threads(&mut self, core: usize) {
        self.standby = Arc::new(Standby::new(core));
    }

    /// Lets group commits wait briefly for the fsyncs of threads expected back
    /// (see `fuse::group`); off by default.
    pub fn gather_fsyncs(&self, on: bool) {
        self.fsyncs.set_gather(on && self.workers.timer.is_some());
    }

    /// Lets the group commit's tuner try two committers at once where one is set
    /// (see `fuse::group`); off by default: one group commit at a time.
    pub fn tune_committers(&self, on: bool) {
        self.fsyncs.set_overlap(on);
    }

    /// Lets up to `n` group commits of fsyncs run at once (for FUSE over io_uring,
    /// where a committer answers other threads' fsyncs only through their threads).
    pub fn fsync_committers(&self, n: usize) {
        self.fsyncs.set_committers(n);
    }

    /// Offers the kernel FUSE over io_uring at INIT; [`FuseFs::uring_agreed`] tells
    /// afterwards whether it took it.
    pub fn offer_uring(&mut self) {
        self.uring = true;
    }

    /// Whether the kernel agreed at INIT to send requests through io_uring queues
    /// (which must then be started: [`super::uring::Rings::start`]).
    pub fn uring_agreed(&self) -> bool {
        self.uring_agreed.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// An fsync request on its way to the group commit (on a request thread or a worker).
struct FsyncJob {
    ino: u64,
    datasync: bool,
    reply: Done,
    /// When the request arrived.
    arrived: std::time::Instant,
    /// The thread that asked.
    pid: u32,
}

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
    /// The group commit's timer thread, which commits gathers whose time is up.
    timer: Option<(Arc<FsyncQueue>, std::thread::JoinHandle<()>)>,
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
                    let Ok(job) = job else {
                        break;
                    };
                    sync_or_queue(&fs, &queue, job, None);
                });
            match t {
                Ok(t) => threads.push(t),
                Err(e) => tracing::warn!("cannot start an fsync worker: {e}"),
            }
        }
        let (f, q) = (fs.clone(), queue.clone());
        let timer = queue.install_alarm().and_then(|()| {
            std::thread::Builder::new()
                .name("fsync-timer".into())
                .spawn(move || q.run_timer(&f))
        });
        let timer = match timer {
            Ok(t) => Some((queue.clone(), t)),
            Err(e) => {
                tracing::warn!(
                    "cannot start the group commit's timer, fsyncs are not gathered: {e}"
                );
                None
            }
        };
        FsyncWorkers {
            tx: (!threads.is_empty()).then_some(tx),
            threads,
            timer,
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
        if let Some((q, t)) = self.timer.take() {
            q.stop_timer();
            let _ = t.join();
        }
    }
}

/// Writes back the data of the job's inode, then answers the fsync at once or queues
/// it for the group commit. `prep`: the fsync was counted as preparing
/// ([`FsyncQueue::preparing`]); it leaves that count when it is queued or answered.
fn sync_or_queue(fs: &Fs, queue: &FsyncQueue, job: FsyncJob, prep: Option<Preparing<'_>>) {
    match fs.fsync_target(job.ino, job.datasync) {
        Err(e) => {
            fs.record_fsync_latency(job.arrived.elapsed());
            (job.reply)(Err(errno(&e)))
        }
        Ok(None) => {
            fs.record_fsync_latency(job.arrived.elapsed());
            (job.reply)(Ok(()))
        }
        Ok(Some(t)) => queue.submit(
            fs,
            PendingFsync {
                target: t,
                answer: job.reply,
                arrived: job.arrived,
                queued: std::time::Instant::now(),
                pid: job.pid,
            },
            prep,
        ),
    }
}

/// The capability that lets a process modify a set-id file and keep its set-id bits.
const CAP_FSETID: u32 = 4;

/// What decides whether a request's caller keeps a file's set-id bits, read from
/// `/proc/PID/status`; a caller that has exited counts as unprivileged and in no
/// group, which errs toward clearing the bits.
struct CallerPrivs {
    /// CAP_FSETID in the effective set.
    fsetid: bool,
    /// The filesystem gid and the supplementary groups.
    groups: Vec<u32>,
}

impl CallerPrivs {
    fn of(pid: u32) -> CallerPrivs {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(str::trim)
        };
        let fsetid = field("CapEff:")
            .and_then(|v| u64::from_str_radix(v, 16).ok())
            .is_some_and(|caps| caps & (1 << CAP_FSETID) != 0);
        let mut groups: Vec<u32> = field("Groups:")
            .map(|v| {
                v.split_whitespace()
                    .filter_map(|g| g.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        // Gid: real effective saved fs
        if let Some(fsgid) = field("Gid:").and_then(|v| v.split_whitespace().nth(3)?.parse().ok()) {
            groups.push(fsgid);
        }
        CallerPrivs { fsetid, groups }
    }

    /// Whether a change by this caller leaves S_ISGID on a file of group `gid`: one
    /// whose group may not execute (Linux 6.2's `setattr_should_drop_sgid`), or any
    /// whose access ACL it sets (`posix_acl_update_mode`).
    fn keeps_sgid(&self, gid: u32) -> bool {
        self.fsetid || self.groups.contains(&gid)
    }
}

/// birchfs's inode number of the kernel's node id.
pub(crate) fn to_ino(nodeid: u64) -> u64 {
    if nodeid == 1 {
        ROOT_INO
    } else {
        nodeid
    }
}

/// The kernel's node id of a birchfs inode number.
pub(crate) fn to_fuse(ino: u64) -> INodeNo {
    if ino == ROOT_INO {
        INodeNo(1)
    } else {
        INodeNo(ino)
    }
}

/// The errno of `e`; errors that mean damage or I/O failure are logged.
pub(crate) fn errno(e: &Error) -> Errno {
    match e {
        Error::Corrupt { .. } | Error::Io(_) | Error::BadImage(_) => tracing::error!("{e}"),
        _ => tracing::debug!("{e}"),
    }
    Errno::from_i32(e.errno())
}

/// The errno `code` (a libc constant).
pub(crate) fn err(code: i32) -> Errno {
    Errno::from_i32(code)
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

fn empty(r: crate::Result<()>, reply: impl AnswerEmpty) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(errno(&e)),
    }
}

/// What a setattr of deleted inode `ino` answers: a regular file with no links.
fn deleted_attr(ino: u64) -> Attr {
    Attr {
        ino,
        generation: 0,
        size: 0,
        blocks: 0,
        atime: SystemTime::UNIX_EPOCH,
        mtime: SystemTime::UNIX_EPOCH,
        ctime: SystemTime::UNIX_EPOCH,
        crtime: SystemTime::UNIX_EPOCH,
        kind: FileKind::File,
        perm: 0,
        nlink: 0,
        uid: 0,
        gid: 0,
        rdev: 0,
        flags: 0,
    }
}

/// The attribute changes of a setattr request.
#[derive(Default)]
pub(crate) struct SetAttrIn {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<TimeOrNow>,
    pub mtime: Option<TimeOrNow>,
    pub ctime: Option<SystemTime>,
}

impl FuseFs {
    /// Owner of a new inode: the caller (under a setgid directory, the filesystem
    /// gives it the directory's group).
    fn creds(c: &Caller) -> Creds {
        Creds {
            uid: c.uid,
            gid: c.gid,
        }
    }

    /// The set-id bits a change by `c` clears from `ino` (`None`: nothing to clear):
    /// `Some(outsider)` for [`SetAttr::kill_sgid`]. `flagged`: the kernel already
    /// found that the caller lacks CAP_FSETID.
    fn setid_to_clear(&self, c: &Caller, ino: u64, flagged: bool) -> Option<bool> {
        let a = self.fs.getattr(ino).ok()?;
        let perm = u32::from(a.perm);
        if a.kind == FileKind::Dir || perm & (libc::S_ISUID | libc::S_ISGID) == 0 {
            return None;
        }
        let p = CallerPrivs::of(c.pid);
        if p.fsetid && !flagged {
            return None;
        }
        let outsider = !p.groups.contains(&a.gid);
        (without_suid(perm, outsider) != perm).then_some(outsider)
    }

    /// Clears the set-id bits of `ino` (and with `caps` its file capabilities) after a
    /// change of its data by `c`: the kernel leaves this to the filesystem
    /// (FUSE_HANDLE_KILLPRIV_V2) and flags the writes that need it. Failures are
    /// logged; the change itself stands.
    fn drop_privs(&self, c: &Caller, ino: u64, caps: bool) {
        if let Some(outsider) = self.setid_to_clear(c, ino, true) {
            self.clear_suid(ino, outsider);
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
    fn drop_privs_unless_fsetid(&self, c: &Caller, ino: u64) {
        if let Some(outsider) = self.setid_to_clear(c, ino, false) {
            self.clear_suid(ino, outsider);
        }
    }

    /// Clears the set-id bits of `ino` (S_ISGID without group execute too for an
    /// `outsider`); a failure is logged.
    fn clear_suid(&self, ino: u64, outsider: bool) {
        let set = SetAttr {
            kill_suid: true,
            kill_sgid: outsider,
            ..Default::default()
        };
        if let Err(e) = self.fs.setattr(ino, &set) {
            tracing::warn!("clearing the set-id bits of inode {ino} failed: {e}");
            return;
        }
        // The kernel keeps the mode it cached (a direct write does not refresh it),
        // and exec decides set-id on that mode: drop it now.
        self.drop_cached_attrs(ino);
    }

    /// Creates a node for caller `c`, with `umask` as [`FuseFs::umask`] says.
    fn make(
        &self,
        c: &Caller,
        parent: u64,
        name: &[u8],
        mode: u32,
        rdev: u64,
        umask: u32,
    ) -> crate::Result<Attr> {
        self.fs
            .create_inheriting(parent, name, mode, rdev, Self::creds(c), self.umask(umask))
    }

    /// The umask a create applies: the caller's with ACLs on (the kernel leaves it to
    /// the filesystem then, for a default ACL replaces it), else none (the kernel
    /// applied it).
    fn umask(&self, umask: u32) -> u32 {
        if self.acls_on() {
            umask
        } else {
            0
        }
    }

    fn acls_on(&self) -> bool {
        self.acls.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether xattr `name` is a POSIX ACL this mount refuses (EOPNOTSUPP): without
    /// FUSE_POSIX_ACL the kernel would not enforce one, so storing it would only make
    /// setfacl look as if it worked.
    fn acl_refused(&self, name: &[u8]) -> bool {
        is_acl_name(name) && !self.acls_on()
    }

    /// The final commit, when the kernel ends the session.
    pub(crate) fn destroy(&self) {
        self.standby.close();
        if let Err(e) = self.fs.commit() {
            tracing::error!("commit at unmount failed: {e}");
        }
    }

    /// Answers with a name's inode, cached by the kernel for the entry timeout.
    fn entry(&self, r: crate::Result<Attr>, reply: impl AnswerEntry) {
        match r {
            Ok(a) => reply.entry(&self.ttl.entry, &fattr(&a), Generation(a.generation)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    /// Answers with attributes, cached by the kernel for the entry timeout.
    fn attr(&self, r: crate::Result<Attr>, reply: impl AnswerAttr) {
        match r {
            Ok(a) => reply.attr(&self.ttl.entry, &fattr(&a)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    /// A name that does not exist is answered as an entry of inode 0 when the
    /// negative timeout is set, which the kernel caches as a negative dentry; every
    /// name the kernel creates itself replaces it, and the daemon makes none alone.
    pub(crate) fn lookup(&self, parent: u64, name: &[u8], reply: impl AnswerEntry) {
        match self.fs.lookup(to_ino(parent), name) {
            Err(Error::NotFound) if !self.ttl.negative.is_zero() => {
                // Inode 0 (`to_fuse` maps only the root) is the kernel's "no such name".
                reply.entry(&self.ttl.negative, &fattr(&deleted_attr(0)), Generation(0))
            }
            r => self.entry(r, reply),
        }
    }

    pub(crate) fn forget(&self, nodeid: u64, nlookup: u64) {
        self.direct.forget(to_ino(nodeid));
        self.fs.forget(to_ino(nodeid), nlookup);
    }

    /// Attributes; `fh` is set when the kernel asks on behalf of an open file.
    ///
    /// With the writeback cache, a write() only lands in the kernel's page cache, and
    /// a failed writeback reaches the writer only at fsync or close: a writer that
    /// does neither (`dd if=/dev/zero of=fill`) would write forever on a full disk.
    /// But before each write() the kernel refreshes the file's attributes when they
    /// were invalidated, asking with the file's handle; so a writeback that finds no
    /// space invalidates them ([`FuseFs::write`]), and the next such request answers
    /// ENOSPC, which write() returns (as NFS returns a failed writeback's error from
    /// the next write()). A stat() asks without a handle and is answered as always.
    pub(crate) fn getattr(&self, nodeid: u64, fh: Option<u64>, reply: impl AnswerAttr) {
        let ino = to_ino(nodeid);
        if fh.is_some() && self.writers.take_no_space(ino) {
            return reply.error(err(libc::ENOSPC));
        }
        self.attr(self.fs.getattr(ino), reply)
    }

    pub(crate) fn setattr(&self, c: &Caller, nodeid: u64, s: SetAttrIn, reply: impl AnswerAttr) {
        let ino = to_ino(nodeid);
        // A chown clears S_ISUID always, a truncate unless the caller has CAP_FSETID
        // (the kernel leaves both to us: FUSE_HANDLE_KILLPRIV_V2); S_ISGID without
        // group execute goes too when the caller is outside the file's group.
        let chown = s.uid.is_some() || s.gid.is_some();
        let (kill_suid, kill_sgid) = if chown {
            // The file's group before the change decides, as in chown_common.
            let p = CallerPrivs::of(c.pid);
            let gid = self.fs.getattr(ino).map(|a| a.gid).unwrap_or(u32::MAX);
            (true, !p.keeps_sgid(gid))
        } else if s.size.is_some() {
            match self.setid_to_clear(c, ino, false) {
                Some(outsider) => (true, outsider),
                None => (false, false),
            }
        } else {
            (false, false)
        };
        let set = SetAttr {
            mode: s.mode,
            uid: s.uid,
            gid: s.gid,
            size: s.size,
            atime: s.atime.map(time_set),
            mtime: s.mtime.map(time_set),
            ctime: s.ctime,
            kill_suid,
            kill_sgid,
        };
        let times_only = s.mode.is_none()
            && s.uid.is_none()
            && s.gid.is_none()
            && s.size.is_none()
            && s.atime.is_none();
        match self.fs.setattr(ino, &set) {
            // Unlink stamps the file's ctime in the kernel's cache, which then writes the
            // times back, though birchfs freed the file with its last name (inode numbers
            // are never given again, so this is that file). Nothing is left to stamp; an
            // error would be kept as a writeback error of the whole mount and returned
            // by the next syncfs() (`sync -f`).
            Err(Error::NotFound) if times_only => {
                tracing::debug!("times of inode {ino}, deleted: nothing to set");
                reply.attr(&Duration::ZERO, &fattr(&deleted_attr(ino)))
            }
            r => self.attr(r, reply),
        }
    }

    pub(crate) fn readlink(&self, nodeid: u64, reply: impl AnswerData) {
        match self.fs.readlink(to_ino(nodeid)) {
            Ok(t) => reply.data(&t),
            Err(e) => reply.error(errno(&e)),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn mknod(
        &self,
        c: &Caller,
        parent: u64,
        name: &[u8],
        mode: u32,
        rdev: u32,
        umask: u32,
        reply: impl AnswerEntry,
    ) {
        self.entry(
            self.make(c, to_ino(parent), name, mode, rdev as u64, umask),
            reply,
        )
    }

    pub(crate) fn mkdir(
        &self,
        c: &Caller,
        parent: u64,
        name: &[u8],
        mode: u32,
        umask: u32,
        reply: impl AnswerEntry,
    ) {
        let mode = libc::S_IFDIR | (mode & 0o7777);
        self.entry(self.make(c, to_ino(parent), name, mode, 0, umask), reply)
    }

    pub(crate) fn unlink(&self, parent: u64, name: &[u8], reply: impl AnswerEmpty) {
        empty(self.fs.unlink(to_ino(parent), name), reply)
    }

    pub(crate) fn rmdir(&self, parent: u64, name: &[u8], reply: impl AnswerEmpty) {
        empty(self.fs.rmdir(to_ino(parent), name), reply)
    }

    pub(crate) fn symlink(
        &self,
        c: &Caller,
        parent: u64,
        name: &[u8],
        target: &[u8],
        reply: impl AnswerEntry,
    ) {
        let p = to_ino(parent);
        self.entry(self.fs.symlink(p, name, target, Self::creds(c)), reply)
    }

    /// `flags` are rename2's RENAME_* bits.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rename(
        &self,
        c: &Caller,
        parent: u64,
        name: &[u8],
        newparent: u64,
        newname: &[u8],
        flags: u32,
        reply: impl AnswerEmpty,
    ) {
        let known = libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE | libc::RENAME_WHITEOUT;
        if flags & !known != 0 {
            return reply.error(err(libc::EINVAL));
        }
        if flags & libc::RENAME_WHITEOUT != 0 {
            if flags & libc::RENAME_EXCHANGE != 0 {
                return reply.error(err(libc::EINVAL));
            }
            let (p, np) = (to_ino(parent), to_ino(newparent));
            let noreplace = flags & libc::RENAME_NOREPLACE != 0;
            return empty(
                self.fs
                    .rename_whiteout(p, name, np, newname, noreplace, Self::creds(c)),
                reply,
            );
        }
        let f = RenameFlags {
            noreplace: flags & libc::RENAME_NOREPLACE != 0,
            exchange: flags & libc::RENAME_EXCHANGE != 0,
        };
        let r = self
            .fs
            .rename(to_ino(parent), name, to_ino(newparent), newname, f);
        empty(r, reply)
    }

    pub(crate) fn link(
        &self,
        nodeid: u64,
        newparent: u64,
        newname: &[u8],
        reply: impl AnswerEntry,
    ) {
        self.entry(
            self.fs.link(to_ino(nodeid), to_ino(newparent), newname),
            reply,
        )
    }

    pub(crate) fn open(&self, nodeid: u64, flags: i32, reply: impl AnswerOpen) {
        let ino = to_ino(nodeid);
        if opens_to_write(flags) && is_snapshot_ino(ino) {
            return reply.error(err(libc::EROFS));
        }
        match self.fs.open_ino(ino) {
            Ok(a) if a.kind == FileKind::Dir => {
                let _ = self.fs.cancel_open(a.ino);
                reply.error(err(libc::EISDIR))
            }
            Ok(a) if Fs::check_open(&a, flags).is_err() => {
                let _ = self.fs.cancel_open(a.ino);
                reply.error(err(libc::EPERM))
            }
            Ok(a) if a.kind == FileKind::File => {
                self.writers.opened(a.ino, flags);
                match self.direct.open(a.ino, flags, a.size) {
                    DIRECT_FH => reply.opened(
                        FileHandle(DIRECT_FH),
                        FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_KEEP_CACHE,
                    ),
                    fh => reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE),
                }
            }
            Ok(_) => reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE),
            Err(e) => reply.error(errno(&e)),
        }
    }

    /// Reads for handle `fh` (see [`FuseFs::open`]).
    pub(crate) fn read(
        &self,
        nodeid: u64,
        fh: u64,
        offset: u64,
        size: u32,
        reply: impl AnswerData,
    ) {
        thread_local! {
            /// Each request thread's reply buffer, kept across reads.
            static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        BUF.with(|b| {
            let mut b = b.borrow_mut();
            let ino = to_ino(nodeid);
            match self.fs.read_into(ino, offset, size, &mut b) {
                Ok(()) => {
                    if fh == DIRECT_FH {
                        self.direct.read(ino, fh, offset, b.len() as u64);
                        self.fs.count_direct_read(b.len() as u64);
                    }
                    reply.data(&b)
                }
                Err(e) => reply.error(errno(&e)),
            }
        })
    }

    pub(crate) fn write(
        &self,
        c: &Caller,
        nodeid: u64,
        offset: u64,
        data: &[u8],
        flags: WriteFlags,
        reply: impl AnswerWrite,
    ) {
        let ino = to_ino(nodeid);
        if flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID) {
            self.drop_privs(c, ino, true);
        }
        // Page-cache writeback: the kernel owns the times of what it cached.
        let cached = flags.contains(WriteFlags::FUSE_WRITE_CACHE);
        let r = if cached {
            self.fs.write_cached(ino, offset, data)
        } else {
            self.fs.write(ino, offset, data)
        };
        match r {
            Ok(n) => reply.written(n as u32),
            Err(e) => {
                if cached && matches!(e, Error::NoSpace) {
                    self.no_space_for_writeback(ino);
                }
                reply.error(errno(&e))
            }
        }
    }

    /// Has the kernel drop the attributes it caches of `ino` (a change it did not
    /// make through a request that answers them).
    fn drop_cached_attrs(&self, ino: u64) {
        if let Some(n) = self.notifier.get() {
            if let Err(e) = n.inval_inode(to_fuse(ino), -1, 0) {
                tracing::debug!("invalidating the attributes of inode {ino} failed: {e}");
            }
        }
    }

    /// Notes that a writeback of `ino` found no space, so that its writers' next
    /// write() fails (see [`FuseFs::getattr`]).
    fn no_space_for_writeback(&self, ino: u64) {
        if !self.writers.owe_no_space(ino) {
            return;
        }
        self.drop_cached_attrs(ino);
    }

    /// Nothing to do at close: the kernel writes back its dirty pages itself (and
    /// reports their errors) before it would send this. ENOSYS makes it stop sending
    /// FLUSH, which saves a round trip on every close.
    pub(crate) fn flush(&self, reply: impl AnswerEmpty) {
        reply.error(err(libc::ENOSYS))
    }

    /// SEEK_DATA and SEEK_HOLE, from birchfs's extents once its cache of the file is
    /// written back. The kernel does not write back its own dirty pages before it
    /// asks, so while a handle of the file is open for writing, data may sit where
    /// birchfs cannot see it, and a hole reported there would make `cp` or `tar`
    /// skip it. Then the kernel is first told to drop its cache of the file from
    /// `offset` on, which writes its dirty pages there back (as WRITE requests), and
    /// the answer comes after that, from a thread of its own: the request threads
    /// serve those WRITEs meanwhile. Where that cannot be done (no notifier, or the
    /// kernel refused), the answer is ENOSYS, after which the kernel answers these
    /// itself for the rest of the mount (all data up to the size); before that, a
    /// seek waits a little for releases on their way ([`WRITERS_WAIT`]): once the
    /// last writer is released, the kernel has written its pages back (it does so on
    /// every close and release).
    pub(crate) fn lseek(&self, nodeid: u64, offset: u64, whence: i32, reply: impl AnswerLseek) {
        let ino = to_ino(nodeid);
        let data = match whence {
            libc::SEEK_DATA => true,
            libc::SEEK_HOLE => false,
            _ => return reply.error(err(libc::EINVAL)),
        };
        // With a notifier a writer's pages can be had at once: no waiting for one.
        let notifier = self.notifier.get().cloned();
        let wait = if notifier.is_some() {
            Duration::ZERO
        } else {
            WRITERS_WAIT
        };
        if self.writers.none_within(ino, wait) {
            return answer_seek(&self.fs, ino, offset, data, reply);
        }
        let Some(notifier) = notifier else {
            return decline_seek(ino, "no notifier", reply);
        };
        let fs = self.fs.clone();
        let from = i64::try_from(offset).unwrap_or(i64::MAX);
        let spawned = std::thread::Builder::new()
            .name("seek".into())
            .spawn(move || match notifier.inval_inode(to_fuse(ino), from, 0) {
                Ok(()) => answer_seek(&fs, ino, offset, data, reply),
                // The kernel holds nothing of the inode, so no pages either.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                    answer_seek(&fs, ino, offset, data, reply)
                }
                Err(e) => decline_seek(ino, e, reply),
            });
        if let Err(e) = spawned {
            // The reply went down with the closure; the kernel sees EIO.
            tracing::warn!("SEEK_DATA/SEEK_HOLE on inode {ino}: no thread for it: {e}");
        }
    }

    /// FITRIM (`fstrim`), for root or the user who mounted: discards the free space
    /// in the range asked for and answers how much. [`abi::BIRCHFS_IOC_RESIZE`], for
    /// them too: reports the sizes or grows the filesystem ([`FuseFs::resize`]).
    /// [`abi::BIRCHFS_IOC_SYNC`], for anyone (as sync(2) is): commits what birchfs
    /// holds and answers whether it reached the disk. The inode flags' four, for
    /// `lsattr` and `chattr` ([`FuseFs::fileattr`]). Every other ioctl gets ENOTTY,
    /// what a kernel filesystem answers for a command it does not know (FICLONE and
    /// the like never reach a FUSE server).
    pub(crate) fn ioctl(
        &self,
        c: &Caller,
        nodeid: u64,
        cmd: u32,
        in_data: &[u8],
        out_size: u32,
        reply: impl AnswerIoctl,
    ) {
        if cmd == abi::BIRCHFS_IOC_SYNC {
            if self.fs.options().readonly {
                return reply.ioctl(0, &[]);
            }
            return match self.fs.commit() {
                Ok(()) => reply.ioctl(0, &[]),
                Err(e) => {
                    tracing::error!("commit asked for by pid {} failed: {e}", c.pid);
                    reply.error(errno(&e))
                }
            };
        }
        if matches!(
            cmd,
            abi::FS_IOC_GETFLAGS
                | abi::FS_IOC_SETFLAGS
                | abi::FS_IOC_FSGETXATTR
                | abi::FS_IOC_FSSETXATTR
        ) {
            return self.fileattr(c, nodeid, cmd, in_data, out_size, reply);
        }
        if cmd != abi::FITRIM && cmd != abi::BIRCHFS_IOC_RESIZE {
            tracing::debug!("ioctl {cmd:#x} on inode {}: not supported", to_ino(nodeid));
            return reply.error(err(libc::ENOTTY));
        }
        // SAFETY: geteuid has no preconditions.
        if c.uid != 0 && c.uid != unsafe { libc::geteuid() } {
            return reply.error(err(libc::EPERM));
        }
        if cmd == abi::BIRCHFS_IOC_RESIZE {
            return self.resize(c, in_data, out_size, reply);
        }
        let Some((start, len, min_len)) = abi::fstrim_range(in_data).filter(|_| out_size >= 24)
        else {
            return reply.error(err(libc::EINVAL));
        };
        match self.fs.trim(start, len, min_len) {
            Ok(trimmed) => {
                tracing::info!("FITRIM: {trimmed} bytes of free space discarded");
                reply.ioctl(0, &abi::fstrim_range_bytes(start, trimmed, min_len))
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    /// The inode flags, through the kernel's fileattr calls: FS_IOC_GETFLAGS and
    /// FS_IOC_SETFLAGS (`lsattr`, `chattr`) as a 4-byte word of `FS_*_FL` bits,
    /// FS_IOC_FSGETXATTR and FS_IOC_FSSETXATTR (`xfs_io chattr`) as a `struct
    /// fsxattr`. A change is for root or the owner, and only root may set or clear
    /// immutable or append-only (the kernel checks as much before it asks).
    fn fileattr(
        &self,
        c: &Caller,
        nodeid: u64,
        cmd: u32,
        in_data: &[u8],
        out_size: u32,
        reply: impl AnswerIoctl,
    ) {
        let ino = to_ino(nodeid);
        let xattr = cmd == abi::FS_IOC_FSGETXATTR || cmd == abi::FS_IOC_FSSETXATTR;
        let get = cmd == abi::FS_IOC_GETFLAGS || cmd == abi::FS_IOC_FSGETXATTR;
        let want = if xattr { abi::FSXATTR_SIZE } else { 4 };
        if get && (out_size as usize) < want {
            return reply.error(err(libc::EINVAL));
        }
        let a = match self.fs.getattr(ino) {
            Ok(a) => a,
            Err(e) => return reply.error(errno(&e)),
        };
        let flags = if get {
            a.flags
        } else {
            let new = if xattr {
                abi::fsxattr_flags(in_data)
            } else {
                abi::flags_word(in_data).ok_or(libc::EINVAL)
            };
            let new = match new {
                Ok(f) => f,
                Err(e) => return reply.error(err(e)),
            };
            let fixed = crate::fs::FIXED as u32;
            if c.uid != 0 && (c.uid != a.uid || (new ^ a.flags) & fixed != 0) {
                return reply.error(err(libc::EPERM));
            }
            match self.fs.set_flags(ino, new) {
                Ok(now) => {
                    tracing::debug!("inode {ino}: flags {:#x} -> {:#x}", a.flags, now.flags);
                    // The change time moved and the kernel asks no attributes back
                    // (it keeps a regular file's ctime itself under the writeback
                    // cache, so there the new one shows once the inode is dropped).
                    self.drop_cached_attrs(ino);
                    now.flags
                }
                Err(e) => return reply.error(errno(&e)),
            }
        };
        // A set gives nothing back (the kernel asks for no bytes).
        let out = if xattr {
            abi::fsxattr_bytes(flags).to_vec()
        } else {
            abi::flags_word_bytes(flags).to_vec()
        };
        reply.ioctl(0, &out[..want.min(out_size as usize)])
    }

    /// [`abi::BIRCHFS_IOC_RESIZE`] (`birchfs resize` of a mount): answers the sizes,
    /// after growing the filesystem if asked (EINVAL for a size that is not larger;
    /// EROFS on a read-only mount).
    fn resize(&self, c: &Caller, in_data: &[u8], out_size: u32, reply: impl AnswerIoctl) {
        let Some((op, size)) = abi::resize_args(in_data).filter(|_| out_size >= 24) else {
            return reply.error(err(libc::EINVAL));
        };
        let from = self.fs.size();
        match op {
            abi::RESIZE_QUERY => {}
            abi::RESIZE_GROW if self.fs.options().readonly => {
                return reply.error(err(libc::EROFS));
            }
            abi::RESIZE_GROW if size & !4095 <= from => return reply.error(err(libc::EINVAL)),
            abi::RESIZE_GROW => match self.fs.grow(size) {
                Ok(()) => tracing::info!(
                    "grown from {from} to {} bytes, as pid {} asked",
                    self.fs.size(),
                    c.pid
                ),
                Err(e) => {
                    tracing::warn!(
                        "growing to {size} bytes, as pid {} asked, failed: {e}",
                        c.pid
                    );
                    return reply.error(errno(&e));
                }
            },
            _ => return reply.error(err(libc::EINVAL)),
        }
        match self.fs.device_size() {
            Ok(dev) => reply.ioctl(
                0,
                &abi::resize_answer(self.fs.size(), dev, self.fs.on_block_device()),
            ),
            Err(e) => reply.error(errno(&e)),
        }
    }

    /// Closes handle `fh`, opened with `flags` (the kernel's own, as at open).
    pub(crate) fn release(&self, nodeid: u64, fh: u64, flags: i32, reply: impl AnswerEmpty) {
        let ino = to_ino(nodeid);
        self.writers.released(ino, flags);
        let stale = self.direct.release(ino, fh);
        empty(self.fs.release(ino), reply);
        if stale {
            self.evict_from_kernel(ino);
        }
    }

    /// Has the kernel drop its dentries of `ino`'s names, so that the inode (closed
    /// now) leaves its cache and the next lookup takes birchfs's attributes: the
    /// mtime that writes past the kernel's cache (a writer beside a direct reader)
    /// left stale there. From a thread of its own, as the kernel locks each parent.
    fn evict_from_kernel(&self, ino: u64) {
        /// Names of one file it drops at most (a file with more stays cached).
        const MAX_NAMES: usize = 64;
        let Some(n) = self.notifier.get().cloned() else {
            return;
        };
        let fs = self.fs.clone();
        let spawned = std::thread::Builder::new()
            .name("evict".into())
            .spawn(move || {
                let names = match fs.names_of(ino, MAX_NAMES) {
                    Ok(v) => v,
                    Err(e) => {
                        tracing::debug!("names of inode {ino} to drop from the kernel: {e}");
                        return;
                    }
                };
                use std::os::unix::ffi::OsStrExt;
                for (parent, name) in names {
                    let name = std::ffi::OsStr::from_bytes(&name);
                    if let Err(e) = n.inval_entry(to_fuse(parent), name) {
                        tracing::debug!("dropping a name of inode {ino} from the kernel: {e}");
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::debug!("no thread to drop inode {ino} from the kernel: {e}");
        }
    }

    /// fsync and fdatasync (of files and directories): answered at once when nothing
    /// they need is new, else by the group commit; one with much data to write back
    /// first goes to a worker.
    pub(crate) fn fsync(&self, pid: u32, nodeid: u64, datasync: bool, reply: impl AnswerEmpty) {
        let ino = to_ino(nodeid);
        self.standby.fsync_arrived();
        let job = FsyncJob {
            ino,
            datasync,
            reply: done(reply),
            arrived: std::time::Instant::now(),
            pid,
        };
        let job = match &self.workers.tx {
            Some(tx) if self.fs.dirty_bytes_of(ino) >= OFFLOAD_DIRTY => {
                self.fsyncs.arrived(pid, job.arrived);
                match tx.send(job) {
                    Ok(()) => return,
                    Err(std::sync::mpsc::SendError(job)) => job,
                }
            }
            _ => job,
        };
        let prep = self.fsyncs.preparing(pid, job.arrived);
        sync_or_queue(&self.fs, &self.fsyncs, job, Some(prep))
    }

    /// Opens a directory; it stays (empty, with no links) while open after an rmdir
    /// or a rename over it, as on a kernel filesystem.
    pub(crate) fn opendir(&self, nodeid: u64, reply: impl AnswerOpen) {
        match self.fs.opendir(to_ino(nodeid)) {
            Ok(_) => reply.opened(FileHandle(self.dirs.open()), FopenFlags::empty()),
            Err(e) => reply.error(errno(&e)),
        }
    }

    /// The index bound of a readdir at `offset` through handle `fh`: taken anew at
    /// offset 0 (the first read, or after rewinddir), which sees the directory as
    /// it is then.
    fn dir_bound(&self, ino: u64, fh: u64, offset: u64) -> crate::Result<u64> {
        if offset == 0 {
            let end = self.fs.readdir_bound(ino)?;
            self.dirs.set(fh, end);
            return Ok(end);
        }
        Ok(self.dirs.get(fh))
    }

    /// Closes a directory opened by [`FuseFs::opendir`].
    pub(crate) fn releasedir(&self, nodeid: u64, fh: u64, reply: impl AnswerEmpty) {
        self.dirs.close(fh);
        empty(self.fs.release(to_ino(nodeid)), reply)
    }

    pub(crate) fn readdir(&self, nodeid: u64, fh: u64, offset: u64, mut reply: impl AnswerDir) {
        let ino = to_ino(nodeid);
        let r = self
            .dir_bound(ino, fh, offset)
            .and_then(|end| self.fs.readdir_until(ino, offset, 512, end));
        match r {
            Ok(list) => {
                for e in list {
                    let name = OsStr::from_bytes(&e.name);
                    if reply.add(to_fuse(e.ino), e.next_offset, kind(e.kind), name) {
                        break;
                    }
                }
                reply.ok()
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    pub(crate) fn readdirplus(
        &self,
        nodeid: u64,
        fh: u64,
        offset: u64,
        mut reply: impl AnswerDirPlus,
    ) {
        let ino = to_ino(nodeid);
        let r = self
            .dir_bound(ino, fh, offset)
            .and_then(|end| self.fs.readdir_until(ino, offset, 256, end));
        match r {
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
                        &self.ttl.entry,
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

    pub(crate) fn statfs(&self, reply: impl AnswerStatfs) {
        let s = self.fs.statfs();
        reply.statfs(
            s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.bsize,
        )
    }

    pub(crate) fn setxattr(
        &self,
        c: &Caller,
        nodeid: u64,
        name: &[u8],
        value: &[u8],
        flags: i32,
        reply: impl AnswerEmpty,
    ) {
        if self.acl_refused(name) {
            return reply.error(err(libc::EOPNOTSUPP));
        }
        if is_acl_name(name) {
            // The kernel leaves S_ISGID to the filesystem for an access ACL (it would
            // say so only with FUSE_SETXATTR_EXT, which fuser does not offer).
            let ino = to_ino(nodeid);
            let keep = name != ACL_ACCESS || {
                let gid = self.fs.getattr(ino).map_or(u32::MAX, |a| a.gid);
                CallerPrivs::of(c.pid).keeps_sgid(gid)
            };
            return empty(self.fs.set_acl(ino, name, value, keep), reply);
        }
        let create = flags & libc::XATTR_CREATE != 0;
        let replace = flags & libc::XATTR_REPLACE != 0;
        empty(
            self.fs
                .setxattr(to_ino(nodeid), name, value, create, replace),
            reply,
        )
    }

    pub(crate) fn getxattr(&self, nodeid: u64, name: &[u8], size: u32, reply: impl AnswerXattr) {
        let ino = to_ino(nodeid);
        let r = if nodeid == 1 && name == STATS_XATTR.as_bytes() {
            let mut s = self.fs.stats();
            s.direct_handles = self.direct.open_direct();
            Ok(s.to_json().into_bytes())
        } else if nodeid == 1 && name == SPACE_XATTR.as_bytes() {
            self.fs.space_usage().map(|u| u.to_json().into_bytes())
        } else if name == SNAPSHOT_XATTR.as_bytes() && is_snapshot_ino(ino) {
            self.fs
                .snapshot_info(ino)
                .map(|s| s.to_json().to_string().into_bytes())
                .ok_or(Error::NoData)
        } else if self.acl_refused(name) {
            return reply.error(err(libc::EOPNOTSUPP));
        } else {
            self.fs.getxattr(ino, name)
        };
        match r {
            Ok(v) => sized(&v, size, reply),
            Err(e) => reply.error(errno(&e)),
        }
    }

    pub(crate) fn listxattr(&self, nodeid: u64, size: u32, reply: impl AnswerXattr) {
        match self.fs.listxattr(to_ino(nodeid)) {
            Ok(names) => {
                let mut buf = Vec::new();
                for n in names {
                    buf.extend_from_slice(&n);
                    buf.push(0);
                }
                sized(&buf, size, reply)
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    pub(crate) fn removexattr(&self, nodeid: u64, name: &[u8], reply: impl AnswerEmpty) {
        if self.acl_refused(name) {
            return reply.error(err(libc::EOPNOTSUPP));
        }
        empty(self.fs.removexattr(to_ino(nodeid), name), reply)
    }

    pub(crate) fn access(&self, c: &Caller, nodeid: u64, mask: i32, reply: impl AnswerEmpty) {
        empty(
            self.fs.access(to_ino(nodeid), mask, c.uid, c.gid, &[]),
            reply,
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn create(
        &self,
        c: &Caller,
        parent: u64,
        name: &[u8],
        mode: u32,
        umask: u32,
        flags: i32,
        reply: impl AnswerCreate,
    ) {
        let r = self.fs.create_open(
            to_ino(parent),
            name,
            mode,
            Self::creds(c),
            self.umask(umask),
        );
        match r {
            Ok(a) => {
                self.direct.created(a.ino);
                self.writers.opened(a.ino, flags);
                reply.created(
                    &self.ttl.entry,
                    &fattr(&a),
                    Generation(a.generation),
                    FileHandle(0),
                    FopenFlags::FOPEN_KEEP_CACHE,
                )
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    pub(crate) fn fallocate(
        &self,
        c: &Caller,
        nodeid: u64,
        offset: u64,
        length: u64,
        mode: i32,
        reply: impl AnswerEmpty,
    ) {
        let known =
            libc::FALLOC_FL_KEEP_SIZE | libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE;
        if mode & !known != 0 {
            return reply.error(err(libc::EOPNOTSUPP));
        }
        let m = FallocMode {
            keep_size: mode & libc::FALLOC_FL_KEEP_SIZE != 0,
            punch_hole: mode & libc::FALLOC_FL_PUNCH_HOLE != 0,
            zero_range: mode & libc::FALLOC_FL_ZERO_RANGE != 0,
        };
        let ino = to_ino(nodeid);
        let r = self.fs.fallocate(ino, offset, length, m);
        if r.is_ok() {
            self.drop_privs_unless_fsetid(c, ino);
        }
        empty(r, reply)
    }

    /// Shares whole blocks instead of copying them (the kernel does not pass FICLONE
    /// to FUSE, so this is how `cp` gets a reflink); it has written back both ranges
    /// from its cache and drops the target's pages afterwards.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn copy_file_range(
        &self,
        c: &Caller,
        nodeid_in: u64,
        offset_in: u64,
        nodeid_out: u64,
        offset_out: u64,
        len: u64,
        flags: u64,
        reply: impl AnswerWrite,
    ) {
        if flags != 0 {
            return reply.error(err(libc::EINVAL));
        }
        // The reply counts in 32 bits; a short copy is allowed.
        let len = len.min(u64::from(u32::MAX) / 4096 * 4096);
        if len == 0 {
            return reply.written(0);
        }
        let (ino_in, ino_out) = (to_ino(nodeid_in), to_ino(nodeid_out));
        match self
            .fs
            .copy_file_range(ino_in, offset_in, ino_out, offset_out, len)
        {
            Ok(n) => {
                self.drop_privs_unless_fsetid(c, ino_out);
                reply.written(n as u32)
            }
            Err(e) => reply.error(errno(&e)),
        }
    }
}

/// Answers an xattr request with `v`: its size when the caller asked with size 0,
/// ERANGE when it does not fit.
fn sized(v: &[u8], size: u32, reply: impl AnswerXattr) {
    if size == 0 {
        reply.size(v.len() as u32)
    } else if v.len() > size as usize {
        reply.error(err(libc::ERANGE))
    } else {
        reply.data(v)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::{channel, Sender};

    use super::*;
    use crate::dev::MemDev;
    use crate::fs::{MkfsOptions, Options};
    use crate::fuse::answer::Answer;

    /// What a handler answered: an errno, an offset, a file handle or nothing.
    #[derive(Debug, PartialEq)]
    enum Got {
        Err(i32),
        Offset(u64),
        Handle(u64),
        Ok,
        Ioctl(i32, Vec<u8>),
    }

    /// An answer that reports what it was given.
    struct Reply(Sender<Got>);

    impl Answer for Reply {
        fn error(self, e: Errno) {
            let _ = self.0.send(Got::Err(e.code()));
        }
    }
    impl AnswerLseek for Reply {
        fn offset(self, offset: u64) {
            let _ = self.0.send(Got::Offset(offset));
        }
    }
    impl AnswerIoctl for Reply {
        fn ioctl(self, result: i32, data: &[u8]) {
            let _ = self.0.send(Got::Ioctl(result, data.to_vec()));
        }
    }
    impl AnswerOpen for Reply {
        fn opened(self, fh: FileHandle, _: FopenFlags) {
            let _ = self.0.send(Got::Handle(fh.0));
        }
    }
    impl AnswerCreate for Reply {
        fn created(self, _: &Duration, _: &FileAttr, _: Generation, fh: FileHandle, _: FopenFlags) {
            let _ = self.0.send(Got::Handle(fh.0));
        }
    }
    impl AnswerEmpty for Reply {
        fn ok(self) {
            let _ = self.0.send(Got::Ok);
        }
    }
    impl AnswerAttr for Reply {
        fn attr(self, _: &Duration, _: &FileAttr) {
            let _ = self.0.send(Got::Ok);
        }
    }
    impl AnswerWrite for Reply {
        fn written(self, n: u32) {
            let _ = self.0.send(Got::Offset(u64::from(n)));
        }
    }

    /// A writeback that finds no space is owed to the writer: the next GETATTR with a
    /// handle (the one before a write()) answers ENOSPC once; a stat (no handle) is
    /// answered; the debt goes with the last writer's release.
    #[test]
    fn a_writeback_without_space_fails_the_writers_next_write() {
        let Created {
            ffs,
            tx,
            rx,
            c,
            fh,
            ino,
            ..
        } = created(40 << 20);
        let r = || Reply(tx.clone());
        let block = vec![1u8; 1 << 20];
        let mut off = 0;
        let got = loop {
            ffs.write(&c, ino, off, &block, WriteFlags::FUSE_WRITE_CACHE, r());
            match rx.recv().unwrap() {
                Got::Offset(n) => off += n,
                other => break other,
            }
            assert!(off < 1 << 30, "the disk never filled");
        };
        assert_eq!(got, Got::Err(libc::ENOSPC));
        ffs.getattr(ino, None, r());
        assert_eq!(rx.recv().unwrap(), Got::Ok, "a stat is answered");
        ffs.getattr(ino, Some(fh), r());
        assert_eq!(
            rx.recv().unwrap(),
            Got::Err(libc::ENOSPC),
            "the writer hears"
        );
        ffs.getattr(ino, Some(fh), r());
        assert_eq!(rx.recv().unwrap(), Got::Ok, "once");
        // Owed again, then the writer closes: a later opener owes nothing.
        ffs.write(&c, ino, off, &block, WriteFlags::FUSE_WRITE_CACHE, r());
        assert_eq!(rx.recv().unwrap(), Got::Err(libc::ENOSPC));
        ffs.release(ino, fh, libc::O_WRONLY, r());
        assert_eq!(rx.recv().unwrap(), Got::Ok);
        ffs.open(ino, libc::O_RDWR, r());
        let Got::Handle(fh) = rx.recv().unwrap() else {
            panic!("open failed")
        };
        ffs.getattr(ino, Some(fh), r());
        assert_eq!(rx.recv().unwrap(), Got::Ok);
        // A write that is not a writeback (the writer hears at once) owes nothing.
        ffs.write(&c, ino, off, &block, WriteFlags::empty(), r());
        assert_eq!(rx.recv().unwrap(), Got::Err(libc::ENOSPC));
        ffs.getattr(ino, Some(fh), r());
        assert_eq!(rx.recv().unwrap(), Got::Ok);
    }

    /// A mount's handlers over a new filesystem of `size` bytes, with file `f`
    /// created for writing by `c`.
    struct Created {
        fs: Arc<Fs>,
        ffs: FuseFs,
        tx: Sender<Got>,
        rx: std::sync::mpsc::Receiver<Got>,
        c: Caller,
        fh: u64,
        ino: u64,
    }

    fn created(size: u64) -> Created {
        let dev = Arc::new(MemDev::new(size));
        Fs::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
        let fs = Arc::new(Fs::open(dev, Options::default()).unwrap());
        let ffs = FuseFs::new(fs.clone());
        let (tx, rx) = channel();
        let c = Caller {
            uid: 0,
            gid: 0,
            pid: 1,
        };
        ffs.create(
            &c,
            ROOT_INO,
            b"f",
            0o100644,
            0,
            libc::O_WRONLY,
            Reply(tx.clone()),
        );
        let Got::Handle(fh) = rx.recv().unwrap() else {
            panic!("create failed")
        };
        let ino = fs.lookup(ROOT_INO, b"f").unwrap().ino;
        Created {
            fs,
            ffs,
            tx,
            rx,
            c,
            fh,
            ino,
        }
    }

    /// A request from root.
    fn caller_root() -> Caller {
        Caller {
            uid: 0,
            gid: 0,
            pid: 1,
        }
    }

    /// A request from a user who is neither root nor the one who mounted.
    fn caller_not_mounter() -> Caller {
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        Caller {
            uid: if me == 65534 { 65533 } else { 65534 },
            gid: 65534,
            pid: 1,
        }
    }

    /// FITRIM answers the bytes trimmed in the range it was given, to root and to the
    /// user who mounted only; a short argument is EINVAL and any other ioctl ENOTTY.
    #[test]
    fn fitrim_answers_what_it_trimmed_and_only_to_who_may() {
        let Created {
            fs, ffs, tx, rx, ..
        } = created(64 << 20);
        let r = || Reply(tx.clone());
        let root = caller_root();
        let arg = abi::fstrim_range_bytes(0, u64::MAX, 0);
        ffs.ioctl(&root, ROOT_INO, abi::FITRIM, &arg, 24, r());
        let Got::Ioctl(0, out) = rx.recv().unwrap() else {
            panic!("FITRIM failed")
        };
        let (start, trimmed, min_len) = abi::fstrim_range(&out).unwrap();
        assert_eq!((start, min_len), (0, 0));
        let free = fs.statfs().bfree * 4096;
        assert_eq!(trimmed, free, "answered other than the free space");
        assert!(trimmed > 32 << 20, "trimmed {trimmed}");
        let other = caller_not_mounter();
        ffs.ioctl(&other, ROOT_INO, abi::FITRIM, &arg, 24, r());
        assert_eq!(rx.recv().unwrap(), Got::Err(libc::EPERM));
        ffs.ioctl(&root, ROOT_INO, abi::FITRIM, &arg[..16], 24, r());
        assert_eq!(rx.recv().unwrap(), Got::Err(libc::EINVAL));
        ffs.ioctl(&root, ROOT_INO, 0x8008_7601, &[], 8, r());
        assert_eq!(
            rx.recv().unwrap(),
            Got::Err(libc::ENOTTY),
            "FS_IOC_GETVERSION"
        );
    }

    /// The inode flags through the kernel's fileattr ioctls: FS_IOC_SETFLAGS and
    /// FS_IOC_FSSETXATTR set what FS_IOC_GETFLAGS and FS_IOC_FSGETXATTR read back;
    /// immutable and append-only are root's to change, the other flags the owner's
    /// too; a flag or hint birchfs does not keep is EOPNOTSUPP, a short argument
    /// EINVAL; an open the flags forbid is EPERM.
    #[test]
    fn inode_flags_through_the_fileattr_ioctls() {
        let Created {
            fs,
            ffs,
            tx,
            rx,
            ino,
            ..
        } = created(64 << 20);
        let r = || Reply(tx.clone());
        let root = caller_root();
        let owner = Caller {
            uid: 1000,
            gid: 100,
            pid: 1,
        };
        let other = Caller { uid: 1001, ..owner };
        let chown = SetAttr {
            uid: Some(1000),
            ..Default::default()
        };
        fs.setattr(ino, &chown).unwrap();
        let get = |cmd, size| {
            ffs.ioctl(&root, ino, cmd, &[], size, r());
            rx.recv().unwrap()
        };
        let set = |c: &Caller, cmd, arg: &[u8]| {
            ffs.ioctl(c, ino, cmd, arg, 0, r());
            rx.recv().unwrap()
        };
        let word = |f: u32| abi::flags_word_bytes(f).to_vec();
        let (imm, app, nodump) = (0x10u32, 0x20u32, 0x40u32);
        assert_eq!(get(abi::FS_IOC_GETFLAGS, 4), Got::Ioctl(0, word(0)));
        let ok = Got::Ioctl(0, vec![]);
        assert_eq!(set(&root, abi::FS_IOC_SETFLAGS, &word(imm)), ok);
        assert_eq!(get(abi::FS_IOC_GETFLAGS, 4), Got::Ioctl(0, word(imm)));
        let Got::Ioctl(0, x) = get(abi::FS_IOC_FSGETXATTR, 28) else {
            panic!("FS_IOC_FSGETXATTR failed")
        };
        assert_eq!(x.len(), 28);
        assert_eq!(x, abi::fsxattr_bytes(imm), "FS_XFLAG_IMMUTABLE");
        ffs.open(ino, libc::O_RDWR, r());
        assert_eq!(rx.recv().unwrap(), Got::Err(libc::EPERM));
        ffs.open(ino, libc::O_RDONLY, r());
        assert!(matches!(rx.recv().unwrap(), Got::Handle(_)));

        let eperm = Got::Err(libc::EPERM);
        assert_eq!(set(&owner, abi::FS_IOC_SETFLAGS, &word(0)), eperm);
        assert_eq!(set(&owner, abi::FS_IOC_SETFLAGS, &word(imm | nodump)), ok);
        assert_eq!(set(&other, abi::FS_IOC_SETFLAGS, &word(imm)), eperm);
        assert_eq!(fs.get_flags(ino).unwrap(), imm | nodump);

        let mut xa = abi::fsxattr_bytes(app);
        assert_eq!(set(&root, abi::FS_IOC_FSSETXATTR, &xa), ok);
        assert_eq!(fs.get_flags(ino).unwrap(), app);
        ffs.open(ino, libc::O_WRONLY, r());
        assert_eq!(rx.recv().unwrap(), Got::Err(libc::EPERM));
        ffs.open(ino, libc::O_WRONLY | libc::O_APPEND, r());
        assert!(matches!(rx.recv().unwrap(), Got::Handle(_)));

        let unsupported = Got::Err(libc::EOPNOTSUPP);
        assert_eq!(set(&root, abi::FS_IOC_SETFLAGS, &word(0x4)), unsupported);
        xa[6] = 1; // an extent size hint
        assert_eq!(set(&root, abi::FS_IOC_FSSETXATTR, &xa), unsupported);
        let einval = Got::Err(libc::EINVAL);
        assert_eq!(set(&root, abi::FS_IOC_SETFLAGS, &[0, 0]), einval);
        assert_eq!(set(&root, abi::FS_IOC_FSSETXATTR, &xa[..20]), einval);
        assert_eq!(get(abi::FS_IOC_GETFLAGS, 0), einval);
        assert_eq!(fs.get_flags(ino).unwrap(), app, "unchanged by the refusals");
    }

    /// BIRCHFS_IOC_RESIZE, to root and the user who mounted only: a query answers the
    /// filesystem's and the device's sizes; a grow lengthens the device and the
    /// filesystem (statfs sees the new space, a file written there reads back); a size
    /// not larger, a short argument or an unknown operation is EINVAL; a read-only
    /// mount is EROFS.
    #[test]
    fn the_resize_ioctl_grows_a_mounted_filesystem_for_who_may() {
        let Created {
            fs, ffs, tx, rx, ..
        } = created(64 << 20);
        let r = || Reply(tx.clone());
        let root = caller_root();
        let ask = |op: u64, size: u64| {
            let arg = abi::three_u64s([op, size, 0]);
            ffs.ioctl(&root, ROOT_INO, abi::BIRCHFS_IOC_RESIZE, &arg, 24, r());
            match rx.recv().unwrap() {
                Got::Ioctl(0, out) => Ok(abi::fstrim_range(&out).unwrap()),
                Got::Err(e) => Err(e),
                g => panic!("{g:?}"),
            }
        };
        assert_eq!(ask(abi::RESIZE_QUERY, 0), Ok((64 << 20, 64 << 20, 0)));
        assert_eq!(ask(abi::RESIZE_GROW, 64 << 20), Err(libc::EINVAL));
        assert_eq!(ask(abi::RESIZE_GROW, 32 << 20), Err(libc::EINVAL));
        assert_eq!(ask(7, 128 << 20), Err(libc::EINVAL));
        let blocks = fs.statfs().blocks;
        assert_eq!(
            ask(abi::RESIZE_GROW, (192 << 20) + 100),
            Ok((192 << 20, 192 << 20, 0))
        );
        assert!(fs.statfs().blocks >= blocks + (128 << 20) / 4096);
        let f = fs
            .mknod(ROOT_INO, b"big", 0o100644, 0, Creds { uid: 0, gid: 0 })
            .unwrap();
        let data: Vec<u8> = (0..150u32 << 20).map(|i| (i / 4099) as u8).collect();
        fs.write(f.ino, 0, &data).unwrap();
        fs.fsync(f.ino, false).unwrap();
        assert!(fs.read(f.ino, 0, data.len() as u32).unwrap() == data);
        let other = caller_not_mounter();
        let arg = abi::three_u64s([abi::RESIZE_QUERY, 0, 0]);
        ffs.ioctl(&other, ROOT_INO, abi::BIRCHFS_IOC_RESIZE, &arg, 24, r());
        assert_eq!(rx.recv().unwrap(), Got::Err(libc::EPERM));
        ffs.ioctl(
            &root,
            ROOT_INO,
            abi::BIRCHFS_IOC_RESIZE,
            &arg[..16],
            24,
            r(),
        );
        assert_eq!(rx.recv().unwrap(), Got::Err(libc::EINVAL));

        let dev = Arc::new(MemDev::new(64 << 20));
        Fs::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
        crate::dev::BlockDev::grow(dev.as_ref(), 128 << 20).unwrap();
        let ro = Options {
            readonly: true,
            ..Options::default()
        };
        let ffs = FuseFs::new(Arc::new(Fs::open(dev, ro).unwrap()));
        let arg = abi::three_u64s([abi::RESIZE_GROW, 128 << 20, 0]);
        ffs.ioctl(&root, ROOT_INO, abi::BIRCHFS_IOC_RESIZE, &arg, 24, r());
        assert_eq!(rx.recv().unwrap(), Got::Err(libc::EROFS));
        let arg = abi::three_u64s([abi::RESIZE_QUERY, 0, 0]);
        ffs.ioctl(&root, ROOT_INO, abi::BIRCHFS_IOC_RESIZE, &arg, 24, r());
        assert_eq!(
            rx.recv().unwrap(),
            Got::Ioctl(0, abi::three_u64s([64 << 20, 128 << 20, 0]).to_vec())
        );
    }

    /// The times the kernel writes back for a file that unlink just deleted are taken
    /// without an error (an error would fail the next syncfs of the mount); any other
    /// change of a deleted file is ENOENT.
    #[test]
    fn the_times_of_a_deleted_file_are_taken_and_nothing_else() {
        let Created {
            fs,
            ffs,
            tx,
            rx,
            c,
            fh,
            ino,
        } = created(64 << 20);
        let r = || Reply(tx.clone());
        ffs.release(ino, fh, libc::O_WRONLY, r());
        assert_eq!(rx.recv().unwrap(), Got::Ok);
        ffs.unlink(ROOT_INO, b"f", r());
        assert_eq!(rx.recv().unwrap(), Got::Ok);
        assert!(fs.getattr(ino).is_err(), "the file outlived its last name");
        let now = SystemTime::now();
        let times = || SetAttrIn {
            mtime: Some(TimeOrNow::SpecificTime(now)),
            ctime: Some(now),
            ..Default::default()
        };
        ffs.setattr(&c, ino, times(), r());
        assert_eq!(rx.recv().unwrap(), Got::Ok, "the kernel's flush of times");
        let chmod = SetAttrIn {
            mode: Some(0o600),
            ..times()
        };
        ffs.setattr(&c, ino, chmod, r());
        assert_eq!(rx.recv().unwrap(), Got::Err(libc::ENOENT));
        let truncate = SetAttrIn {
            size: Some(0),
            ..Default::default()
        };
        ffs.setattr(&c, ino, truncate, r());
        assert_eq!(rx.recv().unwrap(), Got::Err(libc::ENOENT));
    }

    /// BIRCHFS_IOC_SYNC commits what birchfs holds, for any caller: a power cut before
    /// it loses a write never fsynced, one after it keeps the write; a commit that fails
    /// is answered with its errno.
    #[test]
    fn the_sync_ioctl_commits_and_answers_a_failure() {
        use crate::dev::CrashDev;
        let mem = Arc::new(MemDev::new(64 << 20));
        Fs::mkfs(mem.clone(), &MkfsOptions::default()).unwrap();
        let dev = Arc::new(CrashDev::new(mem.image()));
        let fs = Arc::new(Fs::open(dev.clone(), Options::default()).unwrap());
        let ffs = FuseFs::new(fs.clone());
        let (tx, rx) = channel();
        let me = Creds {
            uid: 1000,
            gid: 100,
        };
        let f = fs.mknod(ROOT_INO, b"f", 0o100644, 0, me).unwrap();
        fs.write(f.ino, 0, b"synced").unwrap();
        // What a power cut now keeps: everything written up to the last flush.
        let cut = || {
            let upto = dev.flush_points().last().copied().unwrap_or(0);
            let fs = Fs::open(
                Arc::new(MemDev::from_image(dev.image_with(upto, &[]))),
                Options::default(),
            )
            .unwrap();
            let r = fs
                .lookup(ROOT_INO, b"f")
                .and_then(|a| fs.read(a.ino, 0, 64));
            r.ok()
        };
        assert_eq!(cut(), None, "the file was durable before the sync");
        let anyone = Caller {
            uid: 1000,
            gid: 100,
            pid: 1,
        };
        ffs.ioctl(
            &anyone,
            ROOT_INO,
            abi::BIRCHFS_IOC_SYNC,
            &[],
            0,
            Reply(tx.clone()),
        );
        assert_eq!(rx.recv().unwrap(), Got::Ioctl(0, vec![]));
        assert_eq!(
            cut().as_deref(),
            Some(&b"synced"[..]),
            "not durable after the sync"
        );
        // On a file too, and a dead disk is reported, not answered as done.
        fs.write(f.ino, 0, b"lost").unwrap();
        dev.fail_after(0);
        ffs.ioctl(
            &anyone,
            f.ino,
            abi::BIRCHFS_IOC_SYNC,
            &[],
            0,
            Reply(tx.clone()),
        );
        assert_eq!(rx.recv().unwrap(), Got::Err(libc::EIO));
    }

    /// SEEK_DATA answers from birchfs's extents only while no handle of the file is
    /// open for writing (the kernel may cache a writer's data): then ENOSYS, and
    /// again an answer once every writer, opened or created, is released.
    #[test]
    fn seek_data_is_declined_while_a_writer_is_open() {
        let Created {
            fs,
            ffs,
            tx,
            rx,
            fh: created,
            ino,
            ..
        } = created(64 << 20);
        let r = || Reply(tx.clone());
        fs.write(ino, 1 << 20, &[5; 4096]).unwrap();
        let seek = || {
            ffs.lseek(ino, 0, libc::SEEK_DATA, r());
            rx.recv().unwrap()
        };
        assert_eq!(seek(), Got::Err(libc::ENOSYS), "created for writing");
        ffs.release(ino, created, libc::O_WRONLY, r());
        assert_eq!(rx.recv().unwrap(), Got::Ok);
        assert_eq!(seek(), Got::Offset(1 << 20));
        ffs.open(ino, libc::O_RDONLY, r());
        let Got::Handle(reader) = rx.recv().unwrap() else {
            panic!("open failed")
        };
        assert_eq!(seek(), Got::Offset(1 << 20), "a reader changes nothing");
        ffs.open(ino, libc::O_RDWR, r());
        let Got::Handle(writer) = rx.recv().unwrap() else {
            panic!("open failed")
        };
        assert_eq!(seek(), Got::Err(libc::ENOSYS));
        ffs.release(ino, reader, libc::O_RDONLY, r());
        rx.recv().unwrap();
        assert_eq!(seek(), Got::Err(libc::ENOSYS), "the writer is still open");
        // A release on its way while the seek waits (as after a close).
        let later = ffs.clone();
        let tx2 = tx.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            later.release(ino, writer, libc::O_RDWR, Reply(tx2));
        });
        ffs.lseek(ino, 0, libc::SEEK_DATA, r());
        t.join().unwrap();
        let mut got = vec![rx.recv().unwrap(), rx.recv().unwrap()];
        got.sort_by_key(|g| format!("{g:?}"));
        assert_eq!(got, [Got::Offset(1 << 20), Got::Ok]);
        assert_eq!(seek(), Got::Offset(1 << 20));
        ffs.lseek(ino, 0, libc::SEEK_HOLE, r());
        assert_eq!(rx.recv().unwrap(), Got::Offset(0));
        ffs.lseek(ino, 0, libc::SEEK_END, r());
        assert_eq!(rx.recv().unwrap(), Got::Err(libc::EINVAL));
    }
}
