//! Shared fixture for the FUSE integration tests.
//!
//! `Mount` owns a temporary directory holding an image (`img`) and a mount
//! point (`mnt`). It formats the image with `birchfs mkfs`, mounts it with
//! `birchfs mount` (which returns once the mount is ready) and unmounts it with
//! `umount`. After an unmount it waits for the mount to leave /proc/mounts and
//! for the daemon to exit (no process left whose argv names the image, and no
//! flock/fcntl lock left on it), then runs `birchfs check` and asserts a clean
//! result. Drop unmounts without panicking, lazily as a last resort.
//!
//! Besides the fixture this module holds small safe wrappers around the libc
//! calls std lacks (mknod, renameat2, utimensat, fallocate, xattrs, statfs,
//! raw readdir, ...) and `run_as`, which runs a closure on a fresh thread whose
//! credentials (and only that thread's) are switched to another uid/gid, so a
//! test can observe exact errno values of an unprivileged caller.

#![allow(dead_code)]

use std::ffi::{CStr, CString, OsStr};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};

/// Mount options every mount of a test run adds, from `BIRCHFS_TEST_MOUNT_OPTIONS`
/// (comma-separated): `make test` runs the FUSE suites once more with `uring=on`.
pub fn extra_mount_options() -> Vec<String> {
    std::env::var("BIRCHFS_TEST_MOUNT_OPTIONS")
        .unwrap_or_default()
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

/// The birchfs binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_birchfs");

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;
pub const TIB: u64 = 1 << 40;

/// The unprivileged user/group the permission tests run as.
pub const NOBODY: u32 = 65534;
pub const NOGROUP: u32 = 65534;

pub const RENAME_NOREPLACE: u32 = 1;
pub const RENAME_EXCHANGE: u32 = 2;
pub const RENAME_WHITEOUT: u32 = 4;

const MKFS_TIMEOUT: Duration = Duration::from_secs(120);
const MOUNT_TIMEOUT: Duration = Duration::from_secs(60);
const UMOUNT_TIMEOUT: Duration = Duration::from_secs(30);
const CHECK_TIMEOUT: Duration = Duration::from_secs(600);
pub const SHELL_TIMEOUT: Duration = Duration::from_secs(120);
/// How long an unmount may take to leave /proc/mounts and for the daemon to exit.
const GONE_TIMEOUT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------
// Running commands
// ---------------------------------------------------------------------------

/// Runs `cmd` with stdin from /dev/null and stdout/stderr sent to the given
/// files (never pipes: a daemon that inherits a pipe would keep it open and
/// make the caller wait for the daemon's exit). Kills it after `timeout`.
fn spawn_and_wait(
    cmd: &mut Command,
    stdout: File,
    stderr: File,
    timeout: Duration,
) -> io::Result<ExitStatus> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(stdout))
        .stderr(Stdio::from(stderr));
    let mut child = cmd.spawn()?;
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(1);
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{:?} did not finish within {:?}", cmd, timeout),
            ));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

