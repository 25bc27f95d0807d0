//! The mount daemon: starts in the background, serves FUSE, and runs the threads
//! that commit, write back, read ahead and relieve memory while mounted.

use std::io::{Read, Write};
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use birchfs::fuse::{uring, FuseFs};
use birchfs::Fs;

use crate::cli::options::{parse_mount_options, UringMode};
use crate::{open_when_free, SIGNAL_TARGET};

/// Starts the daemon in the background and waits until it reports the mount ready.
pub(crate) fn mount_background(args: &[std::ffi::OsString]) -> Result<()> {
    let mut fds = [0i32; 2];
    // SAFETY: pipe writes two fds into the array.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        bail!("pipe: {}", std::io::Error::last_os_error());
    }
    // SAFETY: both fds were just created and are owned here.
    let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let exe = std::env::current_exe().context("cannot find own executable")?;
    let mut cmd = Command::new(exe);
    cmd.arg("mount")
        .arg("--foreground")
        .arg("--ready-fd")
        .arg(fds[1].to_string());
    cmd.args(args);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let rd_raw = fds[0];
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::setsid();
            libc::close(rd_raw);
            Ok(())
        });
    }
    // What is mounted there now, so that a dead mount left by this attempt can be
    // told from one that was there before (which stays for `birchfs umount`).
    let target = args.last().map(|m| {
        let m = Path::new(m);
        std::fs::canonicalize(m).unwrap_or_else(|_| m.to_path_buf())
    });
    let before = std::fs::read("/proc/self/mountinfo")
        .ok()
        .zip(target.as_deref())
        .and_then(|(info, m)| super::umount::top_mount(&info, m));
    let mut child = cmd.spawn().context("cannot start the mount daemon")?;
    drop(wr);
    let mut msg = String::new();
    std::fs::File::from(rd).read_to_string(&mut msg)?;
    if let Some(rest) = msg.strip_prefix("ok\n") {
        // Warnings the daemon found while mounting, one a line.
        for line in rest.lines() {
            eprintln!("birchfs mount: {line}");
        }
        return Ok(());
    }
    let status = child.wait().ok();
    if let ([.., image, _], Some(target), Some(_)) = (args, &target, status) {
        clear_dead_mount(Path::new(image), target, before);
    }
    let msg = msg.trim();
    if msg.is_empty() {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.and_then(|s| s.signal()) {
            // SAFETY: strsignal returns a pointer to a static or thread-local string.
            let name = unsafe { std::ffi::CStr::from_ptr(libc::strsignal(sig)) };
            bail!(
                "the mount daemon was killed by signal {sig} ({}) before the mount was ready",
                name.to_string_lossy()
            );
        }
        bail!("the mount daemon exited before the mount was ready");
    }
    bail!("{msg}")
}

/// Takes down the mount of `image` at `mountpoint` that a daemon which has exited made
/// (an abort between mounting and reporting ready), unless it is the mount that was on
/// top there `before`: a failed mount leaves nothing behind.
fn clear_dead_mount(image: &Path, mountpoint: &Path, before: Option<(Vec<u8>, Option<PathBuf>)>) {
    use std::os::unix::ffi::OsStrExt;
    let Ok(info) = std::fs::read("/proc/self/mountinfo") else {
        return;
    };
    let Some((dev, Some(mounted))) = super::umount::top_mount(&info, mountpoint) else {
        return;
    };
    if before.is_some_and(|(d, _)| d == dev) {
        return;
    }
    // A mount of this image made since the attempt began is its daemon's (the image's
    // lock lets one daemon at a time hold it), and that daemon has exited. Its state is
    // not asked: a stat of the mount point may still be answered from the kernel's
    // cache.
    if !super::umount::same_path(&mounted, image) {
        return;
    }
    let Ok(c) = std::ffi::CString::new(mountpoint.as_os_str().as_bytes()) else {
        return;
    };
    // SAFETY: umount2 on a valid C string.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
        // Not root: the setuid helper unmounts what its user mounted.
        let _ = Command::new("fusermount3")
            .arg("-u")
            .arg("-z")
            .arg(mountpoint)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// Serves the mount in this process until it is unmounted, reporting readiness (or
/// why it failed) on `ready_fd`.
pub(crate) fn mount(
    opts: &[String],
    image: &Path,
    mountpoint: &Path,
    ready_fd: Option<i32>,
) -> Result<()> {
    // Few malloc arenas, and large buffers (I/O runs, readahead) mapped and unmapped
    // each time: otherwise memory freed by one thread and wanted by another, or freed
    // large buffers, pile up as slack far beyond cache_size.
    // SAFETY: mallopt only tunes the allocator; it is called before other threads exist.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 10);
    }
    // SAFETY: the fd was handed to us by the parent for this purpose.
    let mut ready = ready_fd.map(|fd| std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) }));
    let r = mount_serve(opts, image, mountpoint, &mut ready);
    if let (Err(e), Some(f)) = (&r, ready.as_mut()) {
        let _ = writeln!(f, "{e:#}");
    }
    r
}

