//! The `birchfs` command: mkfs, mount, check, dump.

use std::io::{Read, Write};
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::{Parser, Subcommand};

use birchfs::dev::FileDev;
use birchfs::fuse::{uring, FuseFs};
use birchfs::{Fs, MkfsOptions, Options, SnapshotInfo};

mod umount;

#[derive(Parser)]
#[command(
    name = "birchfs",
    version,
    about = "A copy-on-write, checksummed filesystem in user space"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Create a birchfs filesystem on IMAGE (created sparse if missing)
    Mkfs {
        /// Size of a new or grown image (e.g. 10G, 512M); default: the existing size, or 1G
        #[arg(long)]
        size: Option<String>,
        /// Overwrite an existing birchfs filesystem
        #[arg(long)]
        force: bool,
        /// B-tree node size in bytes (4096..65536, power of two)
        #[arg(long)]
        node_size: Option<u32>,
        /// Write zeros over the whole image file first, so that the host allocates its
        /// blocks now and not during fsyncs later (image files only)
        #[arg(long)]
        preallocate: bool,
        /// Owner of the root directory, as UID:GID; default: the user running mkfs
        #[arg(long, value_name = "UID:GID")]
        root_owner: Option<String>,
        /// Image file or block device
        image: PathBuf,
    },
    /// Mount IMAGE on MOUNTPOINT through FUSE
    Mount {
        /// Comma-separated mount options (see the README), e.g. cache_size=1G,nosuid
        #[arg(short = 'o', value_delimiter = ',')]
        options: Vec<String>,
        /// Stay in the foreground until unmounted
        #[arg(long)]
        foreground: bool,
        /// Write the daemon's log here (background mounts log nowhere otherwise)
        #[arg(long)]
        log: Option<PathBuf>,
        /// Internal: the fd on which to report readiness to the parent
        #[arg(long, hide = true)]
        ready_fd: Option<i32>,
        /// Image file or block device
        image: PathBuf,
        /// Directory to mount on
        mountpoint: PathBuf,
    },
    /// Check the filesystem: exit 0 clean, 1 problems found, 2 unreadable
    Check {
        /// Image file or block device
        image: PathBuf,
    },
    /// Unmount MOUNTPOINT and wait until its daemon has committed everything and exited
    Umount {
        /// The mountpoint
        mountpoint: PathBuf,
    },
    /// Print the statistics of a mounted birchfs
    Stats {
        /// Print JSON instead of a table
        #[arg(long)]
        json: bool,
        /// Walk every file extent and print exclusive and shared data space instead
        #[arg(long)]
        space: bool,
        /// The mountpoint
        mountpoint: PathBuf,
    },
    /// Take, list and delete read-only snapshots (of a mount, or of an unmounted image)
    Snapshot {
        #[command(subcommand)]
        action: SnapshotCmd,
    },
    /// Print the trees of IMAGE and the log a mount would replay
    Dump {
        /// Only this tree: root, extent, fs, csum; or log (the fsynced changes a mount would replay)
        #[arg(long)]
        tree: Option<String>,
        /// Image file or block device
        image: PathBuf,
    },
}

#[derive(Subcommand)]
enum SnapshotCmd {
    /// Take snapshot NAME (it shows as TARGET/.snapshots/NAME when mounted)
    Create {
        /// A birchfs mountpoint, or an unmounted image
        target: PathBuf,
        /// Name of the snapshot
        name: String,
    },
    /// List the snapshots
    List {
        /// Print JSON instead of a table
        #[arg(long)]
        json: bool,
        /// A birchfs mountpoint, or an unmounted image
        target: PathBuf,
    },
    /// Delete snapshot NAME (a mount frees its space in the background)
    Delete {
        /// A birchfs mountpoint, or an unmounted image
        target: PathBuf,
        /// Name of the snapshot
        name: String,
    },
}

