//! FUSE over io_uring (Linux 6.14+, fuse's `enable_uring` parameter on): requests
//! arrive in ring entries of per-CPU queues instead of through read(2) and write(2) on
//! `/dev/fuse`.
//!
//! The kernel keeps one queue per possible CPU and puts a request on the queue of the
//! CPU its caller runs on. Each queue here is served by threads pinned to that CPU;
//! each thread owns an io_uring and `depth` ring entries (a header buffer and a
//! payload buffer each, registered with FUSE_IO_URING_CMD_REGISTER). A request shows
//! up as the completion of its entry's command; the answer is written into the same
//! entry and sent with FUSE_IO_URING_CMD_COMMIT_AND_FETCH, which also hands the entry
//! back for the next request: one system call per request instead of two, and the
//! caller's CPU serves it, so no wakeup crosses CPUs.
//!
//! Answers can be given later and from other threads (the group commit answers every
//! waiting fsync after one flush): such an answer is written into its entry, the
//! entry's number is posted to its thread's mailbox, and the thread is woken through
//! an eventfd it keeps a read pending on. Only the owning thread ever submits to its
//! ring. An entry's buffers belong to whoever holds its `RingReply` until the
//! answer is posted; the buffers live as long as any reply or the thread holds them.
//!
//! INIT, FORGET and INTERRUPT still come through `/dev/fuse` (fuser's loop), as the
//! kernel sends them there.

// The FUSE ABI is in the host's byte order.
#![allow(clippy::host_endian_bytes)]

use std::cell::Cell;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use fuser::{Errno, FileAttr, FileHandle, FileType, FopenFlags, Generation, INodeNo, WriteFlags};
use io_uring::{cqueue, opcode, squeue, types, IoUring};

use super::abi::{self, Args, Body, InHeader};
use super::answer::{
    Answer, AnswerAttr, AnswerCreate, AnswerData, AnswerDir, AnswerDirPlus, AnswerEmpty,
    AnswerEntry, AnswerIoctl, AnswerLseek, AnswerOpen, AnswerStatfs, AnswerWrite, AnswerXattr,
};
use super::ops::{err, Caller, FuseFs, SetAttrIn};

/// `FUSE_IO_URING_CMD_REGISTER`: hand an entry to the kernel and wait for a request.
const CMD_REGISTER: u32 = 1;
/// `FUSE_IO_URING_CMD_COMMIT_AND_FETCH`: answer the entry's request, wait for the next.
const CMD_COMMIT_AND_FETCH: u32 = 2;

/// user_data of the eventfd read that wakes a thread for posted answers.
const WAKE: u64 = u64::MAX;

/// Room for one request's payload: the kernel wants at least max(max_write,
/// max_pages pages), 1 MiB as the mount sets them.
const PAYLOAD_SIZE: usize = (1 << 20) + 4096;

/// How the io_uring queues are served.
#[derive(Clone, Copy, Debug)]
pub struct RingConfig {
    /// Threads per queue (per possible CPU).
    pub threads: usize,
    /// Ring entries per thread: how many requests one thread can hold at once.
    pub depth: usize,
}

impl Default for RingConfig {
    fn default() -> Self {
        RingConfig {
            threads: 4,
            depth: 1,
        }
    }
}

/// Whether this process can make the io_uring the transport needs (128-byte entries)
/// and knows the kernel's number of queues (its possible CPUs).
pub fn available() -> bool {
    new_ring(4).is_ok() && cpu_list("possible").is_some()
}

/// Path of fuse's module parameter that lets the kernel offer io_uring queues.
pub const ENABLE_PARAM: &str = "/sys/module/fuse/parameters/enable_uring";

/// Whether fuse's `enable_uring` parameter is on.
pub fn enabled_in_kernel() -> bool {
    std::fs::read_to_string(ENABLE_PARAM).is_ok_and(|s| s.trim() == "Y" || s.trim() == "1")
}

fn new_ring(entries: u32) -> std::io::Result<IoUring<squeue::Entry128, cqueue::Entry>> {
    IoUring::<squeue::Entry128, cqueue::Entry>::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(entries)
        .or_else(|_| IoUring::<squeue::Entry128, cqueue::Entry>::builder().build(entries))
}

/// A CPU list of sysfs (`/sys/devices/system/cpu/NAME`, such as `0-3,6`).
fn cpu_list(name: &str) -> Option<Vec<usize>> {
    let text = std::fs::read_to_string(format!("/sys/devices/system/cpu/{name}")).ok()?;
    let mut cpus = Vec::new();
    for r in text.trim().split(',').filter(|r| !r.is_empty()) {
        let (a, b) = r.split_once('-').unwrap_or((r, r));
        let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
        cpus.extend(a..=b.min(a + 65535));
    }
    (!cpus.is_empty()).then_some(cpus)
}

/// Environment variable naming a queue whose threads fail before registering (tests:
/// the kernel must then be told to go back to `/dev/fuse`).
const FAIL_QUEUE_HOOK: &str = "BIRCHFS_TEST_URING_FAIL_QUEUE";