/// Set in a daemon's environment, memory counts as short half of the time (tests).
const MEMORY_SHORT_HOOK: &str = "BIRCHFS_TEST_MEMORY_SHORT";

/// Set in a daemon's environment, it aborts once mounted, before it reports the mount
/// ready, as a failed allocation would end it (tests).
const ABORT_HOOK: &str = "BIRCHFS_TEST_ABORT_BEFORE_READY";

fn mount_serve(
    opts: &[String],
    image: &Path,
    mountpoint: &Path,
    ready: &mut Option<std::fs::File>,
) -> Result<()> {
    let mo = parse_mount_options(opts)?;
    match std::fs::metadata(mountpoint) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => bail!("mountpoint {} is not a directory", mountpoint.display()),
        Err(e) => {
            // A FUSE mount whose daemon died (kill -9, OOM) stays until unmounted.
            super::umount::refuse_dead_mount(mountpoint)?;
            bail!("mountpoint {}: {e}", mountpoint.display())
        }
    }
    let dev = open_when_free(image, !mo.fs.readonly).map_err(|e| {
        // A read-only image file, or one on a read-only filesystem, still mounts `ro`.
        let hint = match e.raw_os_error() {
            Some(libc::EACCES | libc::EROFS | libc::EPERM) if !mo.fs.readonly => {
                " (to read it without writing, mount it with -o ro)"
            }
            _ => "",
        };
        anyhow!("cannot open {}: {e}{hint}", image.display())
    })?;
    let dev_size = birchfs::dev::BlockDev::size(&dev);
    let block_device = birchfs::dev::BlockDev::is_block_device(&dev);
    let fs = Arc::new(Fs::open(Arc::new(dev), mo.fs.clone()).map_err(|e| {
        // A damaged node the mount itself needs (a tree's root, say): say where the
        // rest of the damage is listed, and how to get the files out.
        let hint = match e {
            birchfs::Error::Corrupt { .. } => format!(
                "; `birchfs check {0}` lists every damaged block and what it breaks, \
                 and `birchfs restore {0} DIR` copies out every file it can still read",
                image.display()
            ),
            _ => String::new(),
        };
        anyhow!("cannot mount {}: {e}{hint}", image.display())
    })?);
    let mut cfg = fuser::Config::default();
    // Absolute, so that `birchfs umount` finds the image from anywhere.
    let source = std::path::absolute(image)?;
    cfg.mount_options = vec![
        fuser::MountOption::FSName(super::umount::fsname_of(&source, block_device)),
        // The type shows as fuse.birchfs (`findmnt -t fuse.birchfs`, `umount -t`). As a
        // kernel option: fuser hands its Subtype only to fusermount, not to mount(2).
        fuser::MountOption::CUSTOM("subtype=birchfs".into()),
        fuser::MountOption::DefaultPermissions,
    ];
    if mo.fs.readonly {
        cfg.mount_options.push(fuser::MountOption::RO);
    }
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if root {
        cfg.acl = fuser::SessionACL::All;
    }
    cfg.mount_options.extend(mo.vfs.mount_options(root));
    cfg.n_threads = Some(mo.threads + mo.standby);
    cfg.clone_fd = true;
    let mut ffs = FuseFs::new(fs.clone());
    if mo.standby > 0 {
        ffs.standby_threads(mo.threads);
    }
    ffs.direct_reads(mo.direct_read());
    ffs.timeouts(mo.timeouts);
    ffs.gather_fsyncs(mo.gather);
    // fsync_gather=off: one group commit at a time that takes what is queued.
    ffs.tune_committers(mo.gather);
    if want_uring(mo.uring)? {
        ffs.offer_uring();
    }
    // Before the mount: once mounted, a path of an image inside the mount point
    // would be looked up through the mount, by this daemon, which serves nothing
    // yet (the mount hung).
    let mut warnings: Vec<String> = (!mo.fs.readonly)
        .then(|| host_space_warning(image))
        .flatten()
        .into_iter()
        .collect();
    let unused = dev_size.saturating_sub(fs.size());
    if unused >= 1 << 20 {
        warnings.push(format!(
            "{} is {} MiB larger than its filesystem, which does not use that part: \
             `birchfs resize {} max` adds it",
            image.display(),
            unused >> 20,
            mountpoint.display()
        ));
    }
    for w in &warnings {
        tracing::warn!("{w}");
    }
    let served = ffs.clone();
    let mut session = fuser::Session::new(ffs, mountpoint, &cfg).map_err(|e| {
        let why = match e.raw_os_error() {
            Some(libc::EACCES | libc::EPERM) if !fuse_device_open_to_us() => {
                "; this user may not open /dev/fuse (most distributions make it mode 0666): \
                 mount as root, or ask the administrator for access"
            }
            Some(libc::ENOENT) if !Path::new("/dev/fuse").exists() => {
                "; there is no /dev/fuse: load the fuse module (modprobe fuse), or in a \
                 container give it the device (docker run --device /dev/fuse --cap-add \
                 SYS_ADMIN)"
            }
            _ => "",
        };
        anyhow::anyhow!("cannot mount on {}: {e}{why}", mountpoint.display())
    })?;
    served.set_notifier(session.notifier());
    let rings = if served.uring_agreed() {
        let (rings, r) = uring::Rings::start(&served, session.as_fd(), mo.ring);
        match r {
            Ok(()) => {
                tracing::info!("serving FUSE requests through io_uring queues");
                served.fsync_committers(uring_committers(rings.threads()));
            }
            Err(e) if mo.uring == UringMode::On => {
                bail!("uring=on, but the io_uring queues could not be registered: {e}")
            }
            Err(e) => tracing::warn!(
                "io_uring queues failed ({e}); see the log for which way requests go now"
            ),
        }
        Some(rings)
    } else if mo.uring == UringMode::On {
        bail!("uring=on, but the kernel did not agree to FUSE over io_uring at INIT");
    } else {
        None
    };
    drop(served);
    let mut unmounter = session.unmount_callable();
    // SIGUSR1 and SIGUSR2 would end the daemon (their default) and leave a dead
    // mount: SIGUSR1 logs the counters instead (as dd prints its progress), SIGUSR2
    // is only logged.
    let mut signals = signal_hook::iterator::Signals::new([
        libc::SIGINT,
        libc::SIGTERM,
        libc::SIGHUP,
        libc::SIGUSR1,
        libc::SIGUSR2,
    ])?;
    let stats_of = Arc::downgrade(&fs);
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let mut unmounting = false;
            for sig in signals.forever() {
                match sig {
                    libc::SIGUSR1 => match stats_of.upgrade() {
                        Some(fs) => {
                            let stats = fs.stats().to_json();
                            tracing::info!(target: SIGNAL_TARGET, "signal {sig}: stats {stats}")
                        }
                        None => tracing::info!(target: SIGNAL_TARGET, "signal {sig}: no stats"),
                    },
                    libc::SIGUSR2 => tracing::info!(target: SIGNAL_TARGET, "signal {sig}: ignored"),
                    _ if unmounting => {
                        tracing::info!(target: SIGNAL_TARGET, "signal {sig}: unmounting already")
                    }
                    _ => {
                        tracing::info!(target: SIGNAL_TARGET, "signal {sig}: unmounting");
                        unmounting = true;
                        if let Err(e) = unmounter.unmount() {
                            tracing::error!("unmount on signal failed: {e}");
                        }
                    }
                }
            }
        })
        .context("cannot start the signals thread")?;
    const NOW: Duration = Duration::ZERO;
    const SECOND: Duration = Duration::from_secs(1);
    const READAHEAD_THREADS: usize = 3;
    if !mo.fs.commit_interval.is_zero() && !mo.fs.readonly {
        let mut clock = CommitClock::new(mo.fs.commit_interval, Instant::now());
        spawn_while_mounted("committer", &fs, COMMIT_TICK, move |fs| {
            let changes = fs.changes();
            if clock.due(changes, Instant::now()) {
                if let Err(e) = fs.commit() {
                    tracing::error!("periodic commit failed: {e}");
                }
                clock.committed(changes, Instant::now());
            }
            COMMIT_TICK
        })?;
    }
    if !mo.fs.readonly {
        spawn_while_mounted("flusher", &fs, NOW, |fs| {
            match fs.flush_background(SECOND) {
                Ok(()) => NOW,
                Err(e) => {
                    tracing::error!("background writeback failed: {e}");
                    SECOND
                }
            }
        })?;
    }
    // Shrinks the page cache while the system is short of memory, and lets it grow
    // back after.
    let mut pressure = birchfs::MemoryPressure::new();
    // A test hook: memory is short for five ticks, 100 ms apart, then not for five,
    // whatever the system says (squeezing to the floor and growing back under load).
    let alternate = std::env::var_os(MEMORY_SHORT_HOOK).is_some();
    let mut tick = 0u64;
    spawn_while_mounted("memory", &fs, SECOND, move |fs| {
        tick += 1;
        let short = if alternate {
            (tick / 5) % 2 == 1
        } else {
            pressure.short()
        };
        if let Err(e) = fs.relieve_memory(short) {
            tracing::error!("writeback under memory pressure failed: {e}");
        }
        if alternate {
            Duration::from_millis(100)
        } else {
            SECOND
        }
    })?;
    // Read the next windows of sequential readers while they take this one: three, so
    // that windows' device reads overlap each other and the others' checksums (a
    // direct-read stream, answered without the kernel's copy, went from 2.5 to
    // 3.0 GB/s with three threads four windows ahead instead of two and two).
    for _ in 0..READAHEAD_THREADS {
        spawn_while_mounted("readahead", &fs, NOW, |fs| {
            if let Err(e) = fs.readahead_step(SECOND) {
                tracing::debug!("readahead failed: {e}");
            }
            NOW
        })?;
    }
    if !mo.fs.readonly {
        // Frees what deleted snapshots held, a bounded step at a time.
        spawn_while_mounted("cleaner", &fs, NOW, |fs| match fs.drop_deleted(64) {
            Ok(true) => NOW,
            Ok(false) => SECOND,
            Err(e) => {
                tracing::error!("dropping deleted snapshots failed: {e}");
                SECOND
            }
        })?;
    }
    if std::env::var_os(ABORT_HOOK).is_some() {
        eprintln!("test hook: aborting before the mount is ready");
        std::process::abort();
    }
    if let Some(mut f) = ready.take() {
        let mut msg = String::from("ok\n");
        for w in warnings {
            msg.push_str(&format!("warning: {w}\n"));
        }
        let _ = f.write_all(msg.as_bytes());
    }
    // `run` consumes the session and with it the filesystem, whose drop waits for the
    // fsync workers: the final commit comes after any writeback they were doing.
    let r = session.run();
    if let Some(rings) = rings {
        rings.join(Duration::from_secs(10));
    }
    fs.commit().context("final commit failed")?;
    r.context("FUSE session failed")?;
    Ok(())
}