/// `YYYY-MM-DD HH:MM:SS` (UTC) of seconds since the epoch.
fn utc(sec: i64) -> String {
    let (days, rem) = (sec.div_euclid(86400), sec.rem_euclid(86400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

fn snapshot_cmd(action: SnapshotCmd) -> Result<()> {
    let target = match &action {
        SnapshotCmd::Create { target, .. }
        | SnapshotCmd::List { target, .. }
        | SnapshotCmd::Delete { target, .. } => target.clone(),
    };
    let as_json = matches!(action, SnapshotCmd::List { json: true, .. });
    let json = if target.is_dir() {
        // A mount: the same as mkdir/rmdir in .snapshots.
        let dir = target.join(".snapshots");
        match action {
            SnapshotCmd::Create { name, .. } => {
                std::fs::create_dir(dir.join(&name)).with_context(|| {
                    format!("cannot take snapshot {name:?} of {}", target.display())
                })?;
                return Ok(());
            }
            SnapshotCmd::Delete { name, .. } => {
                std::fs::remove_dir(dir.join(&name)).with_context(|| {
                    format!("cannot delete snapshot {name:?} of {}", target.display())
                })?;
                return Ok(());
            }
            SnapshotCmd::List { .. } => {
                // One xattr per snapshot: a list of thousands would not fit in one.
                let mut list = Vec::new();
                for e in std::fs::read_dir(&dir)
                    .with_context(|| format!("{} is not a birchfs mountpoint", target.display()))?
                {
                    let raw = read_stats(&e?.path(), birchfs::fuse::SNAPSHOT_XATTR)?;
                    list.push(serde_json::from_str::<serde_json::Value>(&raw)?);
                }
                list.sort_by_key(|s| s["id"].as_u64());
                serde_json::Value::Array(list).to_string()
            }
        }
    } else {
        let dev = open_when_free(&target, true)
            .with_context(|| format!("cannot open {}", target.display()))?;
        let fs = Fs::open(
            Arc::new(dev),
            Options {
                commit_interval: Duration::ZERO,
                ..Default::default()
            },
        )
        .with_context(|| format!("cannot open {}", target.display()))?;
        let json = match action {
            SnapshotCmd::Create { name, .. } => {
                fs.snapshot_create(name.as_bytes())?;
                None
            }
            SnapshotCmd::Delete { name, .. } => {
                fs.snapshot_delete(name.as_bytes())?;
                while fs.drop_deleted(usize::MAX)? {}
                None
            }
            SnapshotCmd::List { .. } => Some(SnapshotInfo::list_to_json(&fs.snapshot_list())),
        };
        fs.unmount()?;
        match json {
            Some(j) => j,
            None => return Ok(()),
        }
    };
    if as_json {
        println!("{json}");
        return Ok(());
    }
    let list: serde_json::Value = serde_json::from_str(&json).context("bad snapshot list")?;
    println!(
        "{:<20} {:>6} {:>10}  CREATED (UTC)",
        "NAME", "ID", "GENERATION"
    );
    for s in list.as_array().into_iter().flatten() {
        println!(
            "{:<20} {:>6} {:>10}  {}",
            s["name"].as_str().unwrap_or("?"),
            s["id"].as_u64().unwrap_or(0),
            s["generation"].as_u64().unwrap_or(0),
            utc(s["created_sec"].as_i64().unwrap_or(0))
        );
    }
    Ok(())
}

fn parse_size(s: &str) -> Result<u64> {
    let s = s.trim();
    let (num, mult) = match s.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        Some('G') => (&s[..s.len() - 1], 1 << 30),
        Some('T') => (&s[..s.len() - 1], 1 << 40),
        _ => (s, 1),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| anyhow!("bad size '{s}' (use e.g. 512M, 10G)"))?;
    n.checked_mul(mult)
        .ok_or_else(|| anyhow!("size '{s}' too large"))
}

/// Writes zeros over all of the image file behind `dev`, so the host allocates every
/// block: on a sparse image, a copy-on-write filesystem's fsyncs keep landing in
/// holes, and the host then commits its own journal before the flush returns.
fn preallocate(dev: &FileDev, image: &Path) -> Result<()> {
    use birchfs::dev::BlockDev;
    birchfs::dev::write_zeros(dev, 0, dev.size())
        .with_context(|| format!("cannot write zeros to {}", image.display()))?;
    dev.flush()
        .with_context(|| format!("cannot flush {}", image.display()))?;
    Ok(())
}

/// `UID:GID` as numbers.
fn parse_owner(s: &str) -> Result<(u32, u32)> {
    let bad = || anyhow!("bad owner '{s}' (use UID:GID, e.g. 1000:1000)");
    let (u, g) = s.split_once(':').ok_or_else(bad)?;
    Ok((u.parse().map_err(|_| bad())?, g.parse().map_err(|_| bad())?))
}

/// Creates a filesystem on `image`; a file it created for that is removed again when
/// it fails.
fn mkfs(
    image: &Path,
    size: Option<String>,
    force: bool,
    opts: &MkfsOptions,
    prealloc: bool,
) -> Result<()> {
    let existed = image.exists();
    let r = mkfs_on(image, size, force, opts, prealloc);
    if r.is_err() && !existed {
        let _ = std::fs::remove_file(image);
    }
    r
}

fn mkfs_on(
    image: &Path,
    size: Option<String>,
    force: bool,
    opts: &MkfsOptions,
    prealloc: bool,
) -> Result<()> {
    let size = size.as_deref().map(parse_size).transpose()?;
    let exists = image.exists();
    if !exists {
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(image)
            .with_context(|| format!("cannot create {}", image.display()))?;
    }
    // Everything below, resizing included, happens under the image's lock: a mounted
    // image is refused before a byte of it changes.
    let mut dev =
        open_when_free(image, true).with_context(|| format!("cannot open {}", image.display()))?;
    if exists && !force && birchfs::check::has_birchfs_magic(&dev) {
        bail!(
            "{} already holds a birchfs filesystem; use --force to overwrite it",
            image.display()
        );
    }
    let meta =
        std::fs::metadata(image).with_context(|| format!("cannot open {}", image.display()))?;
    let is_file = meta.file_type().is_file();
    if prealloc && !is_file {
        bail!(
            "--preallocate is for image files; {} is not one",
            image.display()
        );
    }
    // It overwrites every byte: an existing file's contents only with --force.
    if prealloc && exists && !force {
        bail!(
            "--preallocate overwrites all of the existing {}; add --force",
            image.display()
        );
    }
    // The size it will have: a new file's or a resized one's, else what it is.
    let resize = is_file && (!exists || size.is_some());
    let want = if resize {
        size.unwrap_or(1 << 30)
    } else {
        meta.len()
    };
    // Refuse what mkfs would refuse anyway before resizing or writing zeros.
    if prealloc && want < 32 << 20 {
        bail!(
            "{} is smaller than 32 MiB; nothing written",
            image.display()
        );
    }
    if resize && meta.len() != want {
        dev.resize(want)
            .with_context(|| format!("cannot size {}", image.display()))?;
    }
    if prealloc {
        preallocate(&dev, image)?;
    }
    let dev = Arc::new(dev);
    let bytes = birchfs::dev::BlockDev::size(dev.as_ref());
    Fs::mkfs(dev, opts).with_context(|| format!("mkfs on {} failed", image.display()))?;
    println!(
        "created birchfs on {} ({} MiB)",
        image.display(),
        bytes >> 20
    );
    Ok(())
}

struct MountOpts {
    fs: Options,
    /// FUSE request threads.
    threads: usize,
    /// Whether to serve requests through io_uring queues.
    uring: UringMode,
    /// How the io_uring queues are served.
    ring: birchfs::fuse::uring::RingConfig,
    /// Whether group commits wait briefly to gather the fsyncs of threads expected back.
    gather: bool,
    /// Smallest file whose read-only opens bypass the kernel's page cache (`None`:
    /// never); unset means the cache size.
    direct_read: Option<Option<u64>>,
    /// The generic mount flags asked for (nosuid, nodev, noexec, noatime, sync).
    vfs: VfsFlags,
}

/// Generic mount flags, which the kernel enforces on the mount.
#[derive(Default)]
struct VfsFlags {
    nosuid: bool,
    nodev: bool,
    noexec: bool,
    noatime: bool,
    sync: bool,
}

impl VfsFlags {
    /// The flags as fuser mount options; set-id and device files work only for root.
    fn mount_options(&self, root: bool) -> Vec<fuser::MountOption> {
        use fuser::MountOption as M;
        let mut v = vec![if self.noexec { M::NoExec } else { M::Exec }];
        if root {
            v.push(if self.nosuid { M::NoSuid } else { M::Suid });
            v.push(if self.nodev { M::NoDev } else { M::Dev });
        }
        if self.noatime {
            v.push(M::NoAtime);
        }
        if self.sync {
            v.push(M::Sync);
        }
        v
    }
}

impl MountOpts {
    /// The `direct_read=` threshold in effect.
    fn direct_read(&self) -> Option<u64> {
        self.direct_read.unwrap_or(Some(self.fs.cache.cache_size))
    }
}

/// The `uring=` mount option (off by default: on 2 CPUs it measured slower than
/// `/dev/fuse` for fsync-heavy work, see README).
#[derive(Clone, Copy, Debug, PartialEq)]
enum UringMode {
    /// Never: every request through read(2)/write(2) on /dev/fuse.
    Off,
    /// When the kernel offers it (fuse's enable_uring parameter is on).
    Auto,
    /// Always: turns the parameter on if it can, and fails the mount otherwise.
    On,
}

/// Request threads by default: one per CPU, at least two. Eight threads on two CPUs
/// only switched between each other. Four on two CPUs helped fsync-heavy work a little
/// (W4 creates with fsync +10 %, W3 +1..11 %) but cost creates without fsync a third
/// (W4 no-fsync 16.5k -> 9.5..11.5k files/s: more threads contend for the fs lock).
fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(2, 16)
}

/// The error for a mount option birchfs does not know.
fn unknown_option(opt: &str) -> String {
    format!(
        "unknown mount option '{opt}' (known: commit=SECONDS, cache_size=SIZE, \
         folio_size=SIZE, dirty_expire=SECONDS, block_dirty=on|off, threads=N, \
         fsync_gather=on|off, direct_read=SIZE|off, uring=auto|on|off, uring_threads=N, \
         uring_depth=N, ro, rw, nosuid, nodev, noexec, noatime, sync, defaults)"
    )
}

fn parse_mount_options(list: &[String]) -> Result<MountOpts> {
    let mut o = MountOpts {
        fs: Options::default(),
        threads: default_threads(),
        uring: UringMode::Off,
        ring: Default::default(),
        gather: true,
        direct_read: None,
        vfs: VfsFlags::default(),
    };
    let count = |opt: &str, v: &str, max: usize| {
        v.parse()
            .ok()
            .filter(|n| (1..=max).contains(n))
            .ok_or_else(|| anyhow!("bad value in mount option '{opt}' (1 to {max})"))
    };
    for opt in list.iter().filter(|s| !s.is_empty()) {
        match opt.split_once('=') {
            Some(("commit", v)) => {
                let secs: u64 = v
                    .parse()
                    .map_err(|_| anyhow!("bad value in mount option '{opt}'"))?;
                o.fs.commit_interval = Duration::from_secs(secs);
            }
            Some(("cache_size", v)) => {
                o.fs.cache.cache_size =
                    parse_size(v).with_context(|| format!("in mount option '{opt}'"))?
            }
            Some(("folio_size", v)) => {
                o.fs.cache.folio_size =
                    parse_size(v).with_context(|| format!("in mount option '{opt}'"))?
            }
            Some(("dirty_expire", v)) => {
                let secs: u64 = v
                    .parse()
                    .map_err(|_| anyhow!("bad value in mount option '{opt}'"))?;
                o.fs.cache.dirty_expire = Duration::from_secs(secs);
            }
            Some(("threads", v)) => o.threads = count(opt, v, 256)?,
            Some(("uring", "on")) => o.uring = UringMode::On,
            Some(("uring", "off")) => o.uring = UringMode::Off,
            Some(("uring", "auto")) => o.uring = UringMode::Auto,
            Some(("uring_threads", v)) => o.ring.threads = count(opt, v, 64)?,
            Some(("uring_depth", v)) => o.ring.depth = count(opt, v, 256)?,
            Some(("block_dirty", "on")) => o.fs.cache.block_dirty = true,
            Some(("block_dirty", "off")) => o.fs.cache.block_dirty = false,
            Some(("fsync_gather", "on")) => o.gather = true,
            Some(("fsync_gather", "off")) => o.gather = false,
            Some(("direct_read", "off")) => o.direct_read = Some(None),
            Some(("direct_read", v)) => {
                o.direct_read = Some(Some(
                    parse_size(v).with_context(|| format!("in mount option '{opt}'"))?,
                ))
            }
            None => match opt.as_str() {
                "ro" => o.fs.readonly = true,
                "rw" => o.fs.readonly = false,
                "nosuid" => o.vfs.nosuid = true,
                "suid" => o.vfs.nosuid = false,
                "nodev" => o.vfs.nodev = true,
                "dev" => o.vfs.nodev = false,
                "noexec" => o.vfs.noexec = true,
                "exec" => o.vfs.noexec = false,
                // birchfs never updates access times on its own: noatime is what it
                // does anyway, and the kernel then leaves them alone too.
                "noatime" | "nodiratime" => o.vfs.noatime = true,
                "sync" => o.vfs.sync = true,
                "async" => o.vfs.sync = false,
                "defaults" => {}
                "atime" | "relatime" | "strictatime" | "diratime" | "lazytime" => bail!(
                    "mount option '{opt}': birchfs does not update access times on reads \
                     (it behaves as noatime)"
                ),
                "dirsync" => {
                    bail!("mount option 'dirsync' is not supported: fsync the directory instead")
                }
                _ => bail!(unknown_option(opt)),
            },
            _ => bail!(unknown_option(opt)),
        }
    }
    o.fs.cache.validate().map_err(|e| anyhow!("{e}"))?;
    Ok(o)
}

fn init_logging(log: Option<&Path>) -> Result<()> {
    // fuser warns at every unmount made from outside (its own unmount then finds
    // nothing mounted); its other session messages are errors. A BIRCHFS_LOG that
    // names fuser itself decides alone.
    let asked = std::env::var("BIRCHFS_LOG").unwrap_or_else(|_| "warn".into());
    let spec = if asked.contains("fuser") {
        asked
    } else {
        format!("{asked},fuser::session=error")
    };
    let filter = tracing_subscriber::EnvFilter::try_new(&spec)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,fuser::session=error"));
    let b = tracing_subscriber::fmt().with_env_filter(filter);
    match log {
        Some(p) => {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .with_context(|| format!("cannot open log {}", p.display()))?;
            b.with_writer(std::sync::Mutex::new(f))
                .with_ansi(false)
                .init();
        }
        None => b.with_writer(std::io::stderr).init(),
    }
    Ok(())
}

/// Starts the daemon in the background and waits until it reports the mount ready.
fn mount_background(args: &[String]) -> Result<()> {
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
    let mut child = cmd.spawn().context("cannot start the mount daemon")?;
    drop(wr);
    let mut msg = String::new();
    std::fs::File::from(rd).read_to_string(&mut msg)?;
    if msg.starts_with("ok") {
        return Ok(());
    }
    let _ = child.wait();
    let msg = msg.trim();
    if msg.is_empty() {
        bail!("the mount daemon exited before the mount was ready");
    }
    bail!("{msg}")
}

fn mount(opts: &[String], image: &Path, mountpoint: &Path, ready_fd: Option<i32>) -> Result<()> {
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

/// Opens the image, waiting up to 10 s while another process holds its lock: after
/// `umount` the previous daemon still finishes its last commit before it lets go
/// (used by every command that opens an image).
fn open_when_free(image: &Path, writable: bool) -> std::io::Result<FileDev> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match FileDev::open(image, writable) {
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            r => return r,
        }
    }
}