/// The threads serving a mount's io_uring queues.
pub struct Rings {
    threads: Vec<std::thread::JoinHandle<()>>,
    /// Each thread sends once on this when it ends.
    ended: std::sync::mpsc::Receiver<()>,
    /// Set by [`Rings::join`]: a thread whose waits keep failing stops retrying.
    stopping: Arc<std::sync::atomic::AtomicBool>,
}

impl Rings {
    /// Registers ring entries for every queue of the FUSE connection `dev` (whose
    /// INIT agreed to io_uring) and starts serving them. Returns once every thread
    /// has registered its entries or one failed, with the threads that run either way
    /// (to be joined at unmount). After a failure the kernel serves the connection
    /// through `/dev/fuse` unless every queue had an entry already; then the threads
    /// that did start go on serving.
    pub fn start(
        fs: &FuseFs,
        dev: BorrowedFd<'_>,
        cfg: RingConfig,
    ) -> (Rings, std::io::Result<()>) {
        let (tx, rx) = std::sync::mpsc::channel::<std::io::Result<()>>();
        let (ended_tx, ended) = std::sync::mpsc::channel::<()>();
        let mut rings = Rings {
            threads: Vec::new(),
            ended,
            stopping: Arc::default(),
        };
        let stopping = rings.stopping.clone();
        // `available` said the list is there; a kernel whose queues cannot be counted
        // is never offered io_uring at INIT.
        let Some(possible) = cpu_list("possible") else {
            give_up(dev);
            return (
                rings,
                Err(std::io::Error::other("no list of possible CPUs")),
            );
        };
        let online = cpu_list("online").unwrap_or_default();
        let usable = usable_cpus();
        // Test hook: the threads of this queue fail before they register anything.
        let fail_queue: Option<usize> = std::env::var(FAIL_QUEUE_HOOK)
            .ok()
            .and_then(|v| v.parse().ok());
        // Threads that will report whether they registered.
        let mut expected = 0;
        let mut spawn = |q: usize, t: usize| -> std::io::Result<()> {
            expected += 1;
            if fail_queue == Some(q) {
                let e = std::io::Error::other(format!(
                    "queue {q} failed on purpose ({FAIL_QUEUE_HOOK})"
                ));
                let _ = tx.send(Err(e));
                return Ok(());
            }
            let fd = dev.try_clone_to_owned().inspect_err(|_| expected -= 1)?;
            let (fs, tx, ended_tx) = (fs.clone(), tx.clone(), ended_tx.clone());
            let stopping = stopping.clone();
            let depth = cfg.depth.clamp(1, 256);
            let pin = usable.contains(&q);
            let h = std::thread::Builder::new()
                .name(format!("uring-{q}.{t}"))
                .spawn(move || {
                    if pin {
                        pin_to_cpu(q);
                    }
                    serve(&fs, fd, q as u16, depth, tx, &stopping);
                    drop(fs);
                    let _ = ended_tx.send(());
                })
                .inspect_err(|_| expected -= 1)?;
            rings.threads.push(h);
            Ok(())
        };
        let mut first_err = None;
        // The kernel numbers its queues 0..num_possible_cpus() and puts a request on
        // the queue of its caller's CPU.
        'spawning: for q in 0..possible.len() {
            // A CPU that is offline sends nothing until it comes online: one thread.
            let per_queue = if online.is_empty() || online.contains(&q) {
                cfg.threads.max(1)
            } else {
                1
            };
            for t in 0..per_queue {
                if let Err(e) = spawn(q, t) {
                    first_err = Some(e);
                    break 'spawning;
                }
            }
        }
        drop(tx);
        for r in rx.iter().take(expected) {
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        }
        match first_err {
            Some(e) => {
                give_up(dev);
                (rings, Err(e))
            }
            None => (rings, Ok(())),
        }
    }

    /// How many threads serve the queues.
    pub fn threads(&self) -> usize {
        self.threads.len()
    }

    /// Waits up to `limit` for the threads, which end when the kernel tears the
    /// connection's queues down (at unmount); threads still running then are left.
    pub fn join(self, limit: Duration) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let deadline = std::time::Instant::now() + limit;
        for _ in 0..self.threads.len() {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if self.ended.recv_timeout(left).is_err() {
                tracing::warn!("FUSE io_uring threads did not end within {limit:?}");
                return;
            }
        }
        for t in self.threads {
            let _ = t.join();
        }
    }
}

/// How a serving thread waits after `io_uring_enter` fails: 10 ms, doubling to a
/// second, with every failure logged until the pause reaches a second and then one
/// in 60.
#[derive(Debug, Default)]
struct WaitBackoff {
    /// Failures in a row.
    failures: u32,
}

impl WaitBackoff {
    /// Notes a failure; returns how long to pause and whether to log it.
    fn failed(&mut self) -> (Duration, bool) {
        self.failures = self.failures.saturating_add(1);
        let pause =
            Duration::from_millis(10 << (self.failures - 1).min(7)).min(Duration::from_secs(1));
        let log = self.failures <= 8 || self.failures % 60 == 0;
        (pause, log)
    }
}