/// A warning when `image` is a sparse file that may still need more of the host's
/// space than the host has free: birchfs fills an image's holes as it writes, and
/// when the host runs out first, those writes fail.
pub(crate) fn host_space_warning(image: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let md = std::fs::metadata(image).ok()?;
    if !md.file_type().is_file() {
        return None;
    }
    let unallocated = md.len().saturating_sub(md.blocks().saturating_mul(512));
    let free = host_free_bytes(image)?;
    if unallocated <= free {
        return None;
    }
    Some(format!(
        "{} may still take {} MiB of its host's space, but the host has {} MiB free: \
         if the host fills up first, writes and fsyncs fail with ENOSPC, and what birchfs \
         could not write waits in memory until space is freed on the host (then \
         `birchfs sync` writes it; a crash or an unmount before that loses it); \
         `birchfs mkfs --preallocate` makes an image that cannot run out this way",
        image.display(),
        unallocated >> 20,
        free >> 20
    ))
}

/// Bytes this process may still write on the filesystem that holds `path` (root may
/// use the blocks reserved for it).
fn host_free_bytes(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs fills the zeroed struct from a valid C string's path.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    // SAFETY: geteuid has no preconditions.
    let blocks = if unsafe { libc::geteuid() } == 0 {
        st.f_bfree
    } else {
        st.f_bavail
    };
    Some((blocks as u64).saturating_mul(st.f_frsize as u64))
}

