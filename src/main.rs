//! The `birchfs` command: mkfs, mount, umount, check, dump, stats, snapshot.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use clap::{CommandFactory, Parser, Subcommand};

use birchfs::dev::{BlockDev, FileDev};
use birchfs::{Fs, MkfsOptions, Options, SnapshotInfo};

mod cli {
    //! The subcommands that take more than a screen.
    pub(crate) mod daemon;
    pub(crate) mod helper;
    pub(crate) mod options;
    pub(crate) mod remount;
    pub(crate) mod umount;
}

#[derive(Parser)]
#[command(
    name = "birchfs",
    version,
    about = "A copy-on-write, checksummed filesystem in user space",
    after_help = "As a mount helper (what `mount -t fuse.birchfs` and /etc/fstab call): \
                  birchfs IMAGE MOUNTPOINT [-o OPTIONS], the same as birchfs mount"
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
        /// Size of the log area that fsyncs write to (1M to 512M, at most half the
        /// image); default: 1/16 of the image, 2 MiB to 512 MiB
        #[arg(long, value_name = "SIZE")]
        log_size: Option<String>,
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
        /// Give up waiting after this many seconds (the unmount itself stays done; the
        /// daemon goes on with its last commit): exit 1 and say so
        #[arg(long, value_name = "SECONDS")]
        timeout: Option<u64>,
        /// The mountpoint
        mountpoint: PathBuf,
    },
    /// Commit everything a mount holds now, as sync does on a kernel filesystem (which
    /// sync(1) cannot ask of a FUSE daemon); exit 1 if that did not reach the disk or
    /// some of the kernel's cached writes found no room, 3 if the image's host had no
    /// room (birchfs keeps it: free space and sync again)
    Sync {
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
    /// Give the free space back to the host (holes in an image file, discards on a
    /// block device), of a mount (as fstrim does) or of an unmounted image
    Trim {
        /// A birchfs mountpoint, or an unmounted image
        target: PathBuf,
    },
    /// Grow the filesystem of TARGET to SIZE, mounted or not (an image file is
    /// lengthened to it; a block device must already be that large)
    Resize {
        /// A birchfs mountpoint, or an image file or block device (mounted or not)
        target: PathBuf,
        /// New size (K, M, G, T suffixes), +SIZE to add that much, or max (the
        /// whole image file or device as it is now)
        size: String,
    },
    /// Print the trees of IMAGE and the log a mount would replay
    Dump {
        /// Only this tree: root, extent, fs, csum; or log (the fsynced changes a mount would replay)
        #[arg(long)]
        tree: Option<String>,
        /// Image file or block device
        image: PathBuf,
    },
    /// Copy the files of IMAGE into DEST, also when damage keeps it from mounting:
    /// exit 0 all restored, 1 something damaged or lost (listed), 2 nothing read
    Restore {
        /// Restore this snapshot instead of the live filesystem
        #[arg(long)]
        snapshot: Option<String>,
        /// Image file or block device
        image: PathBuf,
        /// Directory to restore into (created, or empty)
        dest: PathBuf,
    },
}