/// Makes the kernel stop waiting for queues that will not all be registered: a
/// registration it must refuse (a queue number past any CPU) turns io_uring off for
/// the connection, and requests go through `/dev/fuse` again. (Once every queue has
/// an entry the kernel keeps using the queues; this then changes nothing.)
fn give_up(dev: BorrowedFd<'_>) {
    let r = (|| -> std::io::Result<bool> {
        let mut ring = new_ring(4)?;
        let e = EntryBuf::new();
        let sqe = register(types::Fd(dev.as_raw_fd()), u16::MAX, &e, 0);
        push_all(&mut ring, &[sqe])?;
        ring.submit()?;
        for _ in 0..100 {
            if let Some(c) = ring.completion().next() {
                return Ok(c.result() < 0);
            }
            std::thread::sleep(Duration::from_millis(10));
            ring.submit()?;
        }
        // Taken after all (it cannot be, for 65,535 CPUs): the kernel may use the
        // buffers, so they stay.
        std::mem::forget(e);
        std::mem::forget(ring);
        Ok(false)
    })();
    match r {
        Ok(true) => tracing::warn!("FUSE io_uring set-up failed; back to /dev/fuse"),
        Ok(false) => tracing::error!("FUSE io_uring set-up failed; the kernel did not answer"),
        Err(e) => tracing::error!("FUSE io_uring set-up failed and cannot be undone: {e}"),
    }
}

/// The CPUs this process may run on.
fn usable_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set that sched_getaffinity fills.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..8 * std::mem::size_of::<libc::cpu_set_t>())
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET stays within it for
    // cpu < CPU_SETSIZE, and sched_setaffinity only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if cpu >= 8 * std::mem::size_of::<libc::cpu_set_t>() {
            return;
        }
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            tracing::debug!(
                "cannot pin a uring thread to CPU {cpu}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// One ring entry's buffers, shared between the kernel (while registered), the thread
/// and the [`RingReply`] of the request it holds.
struct EntryBuf {
    header: *mut u8,
    payload: *mut u8,
    /// The iovecs the registration names (read by the kernel when it is submitted).
    iov: [libc::iovec; 2],
    /// An answer to a request that brought bytes in its payload (names, data),
    /// written here while the handler still reads them and copied into the payload
    /// by the owning thread before it commits.
    staged: parking_lot::Mutex<Option<Vec<u8>>>,
}

impl EntryBuf {
    fn new() -> EntryBuf {
        let header = Box::into_raw(vec![0u8; abi::RING_HEADER_SIZE].into_boxed_slice()) as *mut u8;
        let payload = Box::into_raw(vec![0u8; PAYLOAD_SIZE].into_boxed_slice()) as *mut u8;
        EntryBuf {
            header,
            payload,
            iov: [
                libc::iovec {
                    iov_base: header.cast(),
                    iov_len: abi::RING_HEADER_SIZE,
                },
                libc::iovec {
                    iov_base: payload.cast(),
                    iov_len: PAYLOAD_SIZE,
                },
            ],
            staged: Default::default(),
        }
    }
}

impl Drop for EntryBuf {
    fn drop(&mut self) {
        // SAFETY: both were made by Box::into_raw of boxed slices of these lengths in
        // `new`, and are freed once, here.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.header,
                abi::RING_HEADER_SIZE,
            )));
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.payload,
                PAYLOAD_SIZE,
            )));
        }
    }
}

/// A thread's entries and its mailbox of answered entries.
struct Slab {
    entries: Box<[EntryBuf]>,
    answered: parking_lot::Mutex<Vec<u16>>,
    wake: OwnedFd,
    /// Where the pending read of `wake` puts its count (written by the kernel only).
    wake_buf: std::cell::UnsafeCell<[u8; 8]>,
}

// SAFETY: the raw buffers are only touched by the one party that owns the entry at a
// time (see the module doc); handing over goes through the `answered` mutex.
unsafe impl Send for Slab {}
// SAFETY: as above.
unsafe impl Sync for Slab {}

thread_local! {
    /// The slab served by this thread (null elsewhere): answers given on it need no
    /// wakeup.
    static OWN_SLAB: Cell<*const Slab> = const { Cell::new(std::ptr::null()) };
}