/// How many group commits may run at once when `threads` serve the io_uring queues:
/// half of them, so that at most half the threads wait for flushes at a time.
fn uring_committers(threads: usize) -> usize {
    (threads / 2).max(1)
}

/// Whether to offer the kernel FUSE over io_uring, for the `uring=` option. `on`
/// turns fuse's `enable_uring` parameter on when it is off (which needs root).
fn want_uring(mode: UringMode) -> Result<bool> {
    if mode == UringMode::Off {
        return Ok(false);
    }
    if !uring::available() {
        if mode == UringMode::On {
            bail!("uring=on, but this process cannot set up an io_uring");
        }
        return Ok(false);
    }
    if !uring::enabled_in_kernel() && mode == UringMode::On {
        std::fs::write(uring::ENABLE_PARAM, "1").with_context(|| {
            format!(
                "uring=on, but fuse's io_uring support is off and cannot be turned on ({})",
                uring::ENABLE_PARAM
            )
        })?;
        tracing::info!("turned on {}", uring::ENABLE_PARAM);
    }
    Ok(uring::enabled_in_kernel())
}

/// How often the periodic committer looks at the clock.
const COMMIT_TICK: Duration = Duration::from_millis(250);

/// Changes quiet this long after some came make the periodic committer commit.
const COMMIT_QUIET: Duration = Duration::from_secs(1);