/// Starts `cmd` under a resource limit (`ulimit`), soft and hard.
pub fn set_rlimit(cmd: &mut Command, resource: libc::__rlimit_resource_t, soft: u64, hard: u64) {
    use std::os::unix::process::CommandExt;
    // SAFETY: setrlimit is async-signal-safe; the closure touches only its copies.
    unsafe {
        cmd.pre_exec(move || {
            let lim = libc::rlimit {
                rlim_cur: soft,
                rlim_max: hard,
            };
            if libc::setrlimit(resource, &lim) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

fn read_back(mut f: File) -> Vec<u8> {
    let mut v = Vec::new();
    if f.seek(SeekFrom::Start(0)).is_ok() {
        let _ = f.read_to_end(&mut v);
    }
    v
}

/// Runs a command with a timeout, capturing its output. Never panics.
pub fn try_run(cmd: &mut Command, timeout: Duration) -> io::Result<Output> {
    let out = tempfile::tempfile()?;
    let err = tempfile::tempfile()?;
    let status = spawn_and_wait(cmd, out.try_clone()?, err.try_clone()?, timeout)?;
    Ok(Output {
        status,
        stdout: read_back(out),
        stderr: read_back(err),
    })
}

/// Runs a command with a timeout, capturing its output; panics if it cannot
/// be started or times out (its exit status is the caller's business).
#[track_caller]
pub fn run(cmd: &mut Command, timeout: Duration) -> Output {
    let desc = format!("{:?}", cmd);
    match try_run(cmd, timeout) {
        Ok(o) => o,
        Err(e) => panic!("running {}: {}", desc, e),
    }
}

/// Runs the birchfs binary with `args`.
#[track_caller]
pub fn birchfs<I, S>(args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    run(&mut cmd, CHECK_TIMEOUT)
}

/// A readable description of a command's result, for assertion messages.
pub fn describe(out: &Output) -> String {
    format!(
        "status: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn tail_of(path: &Path, max: u64) -> String {
    match File::open(path) {
        Ok(mut f) => {
            let len = f.metadata().map(|m| m.len()).unwrap_or(0);
            let start = len.saturating_sub(max);
            let _ = f.seek(SeekFrom::Start(start));
            let mut v = Vec::new();
            let _ = f.read_to_end(&mut v);
            String::from_utf8_lossy(&v).into_owned()
        }
        Err(e) => format!("<{}: {}>", path.display(), e),
    }
}

// ---------------------------------------------------------------------------
// Mount table and daemon tracking
// ---------------------------------------------------------------------------

/// Whether `path` is a mount point according to /proc/mounts.
pub fn is_mounted_at(path: &Path) -> bool {
    let want = path.as_os_str().as_bytes();
    match fs::read("/proc/mounts") {
        Ok(table) => table.split(|&b| b == b'\n').any(|line| {
            line.split(|&b| b == b' ')
                .nth(1)
                .map(|mp| mp == want)
                .unwrap_or(false)
        }),
        Err(_) => false,
    }
}

/// Pids of processes (other than this one) whose argv contains `image`.
pub fn processes_naming(image: &Path) -> Vec<u32> {
    let me = std::process::id();
    let want = image.as_os_str().as_bytes();
    let mut pids = Vec::new();
    let rd = match fs::read_dir("/proc") {
        Ok(rd) => rd,
        Err(_) => return pids,
    };
    for e in rd.flatten() {
        let pid: u32 = match e.file_name().to_str().and_then(|s| s.parse().ok()) {
            Some(p) => p,
            None => continue,
        };
        if pid == me {
            continue;
        }
        let cmdline = match fs::read(e.path().join("cmdline")) {
            Ok(c) => c,
            Err(_) => continue,
        };
        if cmdline.split(|&b| b == 0).any(|arg| arg == want) {
            pids.push(pid);
        }
    }
    pids
}

/// True when nobody holds an flock or a POSIX/OFD lock on the image.
pub fn image_unlocked(image: &Path) -> bool {
    let f = match File::open(image) {
        Ok(f) => f,
        Err(_) => return true,
    };
    let fd = f.as_raw_fd();
    // SAFETY: plain syscalls on a valid fd owned by `f`.
    unsafe {
        if libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) != 0 {
            return false;
        }
        libc::flock(fd, libc::LOCK_UN);
        let mut fl: libc::flock = std::mem::zeroed();
        fl.l_type = libc::F_WRLCK as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        fl.l_start = 0;
        fl.l_len = 0;
        if libc::fcntl(fd, libc::F_OFD_GETLK, &mut fl as *mut libc::flock) == 0
            && fl.l_type != libc::F_UNLCK as libc::c_short
        {
            return false;
        }
    }
    true
}

/// Polls `done` every 10 ms until it holds (true) or `timeout` passes (false).
pub fn wait_until(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

// ---------------------------------------------------------------------------
// The fixture
// ---------------------------------------------------------------------------

pub struct Mount {
    /// `None` only after Drop decided to leak the directory (still mounted).
    tmp: Option<tempfile::TempDir>,
    base: PathBuf,
    img: PathBuf,
    mnt: PathBuf,
    opts: Vec<String>,
    mounted: bool,
    /// Number of mount attempts; names the per-attempt daemon log files.
    attempts: u32,
    /// The loop device `img` names, detached on drop.
    loop_dev: Option<PathBuf>,
    /// Environment variables the daemon gets (test hooks).
    daemon_env: Vec<(String, String)>,
    /// Whether later mounts log to `daemon.log` (`--log`) instead of nowhere.
    log: bool,
    /// Resource limits (resource, soft, hard) later mounts start under (`ulimit`).
    rlimits: Vec<(libc::__rlimit_resource_t, u64, u64)>,
}

impl Mount {
    /// A fresh 2 GiB image, mounted with default options.
    #[track_caller]
    pub fn new() -> Mount {
        Mount::build("2G", &[])
    }

    /// A fresh image of `size` (e.g. "4G", "512M"), mounted.
    #[track_caller]
    pub fn with_size(size: &str) -> Mount {
        Mount::build(size, &[])
    }

    /// A fresh 2 GiB image mounted with `-o opts`.
    #[track_caller]
    pub fn with_options(opts: &[&str]) -> Mount {
        Mount::build("2G", opts)
    }

    #[track_caller]
    pub fn with_size_and_options(size: &str, opts: &[&str]) -> Mount {
        Mount::build(size, opts)
    }

    /// A fresh image of `size`, formatted but not mounted.
    #[track_caller]
    pub fn unmounted(size: &str) -> Mount {
        let m = Mount::bare();
        let out = m.mkfs(&["--size", size]);
        assert!(out.status.success(), "mkfs failed:\n{}", describe(&out));
        let md = fs::metadata(&m.img).expect("mkfs did not create the image");
        assert!(md.is_file(), "image is not a regular file");
        m
    }

    /// Only the directories: no image exists yet (`image()` names where it
    /// would be), nothing is mounted.
    #[track_caller]
    pub fn bare() -> Mount {
        let tmp = tempfile::Builder::new()
            .prefix("birchfs-test-")
            .tempdir()
            .expect("create tempdir");
        let base = fs::canonicalize(tmp.path()).expect("canonicalize tempdir");
        let img = base.join("img");
        let mnt = base.join("mnt");
        fs::create_dir(&mnt).expect("mkdir mnt");
        Mount {
            tmp: Some(tmp),
            base,
            img,
            mnt,
            opts: Vec::new(),
            mounted: false,
            attempts: 0,
            loop_dev: None,
            daemon_env: Vec::new(),
            log: false,
            rlimits: Vec::new(),
        }
    }

    /// Starts later mounts under a resource limit (`ulimit`: RLIMIT_FSIZE, RLIMIT_AS,
    /// ...), soft and hard, in place of any set before for it.
    pub fn set_rlimit(&mut self, resource: libc::__rlimit_resource_t, soft: u64, hard: u64) {
        self.rlimits.retain(|r| r.0 != resource);
        self.rlimits.push((resource, soft, hard));
    }

    /// Sets an environment variable for the daemons of later mounts (a test hook).
    pub fn set_daemon_env(&mut self, key: &str, value: &str) {
        self.daemon_env.push((key.to_string(), value.to_string()));
    }

    /// A sparse file of `size` on a loop device (direct I/O, as the benchmark sets it
    /// up), formatted and mounted there: birchfs over a block device.
    #[track_caller]
    pub fn on_loop_device(size: &str) -> Mount {
        let mut m = Mount::bare();
        let backing = m.base.join("backing");
        let out = run(
            Command::new("truncate").args(["-s", size]).arg(&backing),
            MKFS_TIMEOUT,
        );
        assert!(out.status.success(), "truncate failed:\n{}", describe(&out));
        let out = run(
            Command::new("losetup")
                .args(["--direct-io=on", "-f", "--show"])
                .arg(&backing),
            MKFS_TIMEOUT,
        );
        assert!(
            out.status.success(),
            "losetup failed (the test needs root and loop devices):\n{}",
            describe(&out)
        );
        let dev = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        m.img = dev.clone();
        m.loop_dev = Some(dev);
        let out = m.mkfs(&["--force"]);
        assert!(out.status.success(), "mkfs failed:\n{}", describe(&out));
        m.mount_with(&[]);
        m
    }

    #[track_caller]
    fn build(size: &str, opts: &[&str]) -> Mount {
        let mut m = Mount::unmounted(size);
        m.mount_with(opts);
        m
    }

    /// `rel` inside the mount.
    pub fn path(&self, rel: impl AsRef<Path>) -> PathBuf {
        let rel = rel.as_ref();
        assert!(rel.is_relative(), "Mount::path wants a relative path");
        self.mnt.join(rel)
    }

    /// The mount point (the root directory of the filesystem when mounted).
    pub fn root(&self) -> &Path {
        &self.mnt
    }

    pub fn image(&self) -> &Path {
        &self.img
    }

    /// The temporary directory holding image and mount point: a place on the
    /// host filesystem, outside the mount, for model files.
    pub fn host_dir(&self) -> &Path {
        &self.base
    }

    pub fn is_mounted(&self) -> bool {
        self.mounted
    }

    /// Runs `birchfs mkfs ARGS... IMAGE`.
    #[track_caller]
    pub fn mkfs(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new(BIN);
        cmd.arg("mkfs").args(args).arg(&self.img);
        run(&mut cmd, MKFS_TIMEOUT)
    }

    /// Runs `birchfs check IMAGE`.
    #[track_caller]
    pub fn check(&self) -> Output {
        let mut cmd = Command::new(BIN);
        cmd.arg("check").arg(&self.img);
        run(&mut cmd, CHECK_TIMEOUT)
    }

    /// Makes later mounts log to a file (`--log`), read back by [`Mount::daemon_log`].
    pub fn log_to_file(&mut self) {
        self.log = true;
    }

    /// What the daemons logged so far (see [`Mount::log_to_file`]).
    pub fn daemon_log(&self) -> String {
        String::from_utf8_lossy(&fs::read(self.base.join("daemon.log")).unwrap_or_default())
            .into_owned()
    }

    fn latest_log_tail(&self) -> String {
        if self.attempts == 0 {
            return String::from("<no mount attempted>");
        }
        let n = self.attempts;
        format!(
            "--- daemon stdout (mount #{n}, tail) ---\n{}\n--- daemon stderr (mount #{n}, tail) ---\n{}",
            tail_of(&self.base.join(format!("mount-{n}.out")), 4096),
            tail_of(&self.base.join(format!("mount-{n}.err")), 8192),
        )
    }

    /// Runs `birchfs mount [-o OPTS] IMAGE MOUNTPOINT` and returns its result
    /// without asserting anything. If the mount point shows up in
    /// /proc/mounts afterwards (even after a failure) the fixture records it
    /// as mounted so that Drop cleans up.
    #[track_caller]
    pub fn try_mount(&mut self, opts: &[&str]) -> Output {
        assert!(!self.mounted, "try_mount: already mounted");
        self.attempts += 1;
        let n = self.attempts;
        let out_path = self.base.join(format!("mount-{n}.out"));
        let err_path = self.base.join(format!("mount-{n}.err"));
        let out_file = File::create(&out_path).expect("create mount log");
        let err_file = File::create(&err_path).expect("create mount log");
        let mut cmd = Command::new(BIN);
        cmd.arg("mount");
        if self.log {
            cmd.arg("--log").arg(self.base.join("daemon.log"));
        }
        cmd.envs(self.daemon_env.iter().map(|(k, v)| (k, v)));
        for &(resource, soft, hard) in &self.rlimits {
            set_rlimit(&mut cmd, resource, soft, hard);
        }
        let mut opts: Vec<&str> = opts.to_vec();
        let extra = extra_mount_options();
        opts.extend(extra.iter().map(|s| s.as_str()));
        if !opts.is_empty() {
            cmd.arg("-o").arg(opts.join(","));
        }
        cmd.arg(&self.img).arg(&self.mnt);
        let desc = format!("{:?}", cmd);
        let status = spawn_and_wait(&mut cmd, out_file, err_file, MOUNT_TIMEOUT);
        if is_mounted_at(&self.mnt) {
            self.mounted = true;
        }
        let status = match status {
            Ok(s) => s,
            Err(e) => panic!("{}: {}\n{}", desc, e, self.latest_log_tail()),
        };
        Output {
            status,
            stdout: fs::read(&out_path).unwrap_or_default(),
            stderr: fs::read(&err_path).unwrap_or_default(),
        }
    }

    /// Tries to mount with `opt` alone and asserts that the mount is refused with a
    /// message on stderr that names `says`.
    #[track_caller]
    pub fn expect_refused(&mut self, opt: &str, says: &str) {
        let out = self.try_mount(&[opt]);
        assert!(!out.status.success(), "{opt} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{opt}: {err}");
        assert!(!self.is_mounted());
    }

    /// Mounts with the options last used (none at first); asserts success and
    /// that the mount is visible when the command returns.
    #[track_caller]
    pub fn mount(&mut self) {
        let opts = self.opts.clone();
        let opts: Vec<&str> = opts.iter().map(|s| s.as_str()).collect();
        self.mount_with(&opts);
    }

    /// Mounts with `-o opts` (remembered for later `remount`s).
    #[track_caller]
    pub fn mount_with(&mut self, opts: &[&str]) {
        self.opts = opts.iter().map(|s| s.to_string()).collect();
        let out = self.try_mount(opts);
        assert!(
            out.status.success(),
            "birchfs mount -o {:?} failed:\n{}\n{}",
            opts,
            describe(&out),
            self.latest_log_tail()
        );
        assert!(
            is_mounted_at(&self.mnt),
            "birchfs mount exited 0 but {} is not in /proc/mounts\n{}",
            self.mnt.display(),
            self.latest_log_tail()
        );
        self.mounted = true;
    }

    /// `umount MNT`, retried while the mount is busy. Returns the last
    /// failure's description, or None on success.
    fn umount_command(&self, deadline: Duration) -> Option<String> {
        let end = Instant::now() + deadline;
        loop {
            let res = try_run(Command::new("umount").arg(&self.mnt), UMOUNT_TIMEOUT);
            let failure = match res {
                Ok(out) if out.status.success() => return None,
                Ok(out) => describe(&out),
                Err(e) => e.to_string(),
            };
            if !is_mounted_at(&self.mnt) {
                // Someone (or a timed-out attempt) unmounted it anyway.
                return None;
            }
            if Instant::now() >= end {
                return Some(failure);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits for the mount to disappear and the daemon to exit.
    fn wait_gone(&self) -> Result<(), String> {
        if !wait_until(GONE_TIMEOUT, || !is_mounted_at(&self.mnt)) {
            return Err(format!(
                "{} still in /proc/mounts {:?} after umount",
                self.mnt.display(),
                GONE_TIMEOUT
            ));
        }
        let img = self.img.clone();
        if !wait_until(GONE_TIMEOUT, || {
            processes_naming(&img).is_empty() && image_unlocked(&img)
        }) {
            return Err(format!(
                "birchfs daemon did not exit within {:?} after umount (processes naming the image: {:?}, image unlocked: {})",
                GONE_TIMEOUT,
                processes_naming(&img),
                image_unlocked(&img)
            ));
        }
        Ok(())
    }

    /// Unmounts, waits for the daemon to finish, and asserts that
    /// `birchfs check` finds the image clean.
    #[track_caller]
    pub fn unmount(&mut self) {
        assert!(self.mounted, "unmount: not mounted");
        if let Some(failure) = self.umount_command(Duration::from_secs(10)) {
            panic!(
                "umount {} failed (is a file still open?):\n{}",
                self.mnt.display(),
                failure
            );
        }
        self.mounted = false;
        if let Err(e) = self.wait_gone() {
            panic!("{}\n{}", e, self.latest_log_tail());
        }
        let out = self.check();
        assert_eq!(
            out.status.code(),
            Some(0),
            "birchfs check {} is not clean after unmount:\n{}\n{}",
            self.img.display(),
            describe(&out),
            self.latest_log_tail()
        );
    }

    /// Runs `umount` and returns at once, as a script would: the daemon may still be
    /// finishing its last commit.
    #[track_caller]
    pub fn umount_no_wait(&mut self) {
        assert!(self.mounted, "unmount: not mounted");
        if let Some(failure) = self.umount_command(Duration::from_secs(10)) {
            panic!("umount {} failed:\n{}", self.mnt.display(), failure);
        }
        self.mounted = false;
    }

    /// Runs `birchfs umount` on the mount point and returns its output; the mount
    /// counts as gone when it succeeded.
    #[track_caller]
    pub fn birchfs_umount(&mut self) -> Output {
        self.birchfs_umount_with(&[])
    }

    /// [`Mount::birchfs_umount`] with options before the mount point; the mount counts
    /// as gone when it is no longer in the mount table.
    #[track_caller]
    pub fn birchfs_umount_with(&mut self, args: &[&str]) -> Output {
        assert!(self.mounted, "unmount: not mounted");
        let out = run(
            Command::new(BIN).arg("umount").args(args).arg(&self.mnt),
            UMOUNT_TIMEOUT,
        );
        if out.status.success() || !is_mounted_at(&self.mnt) {
            self.mounted = false;
        }
        out
    }

    /// Unmounts and waits for the daemon, without asserting that check is clean;
    /// returns check's output.
    #[track_caller]
    pub fn unmount_unchecked(&mut self) -> Output {
        assert!(self.mounted, "unmount: not mounted");
        if let Some(failure) = self.umount_command(Duration::from_secs(10)) {
            panic!("umount {} failed:\n{}", self.mnt.display(), failure);
        }
        self.mounted = false;
        if let Err(e) = self.wait_gone() {
            panic!("{}\n{}", e, self.latest_log_tail());
        }
        self.check()
    }

    /// kill -9 of the daemon; its dead mount stays (still counted as mounted).
    #[track_caller]
    pub fn kill_daemon_leaving_its_mount(&mut self) {
        let pids = processes_naming(&self.img);
        assert!(!pids.is_empty(), "no daemon to kill");
        for p in &pids {
            // SAFETY: kill on a pid we found in /proc.
            unsafe { libc::kill(*p as i32, libc::SIGKILL) };
        }
        let img = self.img.clone();
        assert!(
            wait_until(GONE_TIMEOUT, || processes_naming(&img).is_empty()),
            "daemon survived SIGKILL"
        );
    }

    /// Records that the mount is there (the test mounted it another way).
    #[track_caller]
    pub fn mark_mounted(&mut self) {
        assert!(is_mounted_at(&self.mnt), "not mounted");
        self.mounted = true;
    }

    /// Records that the mount is gone (the test unmounted it another way).
    #[track_caller]
    pub fn mark_unmounted(&mut self) {
        assert!(!is_mounted_at(&self.mnt), "still mounted");
        self.mounted = false;
    }

    /// kill -9 of the daemon (a crash of the process, not of the machine), then
    /// detaches the dead mount.
    #[track_caller]
    pub fn kill_daemon(&mut self) {
        self.kill_daemon_leaving_its_mount();
        let _ = try_run(
            Command::new("fusermount3")
                .arg("-u")
                .arg("-z")
                .arg(&self.mnt),
            UMOUNT_TIMEOUT,
        );
        if is_mounted_at(&self.mnt) {
            let _ = try_run(
                Command::new("umount").arg("-l").arg(&self.mnt),
                UMOUNT_TIMEOUT,
            );
        }
        let mnt = self.mnt.clone();
        assert!(
            wait_until(GONE_TIMEOUT, || !is_mounted_at(&mnt)),
            "dead mount not detached"
        );
        self.mounted = false;
    }

    /// Unmount (with check) and mount again with the same options.
    #[track_caller]
    pub fn remount(&mut self) {
        self.unmount();
        self.mount();
    }

    /// Runs `sh -c CMD` as uid/gid with no supplementary groups (through
    /// setpriv), in the mount root, with LC_ALL=C.
    #[track_caller]
    pub fn as_user(&self, uid: u32, gid: u32, shell_cmd: &str) -> Output {
        as_user_in(&self.mnt, uid, gid, shell_cmd)
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let panicking = std::thread::panicking();
        if self.mounted {
            let mut clean = self.umount_command(Duration::from_secs(5)).is_none();
            if !clean {
                let _ = try_run(
                    Command::new("umount").arg("-l").arg(&self.mnt),
                    UMOUNT_TIMEOUT,
                );
                if is_mounted_at(&self.mnt) {
                    if let Ok(c) = CString::new(self.mnt.as_os_str().as_bytes()) {
                        // SAFETY: valid NUL-terminated path.
                        unsafe {
                            libc::umount2(c.as_ptr(), libc::MNT_DETACH);
                        }
                    }
                }
                clean = !is_mounted_at(&self.mnt);
            }
            if clean {
                self.mounted = false;
                if let Err(e) = self.wait_gone() {
                    eprintln!("birchfs test fixture: {}", e);
                }
            } else {
                eprintln!(
                    "birchfs test fixture: could not unmount {}; leaking {}",
                    self.mnt.display(),
                    self.base.display()
                );
                if let Some(t) = self.tmp.take() {
                    std::mem::forget(t);
                }
            }
        }
        if let Some(dev) = self.loop_dev.take() {
            if self.mounted {
                eprintln!("birchfs test fixture: leaving {} attached", dev.display());
            } else if let Err(e) =
                try_run(Command::new("losetup").arg("-d").arg(&dev), UMOUNT_TIMEOUT)
            {
                eprintln!("birchfs test fixture: losetup -d {}: {e}", dev.display());
            }
        }
        if panicking {
            eprintln!(
                "birchfs test fixture: image {}\n{}",
                self.img.display(),
                self.latest_log_tail()
            );
        }
    }
}

/// Runs `sh -c CMD` through `setpriv --reuid --regid --clear-groups` in `dir`.
#[track_caller]
pub fn as_user_in(dir: &Path, uid: u32, gid: u32, shell_cmd: &str) -> Output {
    let mut cmd = Command::new("setpriv");
    cmd.arg(format!("--reuid={uid}"))
        .arg(format!("--regid={gid}"))
        .arg("--clear-groups")
        .arg("sh")
        .arg("-c")
        .arg(shell_cmd)
        .current_dir(dir)
        .env("LC_ALL", "C");
    run(&mut cmd, SHELL_TIMEOUT)
}

/// Runs `f` on a new thread whose credentials are uid/gid with no
/// supplementary groups and no capabilities. Linux credentials are per
/// thread; raw syscalls (unlike the glibc wrappers) change only the calling
/// thread, so the rest of the test process keeps running as root.
#[track_caller]
pub fn run_as<T, F>(uid: u32, gid: u32, f: F) -> T
where
    T: Send,
    F: FnOnce() -> T + Send,
{
    std::thread::scope(|s| {
        let h = s.spawn(move || {
            // SAFETY: raw credential syscalls with valid arguments; they
            // affect only this thread, which ends when `f` returns.
            unsafe {
                let r = libc::syscall(
                    libc::SYS_setgroups,
                    0 as libc::c_long,
                    std::ptr::null::<libc::gid_t>(),
                );
                assert_eq!(r, 0, "setgroups: {}", io::Error::last_os_error());
                let g = gid as libc::c_long;
                let r = libc::syscall(libc::SYS_setresgid, g, g, g);
                assert_eq!(r, 0, "setresgid: {}", io::Error::last_os_error());
                let u = uid as libc::c_long;
                let r = libc::syscall(libc::SYS_setresuid, u, u, u);
                assert_eq!(r, 0, "setresuid: {}", io::Error::last_os_error());
                assert_eq!(libc::geteuid(), uid);
                assert_eq!(libc::getegid(), gid);
            }
            f()
        });
        match h.join() {
            Ok(v) => v,
            Err(p) => std::panic::resume_unwind(p),
        }
    })
}

// ---------------------------------------------------------------------------
// errno helpers
// ---------------------------------------------------------------------------

/// The errno of a failed call; panics if it succeeded.
#[track_caller]
pub fn errno<T: std::fmt::Debug>(r: io::Result<T>) -> i32 {
    match r {
        Ok(v) => panic!("expected an error, got Ok({:?})", v),
        Err(e) => match e.raw_os_error() {
            Some(n) => n,
            None => panic!("expected an errno, got {:?}", e),
        },
    }
}

/// Asserts that `r` failed with exactly `expected`.
#[track_caller]
pub fn expect_errno<T: std::fmt::Debug>(r: io::Result<T>, expected: i32, what: &str) {
    match r {
        Ok(v) => panic!(
            "{}: expected {} ({}), got Ok({:?})",
            what,
            expected,
            io::Error::from_raw_os_error(expected),
            v
        ),
        Err(e) => assert_eq!(
            e.raw_os_error(),
            Some(expected),
            "{}: expected {} ({}), got {:?}",
            what,
            expected,
            io::Error::from_raw_os_error(expected),
            e
        ),
    }
}

fn cvt(r: libc::c_int) -> io::Result<()> {
    if r == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn cvt_size(r: libc::ssize_t) -> io::Result<usize> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

pub fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("path with NUL")
}

fn cname(s: &str) -> CString {
    CString::new(s).expect("name with NUL")
}

// ---------------------------------------------------------------------------
// libc wrappers
// ---------------------------------------------------------------------------

pub fn mknod(p: &Path, mode: u32, dev: u64) -> io::Result<()> {
    let c = cpath(p);
    // SAFETY: valid C string.
    cvt(unsafe { libc::mknod(c.as_ptr(), mode as libc::mode_t, dev as libc::dev_t) })
}

pub fn mkfifo(p: &Path, mode: u32) -> io::Result<()> {
    let c = cpath(p);
    // SAFETY: valid C string.
    cvt(unsafe { libc::mkfifo(c.as_ptr(), mode as libc::mode_t) })
}

pub fn makedev(major: u32, minor: u32) -> u64 {
    libc::makedev(major, minor) as u64
}

pub fn renameat2(from: &Path, to: &Path, flags: u32) -> io::Result<()> {
    let a = cpath(from);
    let b = cpath(to);
    // SAFETY: valid C strings; arguments passed as longs to the variadic call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD as libc::c_long,
            a.as_ptr(),
            libc::AT_FDCWD as libc::c_long,
            b.as_ptr(),
            flags as libc::c_long,
        )
    };
    if r == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn timespec(t: (i64, i64)) -> libc::timespec {
    // SAFETY: timespec is plain old data.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    ts.tv_sec = t.0 as libc::time_t;
    ts.tv_nsec = t.1 as _;
    ts
}

/// utimensat(AT_FDCWD, path, [atime, mtime], flags); a time is (sec, nsec)
/// and nsec may be UTIME_NOW or UTIME_OMIT.
pub fn utimensat(p: &Path, atime: (i64, i64), mtime: (i64, i64), flags: i32) -> io::Result<()> {
    let c = cpath(p);
    let ts = [timespec(atime), timespec(mtime)];
    // SAFETY: valid C string and a two-element timespec array.
    cvt(unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), ts.as_ptr(), flags) })
}

pub fn utimens(p: &Path, atime: (i64, i64), mtime: (i64, i64)) -> io::Result<()> {
    utimensat(p, atime, mtime, 0)
}

pub const UTIME_NOW: i64 = libc::UTIME_NOW;
pub const UTIME_OMIT: i64 = libc::UTIME_OMIT;

pub fn fallocate(f: &File, mode: i32, offset: u64, len: u64) -> io::Result<()> {
    // SAFETY: valid fd.
    cvt(unsafe {
        libc::fallocate(
            f.as_raw_fd(),
            mode,
            offset as libc::off_t,
            len as libc::off_t,
        )
    })
}

pub fn truncate(p: &Path, len: i64) -> io::Result<()> {
    let c = cpath(p);
    // SAFETY: valid C string.
    cvt(unsafe { libc::truncate(c.as_ptr(), len as libc::off_t) })
}

/// chown(2); pass u32::MAX for "leave unchanged" (-1).
pub fn chown(p: &Path, uid: u32, gid: u32) -> io::Result<()> {
    let c = cpath(p);
    // SAFETY: valid C string.
    cvt(unsafe { libc::chown(c.as_ptr(), uid as libc::uid_t, gid as libc::gid_t) })
}

pub fn lchown(p: &Path, uid: u32, gid: u32) -> io::Result<()> {
    let c = cpath(p);
    // SAFETY: valid C string.
    cvt(unsafe { libc::lchown(c.as_ptr(), uid as libc::uid_t, gid as libc::gid_t) })
}

pub fn chmod(p: &Path, mode: u32) -> io::Result<()> {
    let c = cpath(p);
    // SAFETY: valid C string.
    cvt(unsafe { libc::chmod(c.as_ptr(), mode as libc::mode_t) })
}

pub fn setxattr(p: &Path, name: &str, value: &[u8], flags: i32) -> io::Result<()> {
    let c = cpath(p);
    let n = cname(name);
    // SAFETY: valid C strings; value pointer/length from a slice.
    cvt(unsafe {
        libc::setxattr(
            c.as_ptr(),
            n.as_ptr(),
            value.as_ptr() as *const libc::c_void,
            value.len(),
            flags,
        )
    })
}

pub fn lsetxattr(p: &Path, name: &str, value: &[u8], flags: i32) -> io::Result<()> {
    let c = cpath(p);
    let n = cname(name);
    // SAFETY: as above.
    cvt(unsafe {
        libc::lsetxattr(
            c.as_ptr(),
            n.as_ptr(),
            value.as_ptr() as *const libc::c_void,
            value.len(),
            flags,
        )
    })
}

/// getxattr with an explicit buffer size (0 asks for the value's length).
pub fn getxattr_sized(p: &Path, name: &str, size: usize) -> io::Result<(usize, Vec<u8>)> {
    let c = cpath(p);
    let n = cname(name);
    let mut buf = vec![0u8; size];
    let ptr = if size == 0 {
        std::ptr::null_mut()
    } else {
        buf.as_mut_ptr() as *mut libc::c_void
    };
    // SAFETY: buffer of `size` bytes (or null with size 0).
    let r = cvt_size(unsafe { libc::getxattr(c.as_ptr(), n.as_ptr(), ptr, size) })?;
    buf.truncate(r.min(size));
    Ok((r, buf))
}

/// The daemon's counters of the mount `m` (the JSON `birchfs stats --json` prints).
pub fn daemon_stats(m: &Mount) -> serde_json::Value {
    // One call with room to spare, as `birchfs stats` reads it: the counters may
    // grow between a call asking for the size and one reading the value (ERANGE).
    let (_, raw) = getxattr_sized(m.root(), "birchfs.stats", 1 << 16).expect("read birchfs.stats");
    serde_json::from_slice(&raw).expect("stats are JSON")
}

pub fn getxattr(p: &Path, name: &str) -> io::Result<Vec<u8>> {
    let (len, _) = getxattr_sized(p, name, 0)?;
    let (got, buf) = getxattr_sized(p, name, len.max(1))?;
    assert_eq!(
        got, len,
        "getxattr {name}: size query said {len}, read gave {got}"
    );
    Ok(buf)
}

fn split_names(buf: &[u8]) -> Vec<String> {
    let mut names: Vec<String> = buf
        .split(|&b| b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect();
    names.sort();
    names
}

/// listxattr, sorted. Also checks that the size query matches the listing
/// and that the list is NUL-terminated.
pub fn listxattr(p: &Path) -> io::Result<Vec<String>> {
    let c = cpath(p);
    // SAFETY: size query with a null buffer.
    let len = cvt_size(unsafe { libc::listxattr(c.as_ptr(), std::ptr::null_mut(), 0) })?;
    let mut buf = vec![0u8; len.max(1)];
    // SAFETY: buffer of buf.len() bytes.
    let got = cvt_size(unsafe {
        libc::listxattr(c.as_ptr(), buf.as_mut_ptr() as *mut libc::c_char, buf.len())
    })?;
    assert_eq!(
        got, len,
        "listxattr: size query said {len}, listing gave {got}"
    );
    buf.truncate(got);
    if !buf.is_empty() {
        assert_eq!(
            buf[buf.len() - 1],
            0,
            "listxattr result is not NUL-terminated"
        );
    }
    Ok(split_names(&buf))
}

pub fn llistxattr(p: &Path) -> io::Result<Vec<String>> {
    let c = cpath(p);
    // SAFETY: size query with a null buffer.
    let len = cvt_size(unsafe { libc::llistxattr(c.as_ptr(), std::ptr::null_mut(), 0) })?;
    let mut buf = vec![0u8; len.max(1)];
    // SAFETY: buffer of buf.len() bytes.
    let got = cvt_size(unsafe {
        libc::llistxattr(c.as_ptr(), buf.as_mut_ptr() as *mut libc::c_char, buf.len())
    })?;
    buf.truncate(got);
    Ok(split_names(&buf))
}

pub fn removexattr(p: &Path, name: &str) -> io::Result<()> {
    let c = cpath(p);
    let n = cname(name);
    // SAFETY: valid C strings.
    cvt(unsafe { libc::removexattr(c.as_ptr(), n.as_ptr()) })
}

pub fn statfs(p: &Path) -> io::Result<libc::statfs> {
    let c = cpath(p);
    // SAFETY: statfs is plain old data filled in by the kernel.
    unsafe {
        let mut s: libc::statfs = std::mem::zeroed();
        cvt(libc::statfs(c.as_ptr(), &mut s))?;
        Ok(s)
    }
}

/// Free bytes per statfs (f_bfree in fragment units).
pub fn free_bytes(p: &Path) -> u64 {
    let s = statfs(p).expect("statfs");
    let unit = if s.f_frsize > 0 {
        s.f_frsize as u64
    } else {
        s.f_bsize as u64
    };
    s.f_bfree as u64 * unit
}

/// One raw directory entry as readdir(3) returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawDirent {
    pub name: Vec<u8>,
    pub ino: u64,
    pub d_type: u8,
}

/// Every entry readdir(3) returns, "." and ".." included, in order.
pub fn readdir_raw(p: &Path) -> io::Result<Vec<RawDirent>> {
    let c = cpath(p);
    let mut v = Vec::new();
    // SAFETY: opendir/readdir/closedir on a valid path; each dirent is read
    // before the next readdir call.
    unsafe {
        let dir = libc::opendir(c.as_ptr());
        if dir.is_null() {
            return Err(io::Error::last_os_error());
        }
        loop {
            *libc::__errno_location() = 0;
            let ent = libc::readdir(dir);
            if ent.is_null() {
                let e = *libc::__errno_location();
                libc::closedir(dir);
                if e != 0 {
                    return Err(io::Error::from_raw_os_error(e));
                }
                break;
            }
            let name = CStr::from_ptr((*ent).d_name.as_ptr()).to_bytes().to_vec();
            v.push(RawDirent {
                name,
                ino: (*ent).d_ino as u64,
                d_type: (*ent).d_type,
            });
        }
    }
    Ok(v)
}

/// The process umask, read from /proc/self/status (never changed by tests:
/// it is process-wide and tests run in parallel).
pub fn current_umask() -> u32 {
    if let Ok(s) = fs::read_to_string("/proc/self/status") {
        for line in s.lines() {
            if let Some(v) = line.strip_prefix("Umask:") {
                if let Ok(m) = u32::from_str_radix(v.trim(), 8) {
                    return m;
                }
            }
        }
    }
    0o022
}

/// The permission bits (incl. setuid/setgid/sticky) of a mode.
pub fn perm(mode: u32) -> u32 {
    mode & 0o7777
}

pub fn file_type_bits(mode: u32) -> u32 {
    mode & libc::S_IFMT
}

/// (sec, nsec) pairs, for exact timestamp comparisons.
pub fn atime(m: &fs::Metadata) -> (i64, i64) {
    (m.atime(), m.atime_nsec())
}
pub fn mtime(m: &fs::Metadata) -> (i64, i64) {
    (m.mtime(), m.mtime_nsec())
}
pub fn ctime(m: &fs::Metadata) -> (i64, i64) {
    (m.ctime(), m.ctime_nsec())
}

#[track_caller]
pub fn lstat(p: &Path) -> fs::Metadata {
    fs::symlink_metadata(p).unwrap_or_else(|e| panic!("lstat {}: {}", p.display(), e))
}

#[track_caller]
pub fn stat(p: &Path) -> fs::Metadata {
    fs::metadata(p).unwrap_or_else(|e| panic!("stat {}: {}", p.display(), e))
}

/// Opens a file for reading and writing, creating it.
#[track_caller]
pub fn open_rw_create(p: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(p)
        .unwrap_or_else(|e| panic!("open {}: {}", p.display(), e))
}

/// Sleep long enough that a later timestamp is strictly greater.
pub fn tick() {
    std::thread::sleep(Duration::from_millis(20));
}

// ---------------------------------------------------------------------------
// Deterministic data
// ---------------------------------------------------------------------------

pub const POOL_LEN: usize = 4 << 20;

/// 4 MiB of pseudo-random bytes from a seeded StdRng, shared by all tests of
/// a binary. Test data are slices of it at test-chosen offsets: cheap to
/// produce and to regenerate for comparisons, and no two distinct offsets
/// give equal 4 KiB blocks.
pub fn pool() -> &'static [u8] {
    static POOL: OnceLock<Vec<u8>> = OnceLock::new();
    POOL.get_or_init(|| {
        let mut rng = StdRng::seed_from_u64(0x6269_7263_6866_7321);
        let mut v = vec![0u8; POOL_LEN];
        rng.fill_bytes(&mut v);
        v
    })
}

/// `n` MiB of distinct pseudo-random data determined by `key`.
pub fn mib_data(n: usize, key: u64) -> Vec<u8> {
    (0..n as u64)
        .flat_map(|i| pattern(key * 1000 + i, 1 << 20))
        .copied()
        .collect()
}

/// `threads` threads at once each create `files` files in `dir`, named `{tag}{t}-{i}`
/// and holding `len` bytes of `pattern(t * 10_000 + i, len)`, fsyncing each when
/// `fsync` is set.
pub fn create_concurrently(
    dir: &Path,
    threads: u64,
    files: u64,
    len: usize,
    tag: &str,
    fsync: bool,
) {
    let start = std::sync::Barrier::new(threads as usize);
    std::thread::scope(|s| {
        for t in 0..threads {
            let start = &start;
            s.spawn(move || {
                start.wait();
                for i in 0..files {
                    let mut f = File::create(dir.join(format!("{tag}{t}-{i}"))).unwrap();
                    f.write_all(pattern(t * 10_000 + i, len)).unwrap();
                    if fsync {
                        f.sync_all().unwrap();
                    }
                }
            });
        }
    });
}

/// Checks what [`create_concurrently`] made, through `m`.
pub fn check_created(m: &Mount, threads: u64, files: u64, len: usize, tag: &str) {
    for t in 0..threads {
        for i in 0..files {
            let got = fs::read(m.path(format!("{tag}{t}-{i}"))).unwrap();
            assert_bytes_eq(&got, pattern(t * 10_000 + i, len), 0, "created file");
        }
    }
}

/// `len` (at most 2 MiB) pseudo-random bytes determined by `key`.
pub fn pattern(key: u64, len: usize) -> &'static [u8] {
    assert!(len <= POOL_LEN / 2, "pattern: len {} too large", len);
    let span = (POOL_LEN - len + 1) as u64;
    let start = (mix64(key) % span) as usize;
    &pool()[start..start + len]
}

/// splitmix64 finalizer: a cheap, well-spread hash of a u64.
pub fn mix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Position of the first differing byte, if any.
pub fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    if a == b {
        return None;
    }
    let n = a.len().min(b.len());
    Some((0..n).find(|&i| a[i] != b[i]).unwrap_or(n))
}

/// Asserts two byte slices are equal, reporting the first difference at
/// `base` + index instead of dumping megabytes.
#[track_caller]
pub fn assert_bytes_eq(actual: &[u8], expected: &[u8], base: u64, what: &str) {
    if let Some(i) = first_difference(actual, expected) {
        let show = |s: &[u8]| -> String {
            let end = (i + 16).min(s.len());
            format!("{:02x?}", &s[i.min(s.len())..end])
        };
        panic!(
            "{}: data differs at offset {} (len actual {}, expected {}): actual {} expected {}",
            what,
            base + i as u64,
            actual.len(),
            expected.len(),
            show(actual),
            show(expected)
        );
    }
}

/// True when every byte is zero (compares 4 KiB at a time with memcmp).
pub fn is_zero(b: &[u8]) -> bool {
    const Z: [u8; 4096] = [0; 4096];
    b.chunks(4096).all(|c| c == &Z[..c.len()])
}

/// Sorted names in a directory (std::fs::read_dir, so without "." and
/// ".."); panics if readdir returns a name twice.
#[track_caller]
pub fn list_dir(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read_dir {}: {}", dir.display(), e))
        .map(|e| {
            e.expect("readdir entry")
                .file_name()
                .into_string()
                .expect("non-UTF-8 name")
        })
        .collect();
    let n = v.len();
    v.sort();
    v.dedup();
    assert_eq!(
        v.len(),
        n,
        "readdir of {} returned duplicates",
        dir.display()
    );
    v
}

/// d_ino of `name` as readdir(3) reports it in `dir`.
#[track_caller]
pub fn dirent_ino(dir: &Path, name: &str) -> u64 {
    let ents = readdir_raw(dir).unwrap_or_else(|e| panic!("readdir {}: {}", dir.display(), e));
    let hits: Vec<&RawDirent> = ents.iter().filter(|e| e.name == name.as_bytes()).collect();
    assert_eq!(
        hits.len(),
        1,
        "readdir of {} has {} entries named {:?}",
        dir.display(),
        hits.len(),
        name
    );
    hits[0].ino
}

/// Current wall-clock time as (sec, nsec).
pub fn now() -> (i64, i64) {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock before 1970");
    (d.as_secs() as i64, d.subsec_nanos() as i64)
}

pub fn ns(t: (i64, i64)) -> i128 {
    t.0 as i128 * 1_000_000_000 + t.1 as i128
}

/// Asserts lo - 1 s <= t <= hi + 1 s (kernel and daemon clocks may be
/// coarse; this catches zero or garbage timestamps, not jitter).
#[track_caller]
pub fn assert_time_near(t: (i64, i64), lo: (i64, i64), hi: (i64, i64), what: &str) {
    let slack = 1_000_000_000i128;
    assert!(
        ns(t) >= ns(lo) - slack && ns(t) <= ns(hi) + slack,
        "{}: timestamp {:?} not within [{:?}, {:?}] (+-1 s)",
        what,
        t,
        lo,
        hi
    );
}