fn mount_serve(
    opts: &[String],
    image: &Path,
    mountpoint: &Path,
    ready: &mut Option<std::fs::File>,
) -> Result<()> {
    let mo = parse_mount_options(opts)?;
    if !mountpoint.is_dir() {
        bail!(
            "mountpoint {} does not exist or is not a directory",
            mountpoint.display()
        );
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
    let fs = Arc::new(
        Fs::open(Arc::new(dev), mo.fs.clone())
            .with_context(|| format!("cannot mount {}", image.display()))?,
    );
    let mut cfg = fuser::Config::default();
    cfg.mount_options = vec![
        // Absolute, so that `birchfs umount` finds the image from anywhere.
        fuser::MountOption::FSName(format!("birchfs:{}", std::path::absolute(image)?.display())),
        fuser::MountOption::Subtype("birchfs".into()),
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
    cfg.n_threads = Some(mo.threads);
    cfg.clone_fd = true;
    let mut ffs = FuseFs::new(fs.clone());
    ffs.direct_reads(mo.direct_read());
    ffs.gather_fsyncs(mo.gather);
    if want_uring(mo.uring)? {
        ffs.offer_uring();
    }
    let served = ffs.clone();
    let mut session = fuser::Session::new(ffs, mountpoint, &cfg)
        .with_context(|| format!("cannot mount on {}", mountpoint.display()))?;
    served.set_notifier(session.notifier());
    let rings = if served.uring_agreed() {
        let (rings, r) = uring::Rings::start(&served, session.as_fd(), mo.ring);
        match r {
            Ok(()) => tracing::info!("serving FUSE requests through io_uring queues"),
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
    let mut signals =
        signal_hook::iterator::Signals::new([libc::SIGINT, libc::SIGTERM, libc::SIGHUP])?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                tracing::info!("signal {sig}: unmounting");
                if let Err(e) = unmounter.unmount() {
                    tracing::error!("unmount on signal failed: {e}");
                }
            }
        })?;
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
    if let Some(mut f) = ready.take() {
        let _ = f.write_all(b"ok\n");
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
        })?;
    Ok(())
}