/// When the periodic committer commits: every `commit=` seconds, and once changes
/// (writes, names, attributes: [`birchfs::Fs::changes`]) have been quiet for
/// [`COMMIT_QUIET`] after some came. `sync(1)` does not reach a FUSE daemon (the
/// kernel sends FUSE_SYNCFS to virtiofs only): it makes the kernel write its dirty
/// pages back to birchfs, and returns, and a rename or an unlink before it is in
/// birchfs's running transaction. So what came before a `sync` is committed a
/// second later, not up to `commit=` seconds later.
struct CommitClock {
    every: Duration,
    last_commit: Instant,
    /// The change count as of the last commit.
    changes_at_commit: u64,
    /// The change count when last looked at, and since when it stands.
    seen: u64,
    seen_since: Instant,
}

impl CommitClock {
    fn new(every: Duration, now: Instant) -> CommitClock {
        CommitClock {
            every,
            last_commit: now,
            changes_at_commit: 0,
            seen: 0,
            seen_since: now,
        }
    }

    /// Whether to commit at `now`, with the change count at `changes`.
    fn due(&mut self, changes: u64, now: Instant) -> bool {
        if changes != self.seen {
            self.seen = changes;
            self.seen_since = now;
        }
        let quiet = changes != self.changes_at_commit
            && now.saturating_duration_since(self.seen_since) >= COMMIT_QUIET;
        quiet || now.saturating_duration_since(self.last_commit) >= self.every
    }

    /// Notes a commit at `now` that covered the change count `changes`.
    fn committed(&mut self, changes: u64, now: Instant) {
        self.last_commit = now;
        self.changes_at_commit = changes;
    }
}

/// Runs `step` on a thread named `name` for as long as `fs` is alive: after a pause
/// (`first`, then what the step returns), each step gets the filesystem, and lets go
/// of it before pausing, so the thread never keeps an unmounted filesystem alive.
fn spawn_while_mounted(
    name: &str,
    fs: &Arc<Fs>,
    first: Duration,
    mut step: impl FnMut(&Fs) -> Duration + Send + 'static,
) -> std::io::Result<()> {
    let weak = Arc::downgrade(fs);
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let mut pause = first;
            loop {
                if !pause.is_zero() {
                    std::thread::sleep(pause);
                }
                let Some(fs) = weak.upgrade() else { break };
                pause = step(&fs);
            }
        })
        .map_err(|e| {
            std::io::Error::new(e.kind(), format!("cannot start the {name} thread: {e}"))
        })?;
    Ok(())
}

/// Whether this process may read and write /dev/fuse (a non-root mount opens it
/// before it asks fusermount3 to mount).
fn fuse_device_open_to_us() -> bool {
    // SAFETY: access on a valid C string.
    unsafe { libc::access(c"/dev/fuse".as_ptr(), libc::R_OK | libc::W_OK) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    /// Changes that stop are committed a second later; changes that go on wait for
    /// the interval; no changes, no early commit.
    #[test]
    fn the_committer_commits_a_second_after_writes_stop_and_at_the_interval() {
        let t0 = Instant::now();
        let mut c = CommitClock::new(30 * S, t0);
        assert!(!c.due(0, t0 + S * 5), "nothing changed");
        // Changes keep coming every 250 ms: only the interval commits.
        let mut w = 0;
        let mut t = t0 + S * 5;
        while t < t0 + S * 29 {
            w += 1;
            assert!(!c.due(w, t), "changes still coming at {:?}", t - t0);
            t += COMMIT_TICK;
        }
        assert!(c.due(w, t0 + S * 30), "the interval");
        c.committed(w, t0 + S * 30);
        assert!(!c.due(w, t0 + S * 31), "nothing new since");
        // A burst (as sync(1) makes the kernel send), then quiet.
        w += 256;
        assert!(!c.due(w, t0 + S * 40));
        assert!(!c.due(w, t0 + S * 40 + COMMIT_TICK * 3));
        assert!(c.due(w, t0 + S * 41), "quiet for a second");
        c.committed(w, t0 + S * 41);
        assert!(!c.due(w, t0 + S * 45));
    }
}