#[derive(Subcommand)]
enum SnapshotCmd {
    /// Take snapshot NAME (it shows as TARGET/.snapshots/NAME when mounted)
    Create {
        /// A birchfs mountpoint, or an unmounted image
        target: PathBuf,
        /// Name of the snapshot (any bytes but `/` and NUL, as a file name)
        name: std::ffi::OsString,
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
        name: std::ffi::OsString,
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

/// An unmounted image, opened for a command that changes it and unmounts it itself
/// (no periodic commits).
fn open_unmounted(target: &Path) -> Result<Fs> {
    let dev = open_when_free(target, true)
        .with_context(|| format!("cannot open {}", target.display()))?;
    unmounted_fs(dev, target)
}

/// The filesystem on `dev` (the image `target`, already opened), as
/// [`open_unmounted`] opens it.
fn unmounted_fs(dev: FileDev, target: &Path) -> Result<Fs> {
    Fs::open(
        Arc::new(dev),
        Options {
            commit_interval: Duration::ZERO,
            ..Default::default()
        },
    )
    .with_context(|| format!("cannot open {}", target.display()))
}

/// `birchfs resize TARGET SIZE`: grows the filesystem of a mount in place (TARGET
/// its mount point, or its image while mounted), or of an unmounted image; returns
/// its old and new sizes.
fn resize_cmd(target: &Path, size: &str) -> Result<(u64, u64)> {
    cli::umount::refuse_dead_mount(target)?;
    if target.is_dir() {
        return resize_mounted(target, size);
    }
    if let Some(mp) = cli::umount::mount_storing_in(target) {
        // A loop device and the file under it: growing one leaves the other as it
        // was, so the mount is grown by its own name, and the other follows by hand.
        if let Some(served) = cli::umount::image_mounted_at(&mp)
            .ok()
            .filter(|s| !cli::umount::same_file(s, target))
        {
            bail!(
                "{} and {} (mounted at {}) are a loop device and the file under it, and \
                 growing one leaves the other as it was: grow the filesystem by its mount \
                 point, `birchfs resize {} SIZE` (a mount on a loop device grows to the \
                 device's size: lengthen the file and run `losetup -c` on the device \
                 first)",
                target.display(),
                served.display(),
                mp.display(),
                mp.display()
            );
        }
        eprintln!(
            "birchfs: {} is mounted at {}; growing it there",
            target.display(),
            mp.display()
        );
        return resize_mounted(&mp, size);
    }
    let dev = open_when_free(target, true)
        .with_context(|| format!("cannot open {}", target.display()))?;
    let sb =
        Fs::superblock_of(&dev).with_context(|| format!("cannot open {}", target.display()))?;
    let from = sb.total_bytes;
    let to = resize_target(target, size, from, dev.size(), dev.is_block_device())?;
    // The grow lengthens an image file itself, as it does for a mount.
    let fs = unmounted_fs(dev, target)?;
    fs.grow(to)
        .with_context(|| format!("cannot grow {}", target.display()))?;
    fs.unmount()?;
    Ok((from, to))
}

/// The size `spec` asks for (SIZE, +SIZE, or max: the whole device as it is now) of
/// the filesystem of `from` bytes on `what`, a device of `device` bytes; rounded down
/// to 4 KiB, larger than `from`, and within a block device (which birchfs cannot
/// lengthen, as it does an image file).
fn resize_target(what: &Path, spec: &str, from: u64, device: u64, bdev: bool) -> Result<u64> {
    let to = match spec.trim() {
        "max" => device,
        s => match s.strip_prefix('+') {
            Some(more) => from.saturating_add(parse_size(more)?),
            None => parse_size(s)?,
        },
    } & !4095;
    if to < from {
        bail!(
            "{} holds a filesystem of {from} bytes; birchfs grows filesystems and never \
             shrinks them",
            what.display()
        );
    }
    if to == from {
        bail!("{} is already {from} bytes", what.display());
    }
    if bdev && to > device {
        bail!(
            "{} is on a device of {device} bytes, less than {to}; grow the device first \
             (losetup -c for a loop device, lvextend for a volume)",
            what.display()
        );
    }
    Ok(to)
}

/// Grows the birchfs mounted at `mountpoint` through its daemon
/// ([`birchfs::fuse::BIRCHFS_IOC_RESIZE`]); returns its old and new sizes.
fn resize_mounted(mountpoint: &Path, size: &str) -> Result<(u64, u64)> {
    use std::os::fd::AsRawFd;
    let d = open_mount(mountpoint)?;
    let ask = |op: u64, size: u64| -> std::io::Result<[u64; 3]> {
        let mut arg = [op, size, 0];
        // SAFETY: BIRCHFS_IOC_RESIZE reads and writes three u64s at a valid pointer.
        let rc = unsafe {
            libc::ioctl(
                d.as_raw_fd(),
                birchfs::fuse::BIRCHFS_IOC_RESIZE as libc::c_ulong,
                arg.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(arg)
    };
    let why = |e: std::io::Error| match e.raw_os_error() {
        Some(libc::ENOTTY) => anyhow!(
            "{} is served by an older birchfs daemon, which cannot grow a mounted \
             filesystem; unmount it and run birchfs resize on its image",
            mountpoint.display()
        ),
        Some(libc::EPERM) => anyhow!(
            "cannot grow {}: only root or the user who mounted it may",
            mountpoint.display()
        ),
        Some(libc::EROFS) => anyhow!(
            "cannot grow {}: it is mounted read-only",
            mountpoint.display()
        ),
        _ => anyhow!("cannot grow {}: {e}", mountpoint.display()),
    };
    let [from, device, bdev] = ask(birchfs::fuse::RESIZE_QUERY, 0).map_err(why)?;
    let to = resize_target(mountpoint, size, from, device, bdev != 0)?;
    let [now, _, _] = ask(birchfs::fuse::RESIZE_GROW, to).map_err(why)?;
    Ok((from, now))
}

/// The root of the birchfs mounted at `dir`, opened for an ioctl; an error for any
/// other directory, whose filesystem would take birchfs's ioctls (and FITRIM) as its own.
fn open_mount(dir: &Path) -> Result<std::fs::File> {
    cli::umount::image_mounted_at(dir)?;
    std::fs::File::open(dir).with_context(|| format!("cannot open {}", dir.display()))
}

/// `birchfs sync`: the kernel's cached writes go to the daemon (syncfs), then the
/// daemon commits ([`birchfs::fuse::BIRCHFS_IOC_SYNC`]). Exit code 3: the host had no
/// room for the commit (the daemon keeps it for the next).
fn sync_cmd(mountpoint: &Path) -> Result<ExitCode> {
    use std::os::fd::AsRawFd;
    cli::umount::refuse_dead_mount(mountpoint)?;
    let d = open_mount(mountpoint)?;
    // A failed writeback here (the file system full) lost only its own pages: the
    // commit of everything else still runs, and the failure is reported after it.
    let lost = {
        // SAFETY: syncfs on a valid fd owned by `d`.
        let rc = unsafe { libc::syncfs(d.as_raw_fd()) };
        (rc != 0).then(std::io::Error::last_os_error)
    };
    // SAFETY: BIRCHFS_IOC_SYNC takes no argument.
    let rc = unsafe {
        libc::ioctl(
            d.as_raw_fd(),
            birchfs::fuse::BIRCHFS_IOC_SYNC as libc::c_ulong,
        )
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENOTTY) {
            bail!(
                "{} is served by an older birchfs daemon, which cannot commit on request",
                mountpoint.display()
            );
        }
        if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) {
            eprintln!(
                "birchfs: the commit of {} failed: {e}; the image's host is out of room, \
                 and birchfs keeps what it could not write until there is: free space \
                 there, then sync again",
                mountpoint.display()
            );
            return Ok(ExitCode::from(SYNC_NO_ROOM));
        }
        bail!(
            "the commit of {} failed: {e}; what changed since its last commit is not on \
             disk (the daemon's log says why)",
            mountpoint.display()
        );
    }
    if let Some(e) = lost {
        bail!(
            "some of the kernel's cached writes to {} did not reach birchfs: {e}; the \
             fsync of a file they belong to reports it; everything else is committed",
            mountpoint.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Exit code of `birchfs sync` when the commit found no room on the image's host.
pub(crate) const SYNC_NO_ROOM: u8 = 3;

/// `birchfs trim`: FITRIM on a mount, [`Fs::trim`] on an unmounted image; the bytes
/// discarded.
fn trim_cmd(target: &Path) -> Result<u64> {
    cli::umount::refuse_dead_mount(target)?;
    if target.is_dir() {
        let d = open_mount(target)?;
        let mut range = [0, u64::MAX, 0];
        // SAFETY: FITRIM reads and writes a struct fstrim_range (three u64s).
        let rc = unsafe {
            libc::ioctl(
                std::os::fd::AsRawFd::as_raw_fd(&d),
                birchfs::fuse::FITRIM as libc::c_ulong,
                range.as_mut_ptr(),
            )
        };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EROFS) {
                bail!(
                    "cannot trim {}: it is mounted read-only (-o ro), and trimming \
                     changes the image",
                    target.display()
                );
            }
            bail!("cannot trim {}: {e}", target.display());
        }
        return Ok(range[1]);
    }
    let fs = open_unmounted(target)?;
    let n = fs
        .trim(0, u64::MAX, 0)
        .with_context(|| format!("cannot trim {}", target.display()))?;
    fs.unmount()?;
    Ok(n)
}

fn snapshot_cmd(action: SnapshotCmd) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let target = match &action {
        SnapshotCmd::Create { target, .. }
        | SnapshotCmd::List { target, .. }
        | SnapshotCmd::Delete { target, .. } => target.clone(),
    };
    if let SnapshotCmd::Create { name, .. } | SnapshotCmd::Delete { name, .. } = &action {
        birchfs::check_snapshot_name(name.as_bytes())
            .with_context(|| format!("snapshot name {name:?}"))?;
    }
    cli::umount::refuse_dead_mount(&target)?;
    let as_json = matches!(action, SnapshotCmd::List { json: true, .. });
    let json = if target.is_dir() {
        // A mount: the same as mkdir/rmdir in .snapshots.
        cli::umount::image_mounted_at(&target)?;
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
        let fs = open_unmounted(&target)?;
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

/// A size with an optional K, M, G or T suffix, in bytes.
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
    if exists && !force {
        if birchfs::check::has_birchfs_magic(&dev) {
            bail!(
                "{} already holds a birchfs filesystem; use --force to overwrite it",
                image.display()
            );
        }
        if let Some(what) = birchfs::check::foreign_signature(&dev) {
            bail!(
                "{} appears to hold {what}; use --force to overwrite it",
                image.display()
            );
        }
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
    if prealloc && want < birchfs::format::MIN_DEVICE_SIZE {
        bail!(
            "{} is smaller than 32 MiB; nothing written",
            image.display()
        );
    }
    if let Some(len) = opts.log_size {
        let target = if is_file {
            want
        } else {
            birchfs::dev::BlockDev::size(&dev)
        };
        birchfs::log_area_sized(target & !4095, len)
            .with_context(|| format!("--log-size {len}: nothing written"))?;
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

/// The tracing target of what the daemon does on a signal.
pub(crate) const SIGNAL_TARGET: &str = "birchfs::signal";

/// Sends tracing output to `log`, or to stderr.
fn init_logging(log: Option<&Path>) -> Result<()> {
    // fuser warns at every unmount made from outside (its own unmount then finds
    // nothing mounted); its other session messages are errors. What the daemon does on
    // a signal is logged at any level (a user asked for it, SIGUSR1's counters
    // above all). A BIRCHFS_LOG that names either target decides alone for it.
    let asked = std::env::var("BIRCHFS_LOG").unwrap_or_else(|_| "warn".into());
    let mut spec = asked.clone();
    if !asked.contains("fuser") {
        spec.push_str(",fuser::session=error");
    }
    if !asked.contains(SIGNAL_TARGET) {
        spec.push_str(&format!(",{SIGNAL_TARGET}=info"));
    }
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

/// Points a background daemon's stderr (/dev/null) at its log, so that what it
/// cannot log itself still lands there: a panic's message, or the message of an
/// allocation that failed before the process aborted.
fn stderr_to(log: &Path) {
    use std::os::fd::AsRawFd;
    if let Ok(f) = std::fs::OpenOptions::new().append(true).open(log) {
        // SAFETY: dup2 of a valid open fd onto fd 2; `f` is closed after, fd 2 stays.
        unsafe { libc::dup2(f.as_raw_fd(), libc::STDERR_FILENO) };
    }
}

/// Prints a report's problems, one per line, to stdout and its totals to stderr.
fn print_report(problems: &[String], summary: &str) {
    for p in problems {
        println!("{p}");
    }
    eprintln!("{summary}");
}

/// 0 when nothing was found wrong, 1 otherwise (as `check` and `restore` exit).
fn exit_for(problems: &[String]) -> ExitCode {
    if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// Opens the image, waiting up to 10 s while another process holds its lock: after
/// `umount` the previous daemon still finishes its last commit before it lets go
/// (used by every command that opens an image). An image that is mounted (itself,
/// through a loop device, or under one) is refused at once, naming the mount.
fn open_when_free(image: &Path, writable: bool) -> std::io::Result<FileDev> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match FileDev::open(image, writable) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if let Some(point) = cli::umount::mount_storing_in(image) {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::WouldBlock,
                        format!(
                            "{} is in use by the birchfs mounted at {}",
                            image.display(),
                            point.display()
                        ),
                    ));
                }
                if std::time::Instant::now() >= deadline {
                    return Err(e);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            r => return r,
        }
    }
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

/// Makes a write past the file size limit (`ulimit -f`) fail with EFBIG instead of
/// killing the process (SIGXFSZ), and with `raise`, lifts the limit as far as the hard
/// limit allows, so that the commands that write an image can write all of it. The
/// limit is meant for the files a user writes, which the kernel checks against the
/// user's own limit; a daemon killed mid-commit by it would leave its mount dead.
/// Opening an image larger than the hard limit is refused with the reason (see
/// `FileDev::open`).
fn lift_file_size_limit(raise: bool) {
    // SAFETY: signal with a valid signal number and disposition; getrlimit and
    // setrlimit with a valid resource and a pointer to a local rlimit.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        if !raise {
            return;
        }
        let mut lim = std::mem::zeroed::<libc::rlimit>();
        if libc::getrlimit(libc::RLIMIT_FSIZE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_FSIZE, &lim);
        }
    }
}

fn run() -> Result<ExitCode> {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let command = Cli::command();
    let mut subcommands: Vec<&str> = command.get_subcommands().map(|c| c.get_name()).collect();
    subcommands.push("help");
    let cli = match cli::helper::rewrite(args.clone(), &subcommands)? {
        Some(mount) => Cli::parse_from(mount),
        None => Cli::parse_from(args),
    };
    let daemon = matches!(
        cli.cmd,
        Cmd::Mount {
            foreground: true,
            ..
        }
    );
    if !daemon {
        // `birchfs snapshot list | head`: a reader that goes away ends the command
        // quietly, as it ends cat or ls (println! panicked on the broken pipe). The
        // daemon keeps ignoring SIGPIPE: a write to a pipe closed under it (its
        // stderr piped into a pager, say) must not take the mount down.
        // SAFETY: signal with a valid signal number and disposition.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    // restore writes the user's own files, under the user's own limit; each one it
    // stops short of is reported (EFBIG) and the rest are still restored.
    lift_file_size_limit(!matches!(cli.cmd, Cmd::Restore { .. }));
    match cli.cmd {
        Cmd::Mkfs {
            size,
            force,
            node_size,
            preallocate,
            root_owner,
            log_size,
            image,
        } => {
            init_logging(None)?;
            let log_size = log_size.as_deref().map(parse_size).transpose()?;
            let root_owner = match root_owner {
                Some(o) => parse_owner(&o)?,
                // SAFETY: geteuid and getegid have no preconditions.
                None => unsafe { (libc::geteuid(), libc::getegid()) },
            };
            let opts = MkfsOptions {
                node_size,
                root_owner,
                log_size,
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
            if options.iter().any(|o| o == "remount") {
                init_logging(None)?;
                cli::remount::remount(&image, &mountpoint, &options)?;
            } else if !foreground {
                cli::options::parse_mount_options(&options)?;
                // Paths go to the daemon as they are (not as text: a name need not
                // be UTF-8).
                let mut args: Vec<std::ffi::OsString> = Vec::new();
                if !options.is_empty() {
                    args.push("-o".into());
                    args.push(options.join(",").into());
                }
                if let Some(l) = &log {
                    args.push("--log".into());
                    args.push(std::path::absolute(l)?.into_os_string());
                }
                args.push(std::path::absolute(&image)?.into_os_string());
                args.push(std::path::absolute(&mountpoint)?.into_os_string());
                cli::daemon::mount_background(&args)?;
            } else {
                init_logging(log.as_deref())?;
                if let (Some(l), Some(_)) = (&log, ready_fd) {
                    stderr_to(l);
                }
                cli::daemon::mount(&options, &image, &mountpoint, ready_fd)?;
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
                    print_report(&rep.problems, &rep.summary());
                    if rep.pending_log_batches > 0 {
                        eprintln!(
                            "note: the log holds {} fsynced batches a mount would replay; \
                             this check saw the last commit without them (mount and \
                             unmount once, then check again, to check them too)",
                            rep.pending_log_batches
                        );
                    }
                    // Damaged nodes and blocks (a tree walk's problems start "tree N:").
                    if rep.problems.iter().any(|p| {
                        p.starts_with("tree ")
                            || p.contains("checksum mismatch")
                            || p.contains("read error")
                    }) {
                        eprintln!(
                            "note: `birchfs restore {} DIR` copies every file that can still be \
                             read into DIR, also when the image does not mount",
                            image.display()
                        );
                    }
                    exit_for(&rep.problems)
                }
            });
        }
        Cmd::Restore {
            snapshot,
            image,
            dest,
        } => {
            init_logging(None)?;
            // Said before the image is opened, and as the destination's fault.
            if let Some(why) = birchfs::restore::unfit_dest(&dest) {
                eprintln!(
                    "birchfs restore: {} {why}: restore writes into a new or empty directory",
                    dest.display()
                );
                return Ok(ExitCode::from(2));
            }
            let dev = match open_when_free(&image, false) {
                Ok(d) => d,
                Err(e) => {
                    eprintln!("birchfs restore: cannot open {}: {e}", image.display());
                    return Ok(ExitCode::from(2));
                }
            };
            let opts = birchfs::restore::RestoreOptions {
                snapshot: snapshot.map(String::into_bytes),
            };
            return Ok(match birchfs::restore::restore(&dev, &dest, &opts) {
                Err(e) => {
                    eprintln!("birchfs restore: {}: {e}", image.display());
                    ExitCode::from(2)
                }
                Ok(rep) => {
                    print_report(&rep.problems, &rep.summary());
                    if rep.unverified_blocks > 0 {
                        eprintln!(
                            "note: {} data blocks had no checksum left to check them against",
                            rep.unverified_blocks
                        );
                    }
                    if rep.attrs_refused > 0 {
                        eprintln!(
                            "note: {} owners, permissions, times or extended attributes were \
                             refused by {}",
                            rep.attrs_refused,
                            dest.display()
                        );
                    }
                    if rep.log_batches > 0 {
                        eprintln!(
                            "note: {} fsynced log batches after the last commit were replayed \
                             on top of it, as a mount would",
                            rep.log_batches
                        );
                    }
                    exit_for(&rep.problems)
                }
            });
        }
        Cmd::Umount {
            timeout,
            mountpoint,
        } => cli::umount::umount(&mountpoint, timeout.map(Duration::from_secs))?,
        Cmd::Sync { mountpoint } => {
            init_logging(None)?;
            return sync_cmd(&mountpoint);
        }
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
            cli::umount::refuse_dead_mount(&mountpoint)?;
            cli::umount::image_mounted_at(&mountpoint)?;
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
        Cmd::Trim { target } => {
            init_logging(None)?;
            let n = trim_cmd(&target)?;
            println!(
                "{}: {n} bytes ({:.1} MiB) trimmed",
                target.display(),
                n as f64 / (1 << 20) as f64
            );
        }
        Cmd::Resize { target, size } => {
            init_logging(None)?;
            let (from, to) = resize_cmd(&target, &size)?;
            println!(
                "{}: grown from {} to {} bytes ({} MiB more)",
                target.display(),
                from,
                to,
                (to - from) >> 20
            );
            let image = match target.is_dir() {
                true => cli::umount::image_mounted_at(&target).ok(),
                false => Some(target),
            };
            if let Some(w) = image.and_then(|i| cli::daemon::host_space_warning(&i)) {
                eprintln!("birchfs resize: warning: {w}");
            }
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
        Err(e) => {
            eprintln!("birchfs: {e:#}");
            ExitCode::from(1)
        }
    }
}