impl Slab {
    /// Queues `idx` for its commit, waking the owning thread if another thread
    /// answered.
    fn post(&self, idx: u16) {
        self.answered.lock().push(idx);
        if !std::ptr::eq(OWN_SLAB.with(|s| s.get()), self) {
            let one = 1u64.to_ne_bytes();
            // SAFETY: writes 8 bytes from a live buffer to our eventfd.
            let n = unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
            if n != 8 {
                tracing::error!(
                    "cannot wake a uring thread: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    }
}

/// Serves one thread's entries of queue `qid` until the connection ends.
fn serve(
    fs: &FuseFs,
    dev: OwnedFd,
    qid: u16,
    depth: usize,
    ready: std::sync::mpsc::Sender<std::io::Result<()>>,
    stopping: &std::sync::atomic::AtomicBool,
) {
    let setup = || -> std::io::Result<(IoUring<squeue::Entry128, cqueue::Entry>, Arc<Slab>)> {
        let ring = new_ring((2 * depth + 4).next_power_of_two() as u32)?;
        // SAFETY: eventfd has no memory preconditions; the fd is checked below.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if efd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: efd is a new descriptor that nothing else owns.
        let wake = unsafe { OwnedFd::from_raw_fd(efd) };
        let entries = (0..depth).map(|_| EntryBuf::new()).collect();
        let slab = Arc::new(Slab {
            entries,
            answered: Default::default(),
            wake,
            wake_buf: std::cell::UnsafeCell::new([0; 8]),
        });
        Ok((ring, slab))
    };
    let (mut ring, slab) = match setup() {
        Ok(s) => s,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    OWN_SLAB.with(|s| s.set(Arc::as_ptr(&slab)));
    let fd = types::Fd(dev.as_raw_fd());
    let mut sqes: Vec<squeue::Entry128> = (0..depth)
        .map(|i| register(fd, qid, &slab.entries[i], i as u64))
        .collect();
    sqes.push(wake_read(&slab));
    let pushed = push_all(&mut ring, &sqes).and_then(|()| ring.submit().map(|_| ()));
    // A registration the kernel refuses completes at once with its error; a request
    // may already have arrived in another entry, and is served below.
    let mut cqes: Vec<(u64, i32)> = ring
        .completion()
        .map(|c| (c.user_data(), c.result()))
        .collect();
    let mut live = depth;
    let mut refused = None;
    cqes.retain(|&(ud, res)| {
        if ud != WAKE && res < 0 {
            live -= 1;
            refused.get_or_insert(std::io::Error::from_raw_os_error(-res));
            return false;
        }
        true
    });
    let _ = ready.send(match (pushed, refused) {
        (Err(e), _) | (Ok(()), Some(e)) => {
            tracing::warn!("FUSE io_uring queue {qid}: registration failed: {e}");
            Err(e)
        }
        (Ok(()), None) => Ok(()),
    });
    let mut commit_ids = vec![0u64; depth];
    // Refusals in a row per entry: a commit the kernel refuses while the connection
    // lives leaves the entry unusable, so it is registered again, a few times.
    let mut refusals = vec![0u32; depth];
    let mut backoff = WaitBackoff::default();
    let mut first = true;
    while live > 0 {
        if !first {
            match ring.submit_and_wait(1) {
                Ok(_) => backoff = WaitBackoff::default(),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {}
                Err(e) => {
                    // The requests this thread holds have no other way back, so it
                    // gives up only at unmount ([`Rings::join`]), whose completions
                    // it cannot reap: it waits longer each time (ENOMEM under
                    // memory pressure passes).
                    if stopping.load(std::sync::atomic::Ordering::Relaxed) {
                        tracing::error!("FUSE io_uring queue {qid}: wait failed ({e}) at unmount");
                        break;
                    }
                    let (pause, log) = backoff.failed();
                    if log {
                        tracing::error!(
                            "FUSE io_uring queue {qid}: wait failed ({e}); trying again \
                             in {pause:?}"
                        );
                    }
                    std::thread::sleep(pause);
                }
            }
            cqes.clear();
            cqes.extend(ring.completion().map(|c| (c.user_data(), c.result())));
        }
        first = false;
        let mut next: Vec<squeue::Entry128> = Vec::new();
        for &(ud, res) in &cqes {
            if ud == WAKE {
                next.push(wake_read(&slab));
                continue;
            }
            let idx = ud as usize;
            if res < 0 {
                let gone = [libc::ENOTCONN, libc::ECANCELED, libc::ECONNABORTED];
                let e = std::io::Error::from_raw_os_error(-res);
                if gone.contains(&-res) || refusals[idx] >= 3 {
                    // The connection is going away (or the entry keeps failing).
                    tracing::debug!("FUSE io_uring queue {qid}: entry {idx} ended: {e}");
                    live -= 1;
                } else {
                    tracing::warn!("FUSE io_uring queue {qid}: entry {idx} refused ({e}); registering it again");
                    refusals[idx] += 1;
                    next.push(register(fd, qid, &slab.entries[idx], idx as u64));
                }
                continue;
            }
            refusals[idx] = 0;
            commit_ids[idx] = commit_id_of(&slab.entries[idx]);
            let run = std::panic::AssertUnwindSafe(|| dispatch(fs, &slab, idx as u16));
            if std::panic::catch_unwind(run).is_err() {
                // The reply, dropped while unwinding, posted EIO.
                tracing::error!("FUSE io_uring queue {qid}: a request handler panicked");
            }
        }
        for i in std::mem::take(&mut *slab.answered.lock()) {
            let e = &slab.entries[i as usize];
            if let Some(body) = e.staged.lock().take() {
                // SAFETY: the entry is answered and not yet committed: its buffers are
                // this thread's, and no handler reads the request any more.
                unsafe { std::ptr::copy_nonoverlapping(body.as_ptr(), e.payload, body.len()) };
            }
            next.push(commit(fd, qid, commit_ids[i as usize], i as u64));
        }
        if let Err(e) = push_all(&mut ring, &next) {
            tracing::error!("FUSE io_uring queue {qid}: cannot queue answers: {e}");
        }
    }
    OWN_SLAB.with(|s| s.set(std::ptr::null()));
    // The ring goes first: closing it ends the kernel's use of the buffers.
    drop(ring);
    drop(slab);
}

/// The commit id the kernel gave the request in `e` (answers never write it).
fn commit_id_of(e: &EntryBuf) -> u64 {
    // SAFETY: reads within the header buffer, which is this thread's while the entry
    // holds a request.
    let h = unsafe { std::slice::from_raw_parts(e.header, abi::RING_HEADER_SIZE) };
    Args::new(&h[abi::ENT_IN_OUT..]).u64(8)
}

/// Pushes `sqes`, submitting first whenever the submission queue is full.
fn push_all(
    ring: &mut IoUring<squeue::Entry128, cqueue::Entry>,
    sqes: &[squeue::Entry128],
) -> std::io::Result<()> {
    for e in sqes {
        loop {
            // SAFETY: every buffer an entry names (iovecs, entry buffers, the wake
            // buffer) lives in the slab, which outlives the ring (`serve` closes the
            // ring first).
            if unsafe { ring.submission().push(e) }.is_ok() {
                break;
            }
            ring.submit()?;
        }
    }
    Ok(())
}

/// The 80-byte command area of a FUSE ring command (`struct fuse_uring_cmd_req`).
fn cmd_req(commit_id: u64, qid: u16) -> [u8; 80] {
    let mut c = [0u8; 80];
    c[8..16].copy_from_slice(&commit_id.to_ne_bytes());
    c[16..18].copy_from_slice(&qid.to_ne_bytes());
    c
}

fn register(fd: types::Fd, qid: u16, e: &EntryBuf, ud: u64) -> squeue::Entry128 {
    let sqe = opcode::UringCmd80::new(fd, CMD_REGISTER)
        .cmd(cmd_req(0, qid))
        .addr(Some(e.iov.as_ptr() as u64))
        .build()
        .user_data(ud);
    with_len(sqe, 2)
}

fn commit(fd: types::Fd, qid: u16, commit_id: u64, ud: u64) -> squeue::Entry128 {
    opcode::UringCmd80::new(fd, CMD_COMMIT_AND_FETCH)
        .cmd(cmd_req(commit_id, qid))
        .build()
        .user_data(ud)
}

/// Sets the SQE's `len` (bytes 24..28), which the crate's UringCmd80 does not expose:
/// FUSE's REGISTER takes the number of iovecs there.
fn with_len(sqe: squeue::Entry128, len: u32) -> squeue::Entry128 {
    const _: () = assert!(std::mem::size_of::<squeue::Entry128>() == 128);
    // SAFETY: Entry128 is repr(C) over the kernel's 128-byte SQE, plain data.
    let mut raw: [u8; 128] = unsafe { std::mem::transmute(sqe) };
    raw[24..28].copy_from_slice(&len.to_ne_bytes());
    // SAFETY: as above; every byte pattern is a valid SQE value.
    unsafe { std::mem::transmute(raw) }
}

fn wake_read(slab: &Slab) -> squeue::Entry128 {
    squeue::Entry128::from(
        opcode::Read::new(
            types::Fd(slab.wake.as_raw_fd()),
            slab.wake_buf.get().cast(),
            8,
        )
        .build()
        .user_data(WAKE),
    )
}

/// Runs `f` with the name that starts `payload` and the bytes after it; EINVAL when
/// the name has no terminating NUL.
fn with_name(payload: &[u8], r: RingReply, f: impl FnOnce(&[u8], &[u8], RingReply)) {
    match abi::strings::<1>(payload) {
        Some(([name], rest)) => f(name, rest, r),
        None => r.error(err(libc::EINVAL)),
    }
}

/// Decodes the request in entry `idx` and runs it.
fn dispatch(fs: &FuseFs, slab: &Arc<Slab>, idx: u16) {
    let e = &slab.entries[idx as usize];
    // SAFETY: the entry holds a request: its buffers are this thread's until the
    // answer is posted. The answer writes the header's first 16 bytes and the payload
    // size, never the argument area the handler reads (`op`); and it writes the
    // payload only when the request brought nothing there (else it is staged, see
    // `EntryBuf::staged`).
    let header = unsafe { std::slice::from_raw_parts(e.header, abi::RING_HEADER_SIZE) };
    let h = InHeader::parse(&header[..abi::IN_OUT_SIZE]);
    let op = Args::new(&header[abi::IN_OUT_SIZE..abi::ENT_IN_OUT]);
    let len = (Args::new(&header[abi::ENT_IN_OUT..]).u32(16) as usize).min(PAYLOAD_SIZE);
    // SAFETY: as above; `len` is within the buffer.
    let payload = unsafe { std::slice::from_raw_parts(e.payload, len) };
    let reply = RingReply {
        slab: Some(slab.clone()),
        idx,
        unique: h.unique,
        len: 0,
        limit: PAYLOAD_SIZE,
        staged: (len > 0).then(Vec::new),
    };
    let c = Caller {
        uid: h.uid,
        gid: h.gid,
        pid: h.pid,
    };
    fs.fs.count_uring_request();
    fs.fs.count_fuse_request(h.opcode);
    run(fs, &h, &c, &op, payload, reply);
}

fn run(fs: &FuseFs, h: &InHeader, c: &Caller, op: &Args, payload: &[u8], mut r: RingReply) {
    let n = h.nodeid;
    match h.opcode {
        abi::LOOKUP => with_name(payload, r, |name, _, r| fs.lookup(n, name, r)),
        // fuse_getattr_in: getattr_flags, dummy, fh.
        abi::GETATTR => {
            let fh = (op.u32(0) & abi::GETATTR_FH != 0).then(|| op.u64(8));
            fs.getattr(n, fh, r)
        }
        abi::SETATTR => {
            let valid = op.u32(0);
            let has = |bit: u32| valid & bit != 0;
            let time = |bit, now, secs_at, nsecs_at| {
                has(bit).then(|| {
                    if has(now) {
                        fuser::TimeOrNow::Now
                    } else {
                        fuser::TimeOrNow::SpecificTime(abi::system_time(
                            op.u64(secs_at),
                            op.u32(nsecs_at),
                        ))
                    }
                })
            };
            let s = SetAttrIn {
                mode: has(abi::FATTR_MODE).then(|| op.u32(68)),
                uid: has(abi::FATTR_UID).then(|| op.u32(76)),
                gid: has(abi::FATTR_GID).then(|| op.u32(80)),
                size: has(abi::FATTR_SIZE).then(|| op.u64(16)),
                atime: time(abi::FATTR_ATIME, abi::FATTR_ATIME_NOW, 32, 56),
                mtime: time(abi::FATTR_MTIME, abi::FATTR_MTIME_NOW, 40, 60),
                ctime: has(abi::FATTR_CTIME).then(|| abi::system_time(op.u64(48), op.u32(64))),
            };
            fs.setattr(c, n, s, r)
        }
        abi::READLINK => fs.readlink(n, r),
        abi::SYMLINK => match abi::strings::<2>(payload) {
            Some(([name, target], _)) => fs.symlink(c, n, name, target, r),
            None => r.error(err(libc::EINVAL)),
        },
        abi::MKNOD => with_name(payload, r, |name, _, r| {
            fs.mknod(c, n, name, op.u32(0), op.u32(4), op.u32(8), r)
        }),
        abi::MKDIR => with_name(payload, r, |name, _, r| {
            fs.mkdir(c, n, name, op.u32(0), op.u32(4), r)
        }),
        abi::UNLINK => with_name(payload, r, |name, _, r| fs.unlink(n, name, r)),
        abi::RMDIR => with_name(payload, r, |name, _, r| fs.rmdir(n, name, r)),
        abi::RENAME | abi::RENAME2 => {
            let flags = if h.opcode == abi::RENAME2 {
                op.u32(8)
            } else {
                0
            };
            match abi::strings::<2>(payload) {
                Some(([from, to], _)) => fs.rename(c, n, from, op.u64(0), to, flags, r),
                None => r.error(err(libc::EINVAL)),
            }
        }
        abi::LINK => with_name(payload, r, |name, _, r| fs.link(op.u64(0), n, name, r)),
        abi::OPEN => fs.open(n, op.u32(0) as i32, r),
        abi::READ => fs.read(n, op.u64(0), op.u64(8), op.u32(16), r),
        abi::WRITE => {
            let size = (op.u32(16) as usize).min(payload.len());
            let flags = WriteFlags::from_bits_truncate(op.u32(20));
            fs.write(c, n, op.u64(8), &payload[..size], flags, r)
        }
        abi::STATFS => fs.statfs(r),
        abi::RELEASE => fs.release(n, op.u64(0), op.u32(8) as i32, r),
        abi::FSYNC | abi::FSYNCDIR => fs.fsync(c.pid, n, op.u32(8) & abi::FSYNC_FDATASYNC != 0, r),
        abi::SETXATTR => with_name(payload, r, |name, value, r| {
            let size = (op.u32(0) as usize).min(value.len());
            fs.setxattr(c, n, name, &value[..size], op.u32(4) as i32, r)
        }),
        abi::GETXATTR => with_name(payload, r, |name, _, r| fs.getxattr(n, name, op.u32(0), r)),
        abi::LISTXATTR => fs.listxattr(n, op.u32(0), r),
        abi::REMOVEXATTR => with_name(payload, r, |name, _, r| fs.removexattr(n, name, r)),
        abi::FLUSH => fs.flush(r),
        abi::OPENDIR => fs.opendir(n, r),
        abi::READDIR | abi::READDIRPLUS => {
            r.limit = (op.u32(16) as usize).min(PAYLOAD_SIZE);
            if h.opcode == abi::READDIR {
                fs.readdir(n, op.u64(0), op.u64(8), r)
            } else {
                fs.readdirplus(n, op.u64(0), op.u64(8), r)
            }
        }
        abi::RELEASEDIR => fs.releasedir(n, op.u64(0), r),
        abi::ACCESS => fs.access(c, n, op.u32(0) as i32, r),
        abi::CREATE => with_name(payload, r, |name, _, r| {
            fs.create(c, n, name, op.u32(4), op.u32(8), op.u32(0) as i32, r)
        }),
        abi::DESTROY => {
            fs.destroy();
            AnswerEmpty::ok(r)
        }
        abi::FALLOCATE => fs.fallocate(c, n, op.u64(8), op.u64(16), op.u32(24) as i32, r),
        abi::LSEEK => match i64::try_from(op.u64(8)) {
            Ok(off) => fs.lseek(n, off as u64, op.u32(16) as i32, r),
            Err(_) => r.error(err(libc::ENXIO)),
        },
        abi::COPY_FILE_RANGE => {
            let (off_in, out, off_out) = (op.u64(8), op.u64(16), op.u64(32));
            fs.copy_file_range(c, n, off_in, out, off_out, op.u64(40), op.u64(48), r)
        }
        // fuse_ioctl_in: fh, flags, cmd at 12, arg, in_size at 24, out_size at 28;
        // the argument's bytes come as the payload.
        abi::IOCTL => {
            let data = &payload[..(op.u32(24) as usize).min(payload.len())];
            fs.ioctl(c, n, op.u32(12), data, op.u32(28), r)
        }
        abi::FORGET | abi::BATCH_FORGET => {
            // The kernel sends these through /dev/fuse; a forget has no answer.
            tracing::warn!("FUSE io_uring: unexpected forget request");
            r.error(err(libc::ENOSYS))
        }
        _ => r.error(err(libc::ENOSYS)),
    }
}

/// The answer to a request that came through a ring entry: written into the entry and
/// posted to its thread. Dropped without an answer, it answers EIO.
pub(crate) struct RingReply {
    slab: Option<Arc<Slab>>,
    idx: u16,
    unique: u64,
    /// Bytes of the body written so far (directory listings fill it entry by entry).
    len: usize,
    /// Most bytes the body may take.
    limit: usize,
    /// The body, while the request's own payload may still be read (see
    /// `EntryBuf::staged`); None: the body goes straight into the payload.
    staged: Option<Vec<u8>>,
}

impl RingReply {
    /// The reply body, from `self.len` on.
    fn body(&mut self) -> Body<'_> {
        if let Some(v) = &mut self.staged {
            return Body::staged(v, self.len, self.limit);
        }
        let slab = self
            .slab
            .as_ref()
            .expect("an answered reply is not written again");
        let e = &slab.entries[self.idx as usize];
        // SAFETY: the entry's buffers are this reply's until it is posted, and the
        // request brought no payload that a handler could still be reading.
        let buf = unsafe { std::slice::from_raw_parts_mut(e.payload, self.limit) };
        Body::new(buf, self.len)
    }

    /// Writes the out header (`error` is a negative errno or 0) and posts the entry.
    fn finish(&mut self, error: i32, body: usize) {
        let Some(slab) = self.slab.take() else {
            return;
        };
        let e = &slab.entries[self.idx as usize];
        let body = if error == 0 { body } else { 0 };
        if let Some(mut v) = self.staged.take() {
            if body > 0 {
                v.truncate(body);
                *e.staged.lock() = Some(v);
            }
        }
        // SAFETY: the entry's header is this reply's until it is posted.
        let header = unsafe { std::slice::from_raw_parts_mut(e.header, abi::RING_HEADER_SIZE) };
        header[0..4].copy_from_slice(&(16 + body as u32).to_ne_bytes());
        header[4..8].copy_from_slice(&error.to_ne_bytes());
        header[8..16].copy_from_slice(&self.unique.to_ne_bytes());
        let sz = abi::ENT_IN_OUT + 16;
        header[sz..sz + 4].copy_from_slice(&(body as u32).to_ne_bytes());
        slab.post(self.idx);
    }

    /// Writes a whole body with `f` and answers with it (EIO if it does not fit).
    fn send(mut self, f: impl FnOnce(&mut Body) -> Result<(), abi::Overflow>) {
        self.len = 0;
        let mut b = self.body();
        match f(&mut b) {
            Ok(()) => {
                let n = b.len();
                self.finish(0, n)
            }
            Err(abi::Overflow) => {
                tracing::error!("FUSE io_uring: an answer did not fit its entry");
                self.finish(-libc::EIO, 0)
            }
        }
    }
}

impl Drop for RingReply {
    fn drop(&mut self) {
        if self.slab.is_some() {
            tracing::warn!("FUSE io_uring: request {} dropped unanswered", self.unique);
            self.finish(-libc::EIO, 0);
        }
    }
}

impl Answer for RingReply {
    fn error(mut self, err: Errno) {
        self.finish(-err.code(), 0)
    }
}

impl AnswerEmpty for RingReply {
    fn ok(mut self) {
        self.finish(0, 0)
    }
}

impl AnswerEntry for RingReply {
    fn entry(self, ttl: &Duration, attr: &FileAttr, generation: Generation) {
        self.send(|b| b.entry(ttl, attr, generation.0))
    }
}

impl AnswerAttr for RingReply {
    fn attr(self, ttl: &Duration, attr: &FileAttr) {
        self.send(|b| b.attr_out(ttl, attr))
    }
}

impl AnswerData for RingReply {
    fn data(self, data: &[u8]) {
        self.send(|b| b.bytes(data))
    }
}

impl AnswerOpen for RingReply {
    fn opened(self, fh: FileHandle, flags: FopenFlags) {
        self.send(|b| b.open_out(fh.0, flags.bits()))
    }
}

impl AnswerWrite for RingReply {
    fn written(self, size: u32) {
        self.send(|b| {
            b.u32(size)?;
            b.u32(0)
        })
    }
}

impl AnswerLseek for RingReply {
    fn offset(self, offset: u64) {
        self.send(|b| b.u64(offset))
    }
}

impl AnswerIoctl for RingReply {
    fn ioctl(self, result: i32, data: &[u8]) {
        // fuse_ioctl_out: result, flags, in_iovs, out_iovs; then the data.
        self.send(|b| {
            b.u32(result as u32)?;
            b.u32(0)?;
            b.u32(0)?;
            b.u32(0)?;
            b.bytes(data)
        })
    }
}

impl AnswerCreate for RingReply {
    fn created(
        self,
        ttl: &Duration,
        attr: &FileAttr,
        generation: Generation,
        fh: FileHandle,
        flags: FopenFlags,
    ) {
        self.send(|b| {
            b.entry(ttl, attr, generation.0)?;
            b.open_out(fh.0, flags.bits())
        })
    }
}

impl AnswerStatfs for RingReply {
    fn statfs(
        self,
        blocks: u64,
        bfree: u64,
        bavail: u64,
        files: u64,
        ffree: u64,
        bsize: u32,
        namelen: u32,
        frsize: u32,
    ) {
        self.send(|b| {
            for v in [blocks, bfree, bavail, files, ffree] {
                b.u64(v)?;
            }
            for v in [bsize, namelen, frsize] {
                b.u32(v)?;
            }
            b.bytes(&[0u8; 28])
        })
    }
}

impl AnswerXattr for RingReply {
    fn size(self, size: u32) {
        self.send(|b| {
            b.u32(size)?;
            b.u32(0)
        })
    }
    fn data(self, data: &[u8]) {
        self.send(|b| b.bytes(data))
    }
}

impl AnswerDir for RingReply {
    fn add(&mut self, ino: INodeNo, offset: u64, kind: FileType, name: &std::ffi::OsStr) -> bool {
        use std::os::unix::ffi::OsStrExt;
        let mut b = self.body();
        let full = b
            .dirent(ino.0, offset, abi::dirent_type(kind), name.as_bytes(), None)
            .is_err();
        self.len = b.len();
        full
    }
    fn ok(mut self) {
        let n = self.len;
        self.finish(0, n)
    }
}

impl AnswerDirPlus for RingReply {
    fn add(
        &mut self,
        ino: INodeNo,
        offset: u64,
        name: &std::ffi::OsStr,
        ttl: &Duration,
        attr: &FileAttr,
        generation: Generation,
    ) -> bool {
        use std::os::unix::ffi::OsStrExt;
        let mut b = self.body();
        let typ = abi::dirent_type(attr.kind);
        let plus = Some((ttl, attr, generation.0));
        let full = b.dirent(ino.0, offset, typ, name.as_bytes(), plus).is_err();
        self.len = b.len();
        full
    }
    fn ok(mut self) {
        let n = self.len;
        self.finish(0, n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A serving thread never stops on failed waits: its pauses grow to a second and
    /// stay there, and its log lines thin out.
    #[test]
    fn failed_waits_back_off_and_never_give_up() {
        let mut b = WaitBackoff::default();
        let firsts: Vec<_> = (0..8).map(|_| b.failed()).collect();
        assert_eq!(firsts[0], (Duration::from_millis(10), true));
        assert_eq!(firsts[1], (Duration::from_millis(20), true));
        assert!(firsts.windows(2).all(|w| w[0].0 <= w[1].0));
        let later: Vec<_> = (8..10_000).map(|_| b.failed()).collect();
        assert!(later.iter().all(|&(p, _)| p == Duration::from_secs(1)));
        let logged = later.iter().filter(|&&(_, l)| l).count();
        assert!((160..=170).contains(&logged), "{logged} logged");
    }
}