fn read_stats(mountpoint: &Path, xattr: &str) -> Result<String> {
    use std::os::unix::ffi::OsStrExt;
    let p = std::ffi::CString::new(mountpoint.as_os_str().as_bytes())?;
    let n = std::ffi::CString::new(xattr)?;
    let mut buf = vec![0u8; 1 << 16];
    // SAFETY: valid C strings and a buffer of the given length.
    let r = unsafe { libc::getxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if r < 0 {
        bail!(
            "cannot read {xattr} of {} (not on a birchfs mount?): {}",
            mountpoint.display(),
            std::io::Error::last_os_error()
        );
    }
    buf.truncate(r as usize);
    Ok(String::from_utf8(buf)?)
}

/// Renders the stats JSON as `key value` lines, flattening nested objects.
fn stats_table(json: &str) -> String {
    let mut out = String::new();
    let mut path: Vec<String> = Vec::new();
    let mut key = String::new();
    let mut tok = String::new();
    let mut in_str = false;
    for c in json.chars() {
        match c {
            '"' => in_str = !in_str,
            _ if in_str => tok.push(c),
            ':' => key = std::mem::take(&mut tok),
            '{' => {
                if !key.is_empty() {
                    path.push(std::mem::take(&mut key));
                }
            }
            ',' | '}' => {
                if !key.is_empty() {
                    let mut name = path.join(".");
                    if !name.is_empty() {
                        name.push('.');
                    }
                    name.push_str(&key);
                    out.push_str(&format!("{name:<28} {}\n", tok.trim()));
                    key.clear();
                }
                tok.clear();
                if c == '}' {
                    path.pop();
                }
            }
            _ => tok.push(c),
        }
    }
    out
}

fn run() -> Result<ExitCode> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Mkfs {
            size,
            force,
            node_size,
            preallocate,
            root_owner,
            image,
        } => {
            init_logging(None)?;
            let root_owner = match root_owner {
                Some(o) => parse_owner(&o)?,
                // SAFETY: geteuid and getegid have no preconditions.
                None => unsafe { (libc::geteuid(), libc::getegid()) },
            };
            let opts = MkfsOptions {
                node_size,
                root_owner,
            };
            mkfs(&image, size, force, &opts, preallocate)?;
        }
        Cmd::Mount {
            options,
            foreground,
            log,
            ready_fd,
            image,
            mountpoint,
        } => {
            if !foreground {
                parse_mount_options(&options)?;
                let mut args: Vec<String> = Vec::new();
                if !options.is_empty() {
                    args.push("-o".into());
                    args.push(options.join(","));
                }
                if let Some(l) = &log {
                    args.push("--log".into());
                    args.push(std::path::absolute(l)?.display().to_string());
                }
                args.push(std::path::absolute(&image)?.display().to_string());
                args.push(std::path::absolute(&mountpoint)?.display().to_string());
                mount_background(&args)?;
            } else {
                init_logging(log.as_deref())?;
                mount(&options, &image, &mountpoint, ready_fd)?;
            }
        }
        Cmd::Check { image } => {
            init_logging(None)?;
            let dev = match open_when_free(&image, false) {
                Ok(d) => d,
                Err(e) => {
                    eprintln!("birchfs check: cannot open {}: {e}", image.display());
                    return Ok(ExitCode::from(2));
                }
            };
            return Ok(match birchfs::check::check(&dev) {
                Err(e) => {
                    eprintln!("birchfs check: {}: {e}", image.display());
                    ExitCode::from(2)
                }
                Ok(rep) => {
                    for p in &rep.problems {
                        println!("{p}");
                    }
                    eprintln!("{}", rep.summary());
                    if rep.pending_log_batches > 0 {
                        eprintln!(
                            "note: the log holds {} fsynced batches a mount would replay; \
                             this check saw the last commit without them (mount and \
                             unmount once, then check again, to check them too)",
                            rep.pending_log_batches
                        );
                    }
                    if rep.problems.is_empty() {
                        ExitCode::SUCCESS
                    } else {
                        ExitCode::from(1)
                    }
                }
            });
        }
        Cmd::Umount { mountpoint } => umount::umount(&mountpoint)?,
        Cmd::Stats {
            json,
            space,
            mountpoint,
        } => {
            let xattr = if space {
                birchfs::fuse::SPACE_XATTR
            } else {
                birchfs::fuse::STATS_XATTR
            };
            let raw = read_stats(&mountpoint, xattr)?;
            if json {
                println!("{raw}");
            } else {
                print!("{}", stats_table(&raw));
            }
        }
        Cmd::Snapshot { action } => {
            init_logging(None)?;
            snapshot_cmd(action)?;
        }
        Cmd::Dump { tree, image } => {
            init_logging(None)?;
            let dev = open_when_free(&image, false)
                .with_context(|| format!("cannot open {}", image.display()))?;
            let stdout = std::io::stdout();
            birchfs::dump::dump(&dev, tree.as_deref(), &mut stdout.lock())?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    match run() {
        Ok(c) => c,
        // `birchfs dump | head`: the reader went away, which is not an error.
        Err(e)
            if e.chain().any(|c| {
                c.downcast_ref::<std::io::Error>()
                    .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
                    || c.downcast_ref::<birchfs::Error>().is_some_and(
                        |b| matches!(b, birchfs::Error::Io(io) if io.kind() == std::io::ErrorKind::BrokenPipe),
                    )
            }) =>
        {
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("birchfs: {e:#}");
            ExitCode::from(1)
        }
    }
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
