//! `birchfs umount`: unmounts and returns once the daemon has written its last commit.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

/// A path field of mountinfo, which writes space, tab, newline and backslash as
/// `\ooo` (octal).
fn unescape(b: &[u8]) -> std::ffi::OsString {
    use std::os::unix::ffi::OsStringExt;
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let code = b
            .get(i + 1..i + 4)
            .filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .map(|d| d.iter().fold(0u32, |v, c| v * 8 + u32::from(c - b'0')));
        match code {
            Some(c) if c <= 0xff => {
                out.push(c as u8);
                i += 4;
            }
            _ => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    std::ffi::OsString::from_vec(out)
}

/// One mount of /proc/self/mountinfo.
struct Mounted {
    /// The filesystem's device number ("major:minor"), shared by its bind mounts.
    dev: Vec<u8>,
    /// Where it is mounted.
    point: PathBuf,
    /// The image, when it is a birchfs: a FUSE mount whose source is "birchfs:...", or
    /// of type fuse.birchfs (a block device's mount shows the device's path).
    image: Option<PathBuf>,
}

/// The mounts in mountinfo's bytes (paths there need not be UTF-8, anyone's), in its
/// order: of two on one point, the later is on top.
fn mounts(mountinfo: &[u8]) -> impl DoubleEndedIterator<Item = Mounted> + '_ {
    use std::os::unix::ffi::OsStringExt;
    mountinfo.split(|&c| c == b'\n').filter_map(|line| {
        let f: Vec<&[u8]> = line.split(|&c| c == b' ').collect();
        let dev = f.get(2)?.to_vec();
        let point = PathBuf::from(unescape(f.get(4)?));
        let sep = f.iter().position(|x| *x == b"-")?;
        let (fstype, source) = (*f.get(sep + 1)?, *f.get(sep + 2)?);
        let fuse = fstype == b"fuse" || fstype == b"fuseblk" || fstype.starts_with(b"fuse.");
        let named = match source.strip_prefix(b"birchfs:") {
            Some(s) if fuse => Some(s),
            _ if fstype == b"fuse.birchfs" => Some(source),
            _ => None,
        };
        let image = named
            .map(|s| std::ffi::OsString::from_vec(from_fsname(&unescape(s).into_vec())).into());
        Some(Mounted { dev, point, image })
    })
}

/// The mount point of the birchfs that `path` lies inside, below its root: the
/// deepest mount that holds `path` is a birchfs and is not `path` itself.
pub(crate) fn birchfs_mount_holding(mountinfo: &[u8], path: &Path) -> Option<PathBuf> {
    let deepest = mounts(mountinfo)
        .filter(|m| path.starts_with(&m.point))
        .reduce(|a, b| {
            if b.point.as_os_str().len() >= a.point.as_os_str().len() {
                b
            } else {
                a
            }
        })?;
    (deepest.image.is_some() && deepest.point != path).then_some(deepest.point)
}

/// The device number ("major:minor") and image (for a birchfs) of the top mount at
/// `mountpoint`: each FUSE mount has a device number of its own.
pub(crate) fn top_mount(mountinfo: &[u8], mountpoint: &Path) -> Option<(Vec<u8>, Option<PathBuf>)> {
    // The last mount on the path is the one on top, which an unmount would remove.
    mounts(mountinfo)
        .rev()
        .find(|m| m.point == mountpoint)
        .map(|m| (m.dev, m.image))
}

/// Whether `a` and `b` name the same file: the same path once links are resolved, or,
/// when one cannot be resolved (gone), the same path as given.
pub(crate) fn same_path(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

/// What a path stores its data in: a file (device and inode numbers), or a block
/// device (its number); a loop device stands for the file under it.
#[derive(Debug, PartialEq, Eq)]
enum Storage {
    File(u64, u64),
    Device(u64),
}

/// The [`Storage`] of a file or device with metadata `meta`, itself.
fn storage_in(meta: &std::fs::Metadata) -> Storage {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    if meta.file_type().is_block_device() {
        Storage::Device(meta.rdev())
    } else {
        Storage::File(meta.dev(), meta.ino())
    }
}

/// The [`Storage`] behind `path`, and the file under it when it is a loop device;
/// `None` when it cannot be looked at (gone, say).
fn storage_and_backing(path: &Path) -> Option<(Storage, Option<PathBuf>)> {
    let meta = std::fs::metadata(path).ok()?;
    let backing = birchfs::dev::loop_backing_file(&meta);
    let under = backing.as_ref().and_then(|f| std::fs::metadata(f).ok());
    Some((storage_in(under.as_ref().unwrap_or(&meta)), backing))
}

/// Whether `a` and `b` are the same file or device (by any name), a loop device and
/// the file under it not counting as the same.
pub(crate) fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => storage_in(&x) == storage_in(&y),
        _ => false,
    }
}

/// The [`Storage`] behind `path`; `None` when it cannot be looked at (gone, say).
fn storage_of(path: &Path) -> Option<Storage> {
    Some(storage_and_backing(path)?.0)
}

/// Where a live birchfs that stores its data where `image` does is mounted: `image`
/// itself (by any name), a loop device over it, or the file under it when it is a loop
/// device (the latest such mount; one whose daemon is gone does not count). Mounts of
/// a device or of a file of the same name (as given or resolved) are looked at first,
/// so that a hung mount elsewhere cannot stall a lookup that finds one there; the
/// other birchfs mounts of files only when none of those is it (a mount made through
/// a link of another name). `None` also when the mount table cannot be read.
pub(crate) fn mount_storing_in(image: &Path) -> Option<PathBuf> {
    let (want, backing) = storage_and_backing(image)?;
    // The name given, the name it resolves to (through symbolic links), and the
    // backing file's.
    let resolved = std::fs::canonicalize(image).ok();
    let names: Vec<_> = [Some(image), resolved.as_deref(), backing.as_deref()]
        .into_iter()
        .flatten()
        .filter_map(Path::file_name)
        .collect();
    let info = read_mountinfo().ok()?;
    let (likely, others): (Vec<Mounted>, Vec<Mounted>) =
        mounts(&info).filter(|m| m.image.is_some()).partition(|m| {
            m.image.as_deref().is_some_and(|i| {
                i.starts_with("/dev/") || i.file_name().is_some_and(|n| names.contains(&n))
            })
        });
    let point = likely
        .into_iter()
        .rev()
        .chain(others.into_iter().rev())
        .filter(|m| m.image.as_deref().and_then(storage_of).as_ref() == Some(&want))
        .find(|m| refuse_dead_mount(&m.point).is_ok())
        .map(|m| m.point);
    point
}

/// The image of the birchfs mounted at `mountpoint` (the top mount there, if stacked).
pub(crate) fn mounted_image(mountinfo: &[u8], mountpoint: &Path) -> Option<PathBuf> {
    top_mount(mountinfo, mountpoint)?.1
}

/// The other places the filesystem mounted (on top) at `mountpoint` is mounted too:
/// bind mounts of it, or it bound elsewhere. While one stays, its daemon serves on.
fn other_mounts_of(mountinfo: &[u8], mountpoint: &Path) -> Vec<PathBuf> {
    let all: Vec<Mounted> = mounts(mountinfo).collect();
    let Some(top) = all.iter().rposition(|m| m.point == mountpoint) else {
        return Vec::new();
    };
    all.iter()
        .enumerate()
        .filter(|&(i, m)| i != top && m.dev == all[top].dev)
        .map(|(_, m)| m.point.clone())
        .collect()
}

/// The mount's source name for `image`: "birchfs:" and its path for an image file,
/// the path alone for a block device (as kernel filesystems and other FUSE block
/// filesystems show theirs, and as tools such as xfstests compare it with the
/// device they mounted). It is text: a byte of the path that is not UTF-8 is written
/// `\xHH`, and a backslash `\\`.
pub(crate) fn fsname_of(image: &Path, block_device: bool) -> String {
    use std::fmt::Write;
    use std::os::unix::ffi::OsStrExt;
    let mut out = String::from(if block_device { "" } else { "birchfs:" });
    for chunk in image.as_os_str().as_bytes().utf8_chunks() {
        out.push_str(&chunk.valid().replace('\\', "\\\\"));
        for b in chunk.invalid() {
            let _ = write!(out, "\\x{b:02x}");
        }
    }
    out
}

/// The path bytes [`fsname_of`] wrote (after "birchfs:", if it wrote that).
pub(crate) fn from_fsname(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = b.get(i + 2..i + 4).and_then(|h| {
            u8::from_str_radix(std::str::from_utf8(h).ok()?, 16)
                .ok()
                .filter(|_| h.iter().all(u8::is_ascii_hexdigit))
        });
        match (b[i], b.get(i + 1), hex) {
            (b'\\', Some(b'\\'), _) => {
                out.push(b'\\');
                i += 2;
            }
            (b'\\', Some(b'x'), Some(v)) => {
                out.push(v);
                i += 4;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    out
}

/// Fails, saying how to clear it, when `path` is a mount whose daemon is gone (its
/// connection answers ENOTCONN, or ECONNABORTED once the kernel aborted it).
pub(crate) fn refuse_dead_mount(path: &Path) -> Result<()> {
    match std::fs::metadata(path) {
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTCONN | libc::ECONNABORTED)) => {
            bail!(
                "{} is still mounted by a daemon that is gone ({e}); `birchfs umount {}` \
                 clears it",
                path.display(),
                path.display()
            )
        }
        _ => Ok(()),
    }
}

/// The image of the birchfs mounted at `mountpoint` (as given, or with its links
/// resolved); an error when no birchfs is mounted there.
pub(crate) fn image_mounted_at(mountpoint: &Path) -> Result<PathBuf> {
    let info = read_mountinfo()?;
    Ok(birchfs_mounted_at(&info, mountpoint)?.1)
}

/// /proc/self/mountinfo, as bytes.
fn read_mountinfo() -> Result<Vec<u8>> {
    std::fs::read("/proc/self/mountinfo").context("cannot read /proc/self/mountinfo")
}

/// The mount point as `info` names it (the path as given, made absolute, or else with
/// its links resolved) and the image of the birchfs mounted there.
fn birchfs_mounted_at(info: &[u8], mountpoint: &Path) -> Result<(PathBuf, PathBuf)> {
    let abs = std::path::absolute(mountpoint)?;
    let real = std::fs::canonicalize(&abs).ok();
    for point in std::iter::once(abs).chain(real.clone()) {
        if let Some(image) = mounted_image(info, &point) {
            return Ok((point, image));
        }
    }
    Err(match real.and_then(|r| birchfs_mount_holding(info, &r)) {
        Some(mp) => anyhow!(
            "{} is inside the birchfs mounted at {}: give that mount point",
            mountpoint.display(),
            mp.display()
        ),
        None => anyhow!("{} is not a birchfs mountpoint", mountpoint.display()),
    })
}

/// The pid holding an exclusive flock on the file with device `major:minor` and inode
/// `ino`, from the text of /proc/locks.
pub(crate) fn flock_holder(locks: &str, major: u32, minor: u32, ino: u64) -> Option<u32> {
    locks.lines().find_map(|line| {
        // "1: FLOCK  ADVISORY  WRITE 11356 fe:00:780114 0 EOF"; a waiter's line has
        // "->" after the number.
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.get(1) != Some(&"FLOCK") || f.get(3) != Some(&"WRITE") {
            return None;
        }
        let pid = f.get(4)?.parse().ok()?;
        let mut id = f.get(5)?.split(':');
        let maj = u32::from_str_radix(id.next()?, 16).ok()?;
        let min = u32::from_str_radix(id.next()?, 16).ok()?;
        let i: u64 = id.next()?.parse().ok()?;
        (maj == major && min == minor && i == ino).then_some(pid)
    })
}

/// The process holding the lock of the image whose metadata is `md` (its daemon),
/// if /proc/locks names one.
pub(crate) fn lock_holder(md: &std::fs::Metadata) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    flock_holder(
        &locks,
        libc::major(md.dev()),
        libc::minor(md.dev()),
        md.ino(),
    )
}

/// The daemon that holds an image's lock, watched through a pidfd so that its exit
/// is seen even if another process takes the lock right after it.
struct Daemon {
    pid: u32,
    fd: std::os::fd::OwnedFd,
}

impl Daemon {
    /// The holder of `image`'s lock, if /proc/locks names one that can be watched.
    fn of(image: &std::fs::File) -> Option<Daemon> {
        use std::os::fd::FromRawFd;
        let pid = lock_holder(&image.metadata().ok()?)?;
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        if fd < 0 {
            return None;
        }
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) };
        Some(Daemon { pid, fd })
    }

    /// Whether the process is stopped (SIGSTOP, a debugger): it answers nothing until
    /// it runs again.
    fn stopped(&self) -> bool {
        std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).is_ok_and(|st| {
            st.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .is_some_and(|state| state == "T" || state == "t")
        })
    }

    /// Whether the process has exited (its pidfd polls readable).
    fn exited(&self) -> bool {
        use std::os::fd::AsRawFd;
        let mut p = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on one valid pollfd, without waiting.
        unsafe { libc::poll(&mut p, 1, 0) == 1 && p.revents & libc::POLLIN != 0 }
    }
}

/// The image mounted at `mountpoint`, opened to wait on its lock. An image inside its
/// own mount point is hidden under the mount (its path leads into the filesystem
/// itself): it is reopened through the daemon's own descriptor of it. Nothing here
/// looks inside the mount, whose daemon may be stopped (a stat would wait for it) or
/// gone.
fn open_image(image: &Path, mountpoint: &Path) -> Result<std::fs::File> {
    let hidden = image.starts_with(mountpoint)
        || std::fs::canonicalize(mountpoint).is_ok_and(|m| image.starts_with(m));
    if hidden {
        return reopen_from_daemon(image)
            .context("it lies under its own mount, and no process holds it open");
    }
    match std::fs::File::open(image) {
        Ok(f) => Ok(f),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Some(held) = held_deleted(image) {
                bail!(
                    "{} was deleted while mounted, and unmounting would lose it and all it \
                     holds; its daemon still has it open as {}. To keep it: `mount -o \
                     remount,ro {}` (which commits), then `cp {} {}`, then unmount. `umount \
                     {}` lets it go",
                    image.display(),
                    held.display(),
                    mountpoint.display(),
                    held.display(),
                    image.display(),
                    mountpoint.display()
                );
            }
            reopen_from_daemon(image).ok_or(e).map_err(Into::into)
        }
        Err(e) => reopen_from_daemon(image).ok_or(e).map_err(Into::into),
    }
}

/// `/proc/PID/fd/N` of a process that holds `image` open after it was deleted (its
/// daemon).
fn held_deleted(image: &Path) -> Option<PathBuf> {
    let mut gone = image.as_os_str().to_owned();
    gone.push(" (deleted)");
    open_fds()
        .find(|(_, target)| *target == gone)
        .map(|(fd, _)| fd)
}

/// Every open descriptor of every process this one may look at: its /proc path and
/// what it names.
fn open_fds() -> impl Iterator<Item = (PathBuf, PathBuf)> {
    let procs = std::fs::read_dir("/proc").into_iter().flatten().flatten();
    procs
        .filter(|p| {
            p.file_name()
                .as_encoded_bytes()
                .iter()
                .all(u8::is_ascii_digit)
        })
        .filter_map(|p| std::fs::read_dir(p.path().join("fd")).ok())
        .flat_map(|fds| fds.flatten())
        .filter_map(|fd| Some((fd.path(), std::fs::read_link(fd.path()).ok()?)))
}

/// `image` reopened through `/proc/PID/fd` of a process that has it open by that path
/// (its daemon).
fn reopen_from_daemon(image: &Path) -> Option<std::fs::File> {
    open_fds()
        .filter(|(_, target)| target == image)
        .find_map(|(fd, _)| std::fs::File::open(fd).ok())
}

/// Longest `birchfs umount` waits for the sync it runs first; past it, it unmounts and
/// the daemon goes on with its last commit (a large cache takes a while to write).
const SYNC_WAIT: Duration = Duration::from_secs(30);

/// Runs `birchfs sync` on `mountpoint` for at most `wait`. Fails, so that nothing is
/// unmounted, only when the commit found no room on the image's host: then nothing is
/// lost yet, and freeing space there lets a second `birchfs umount` write everything.
/// Another failure (a device that went read-only, writes the kernel could not hand
/// over) is returned, and the unmount goes on and then reports it.
fn sync_before_unmount(mountpoint: &Path, wait: Duration) -> Result<Option<String>> {
    use std::io::Read;
    let exe = std::env::current_exe().context("cannot find own executable")?;
    let mut child = Command::new(exe)
        .arg("sync")
        .arg(mountpoint)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("cannot run birchfs sync")?;
    let deadline = Instant::now() + wait;
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break Some(st);
        }
        if Instant::now() >= deadline {
            // A sync that takes this long is a large cache being written: the daemon
            // finishes it after the unmount. (A FUSE request's caller can be killed.)
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    let err = err.trim().trim_start_matches("birchfs: ");
    match status.and_then(|s| s.code()) {
        None | Some(0) => Ok(None),
        Some(c) if c == i32::from(crate::SYNC_NO_ROOM) => bail!(
            "{err}\nnothing was unmounted: free space on the image's host, then run \
             `birchfs umount` again (`umount {}` unmounts at once, and loses what birchfs \
             could not write)",
            mountpoint.display()
        ),
        Some(_) => Ok(Some(err.to_string())),
    }
}

/// Unmounts the birchfs at `mountpoint` and waits until its daemon has written its last
/// commit and let go of the image, as `umount` of a kernel filesystem returns only
/// once everything is on disk; after `timeout`, if given, it stops waiting with an
/// error (the daemon goes on).
pub(crate) fn umount(mountpoint: &Path, timeout: Option<Duration>) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let abs = std::path::absolute(mountpoint)?;
    let info = read_mountinfo()?;
    let (point, image) = birchfs_mounted_at(&info, mountpoint)?;
    let others = other_mounts_of(&info, &point);
    // Opened before the unmount: the daemon holds the image's lock until it is done.
    // Without it there is nothing to wait on, so nothing is unmounted either.
    if !image.is_absolute() {
        bail!(
            "{} was mounted by an older birchfs that gave the image as {}: use umount",
            mountpoint.display(),
            image.display()
        );
    }
    let file = open_image(&image, &abs).with_context(|| {
        format!(
            "cannot open {} to wait for its daemon; nothing unmounted (umount does not wait)",
            image.display()
        )
    })?;
    let daemon = Daemon::of(&file);
    // Commit first, while nothing is lost if that fails for want of room on the host: the
    // daemon would otherwise fail the same commit after the unmount, with no one to
    // tell. A stopped daemon would keep the sync waiting; it is unmounted as before.
    let failed = if daemon.as_ref().is_some_and(|d| !d.stopped()) {
        let wait = timeout.map_or(SYNC_WAIT, |t| t.min(SYNC_WAIT));
        sync_before_unmount(&abs, wait)?
    } else {
        None
    };
    // Unmounted and the daemon done: what the sync before found wrong, if anything.
    let done = || match &failed {
        None => Ok(()),
        Some(err) => Err(anyhow::anyhow!(
            "{} is unmounted, but: {err}",
            abs.display()
        )),
    };
    let target = abs.as_os_str().as_bytes();
    let c = std::ffi::CString::new(target).context("mountpoint with a NUL byte")?;
    // SAFETY: umount2 on a valid C string.
    if unsafe { libc::umount2(c.as_ptr(), 0) } != 0 {
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            // Not root: the setuid helper unmounts what its user mounted.
            Some(libc::EPERM) => {
                let st = Command::new("fusermount3")
                    .arg("-u")
                    .arg(&abs)
                    .status()
                    .context("cannot run fusermount3")?;
                if !st.success() {
                    bail!("fusermount3 -u {} failed", abs.display());
                }
            }
            Some(libc::EBUSY) => bail!(
                "cannot unmount {}: busy (a file is open there, or a process's working directory is inside)",
                abs.display()
            ),
            _ => bail!("cannot unmount {}: {e}", abs.display()),
        }
    }
    if !others.is_empty() {
        let list: Vec<String> = others.iter().map(|p| p.display().to_string()).collect();
        eprintln!(
            "birchfs umount: {} is unmounted; the filesystem stays mounted at {}, and its \
             daemon with it",
            abs.display(),
            list.join(", ")
        );
        return done();
    }
    let who = match &daemon {
        Some(d) => format!("the daemon of {} (pid {})", image.display(), d.pid),
        None => format!("the daemon of {}", image.display()),
    };
    let start = Instant::now();
    let mut told = false;
    loop {
        // SAFETY: flock on a valid fd owned by `file`; a shared lock waits for the
        // daemon's exclusive one.
        if unsafe {
            libc::flock(
                std::os::fd::AsRawFd::as_raw_fd(&file),
                libc::LOCK_SH | libc::LOCK_NB,
            )
        } == 0
        {
            return done();
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            bail!("cannot wait for {who}: {e}");
        }
        // Gone, and someone else holds the lock now (a new mount of the image).
        if daemon.as_ref().is_some_and(Daemon::exited) {
            return done();
        }
        if let Some(t) = timeout.filter(|&t| start.elapsed() >= t) {
            bail!(
                "{} is unmounted, but {who} has not finished its last commit after {} s; \
                 it goes on by itself, and the image can be mounted or checked once it ends",
                abs.display(),
                t.as_secs_f64()
            );
        }
        if !told && start.elapsed() > Duration::from_secs(1) {
            eprintln!("birchfs umount: waiting for {who} to write its last commit");
            told = true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file and a hard link to it store in the same place, another file or a block
    /// device does not, and a path that is gone stores nowhere.
    #[test]
    fn storage_follows_the_file_not_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b, c) = (
            dir.path().join("a"),
            dir.path().join("b"),
            dir.path().join("c"),
        );
        std::fs::write(&a, b"x").unwrap();
        std::fs::hard_link(&a, &b).unwrap();
        std::fs::write(&c, b"y").unwrap();
        let sa = storage_of(&a).unwrap();
        assert_eq!(storage_of(&b), Some(sa));
        assert_ne!(storage_of(&c), storage_of(&a));
        assert_eq!(storage_of(&dir.path().join("gone")), None);
        if let Some(Storage::Device(_)) = storage_of(Path::new("/dev/null")) {
            panic!("/dev/null is a character device, not a block device");
        }
    }

    /// The image comes from the last birchfs mount on that path, with mountinfo's
    /// octal escapes undone; other filesystems and other paths give nothing.
    #[test]
    fn other_mounts_of_a_filesystem_are_its_binds() {
        let info = "\
22 1 8:1 / / rw - ext4 /dev/sda1 rw
44 22 0:39 / /mnt/a rw - fuse.birchfs birchfs:/img rw
45 22 0:39 /sub /mnt/b rw - fuse.birchfs birchfs:/img rw
46 22 0:40 / /mnt/c rw - fuse.birchfs birchfs:/other rw
47 44 0:41 / /mnt/a rw - tmpfs none rw
";
        let others = |m: &str| other_mounts_of(info.as_bytes(), Path::new(m));
        assert_eq!(others("/mnt/b"), vec![PathBuf::from("/mnt/a")]);
        assert_eq!(others("/mnt/c"), Vec::<PathBuf>::new());
        assert_eq!(
            others("/mnt/x"),
            Vec::<PathBuf>::new(),
            "nothing mounted there"
        );
        // The top mount at /mnt/a is the tmpfs, which has no other mount.
        assert_eq!(others("/mnt/a"), Vec::<PathBuf>::new());
        let under = info.replace("47 44 0:41 / /mnt/a rw - tmpfs none rw\n", "");
        assert_eq!(
            other_mounts_of(under.as_bytes(), Path::new("/mnt/a")),
            vec![PathBuf::from("/mnt/b")]
        );
    }

    #[test]
    fn mounted_image_reads_the_mount_table() {
        let info = "\
22 1 8:1 / / rw - ext4 /dev/sda1 rw
44 22 0:39 / /mnt/a\\040b rw,relatime - fuse birchfs:/img/first\\040one rw,user_id=0
45 44 0:40 / /mnt/a\\040b rw - fuse.birchfs birchfs:/img/second rw
46 22 0:41 / /mnt/c rw - fuse sshfs:/x rw
47 22 0:42 / /mnt/d rw shared:5 - fuseblk birchfs:/dev/loop0 rw
50 22 0:45 / /mnt/e rw - fuse.birchfs /dev/mapper/flakey\\040test rw
51 22 0:46 / /mnt/f rw - fuse.other /dev/sdc rw
";
        let img = |m: &str| mounted_image(info.as_bytes(), Path::new(m));
        assert_eq!(img("/mnt/a b"), Some(PathBuf::from("/img/second")));
        assert_eq!(img("/mnt/d"), Some(PathBuf::from("/dev/loop0")));
        assert_eq!(img("/mnt/c"), None, "not birchfs");
        assert_eq!(
            img("/mnt/e"),
            Some(PathBuf::from("/dev/mapper/flakey test")),
            "a block device's mount, known by its type"
        );
        assert_eq!(img("/mnt/f"), None, "another FUSE filesystem's device");
        assert_eq!(img("/"), None, "not fuse");
        assert_eq!(img("/mnt"), None, "nothing mounted there");
        let first = info.replace(" fuse.birchfs birchfs:/img/second", " tmpfs none");
        assert_eq!(
            mounted_image(first.as_bytes(), Path::new("/mnt/a b")),
            None,
            "the top mount is not birchfs"
        );
        // Paths that are not UTF-8, in another mount's line and in birchfs's own.
        let mut raw = info.as_bytes().to_vec();
        raw.extend_from_slice(b"48 22 0:43 / /mnt/\xfe rw - ext4 /dev/sdb rw\n");
        raw.extend_from_slice(b"49 22 0:44 / /mnt/\xff rw - fuse birchfs:/img/\\134xff rw\n");
        use std::os::unix::ffi::OsStrExt;
        let got = mounted_image(&raw, Path::new(std::ffi::OsStr::from_bytes(b"/mnt/\xff")));
        assert_eq!(
            got.as_deref().map(|p| p.as_os_str().as_bytes()),
            Some(&b"/img/\xff"[..])
        );
        assert_eq!(
            mounted_image(&raw, Path::new("/mnt/d")),
            Some(PathBuf::from("/dev/loop0"))
        );
        // The source name round-trips any path.
        for path in [
            &b"/i/plain"[..],
            b"/i/a\\b",
            b"/i/\xff\xfe",
            b"/i/\\x41",
            b"/i/\xc3\xa9",
        ] {
            let p = Path::new(std::ffi::OsStr::from_bytes(path));
            let name = fsname_of(p, false);
            assert_eq!(
                from_fsname(name.strip_prefix("birchfs:").unwrap().as_bytes()),
                path
            );
            assert_eq!(from_fsname(fsname_of(p, true).as_bytes()), path);
        }
        assert_eq!(
            fsname_of(Path::new("/i/\u{e9}"), false),
            "birchfs:/i/\u{e9}"
        );
        assert_eq!(fsname_of(Path::new("/dev/loop3"), true), "/dev/loop3");
    }

    /// The birchfs a path lies inside is the deepest mount holding it, when that is a
    /// birchfs and not the path itself.
    #[test]
    fn the_birchfs_holding_a_path_is_the_deepest_mount() {
        let info = b"\
22 1 8:1 / / rw - ext4 /dev/sda1 rw
44 22 0:39 / /mnt/b rw - fuse birchfs:/img rw
45 44 0:40 / /mnt/b/inner rw - tmpfs none rw
46 22 0:41 / /mnt/b2 rw - fuse birchfs:/img2 rw
";
        let held = |p: &str| birchfs_mount_holding(info, Path::new(p));
        assert_eq!(held("/mnt/b/sub/x"), Some(PathBuf::from("/mnt/b")));
        assert_eq!(held("/mnt/b2/y"), Some(PathBuf::from("/mnt/b2")));
        assert_eq!(held("/mnt/b"), None, "the mount point itself");
        assert_eq!(held("/mnt/b/inner/z"), None, "a tmpfs mounted inside");
        assert_eq!(held("/mnt/bx"), None, "not a path below /mnt/b");
        assert_eq!(held("/etc"), None);
    }

    /// The holder is the process with the exclusive flock on that very file: not a
    /// waiter, not a shared or POSIX lock, not another file or device.
    #[test]
    fn flock_holder_reads_the_lock_table() {
        let locks = "\
1: POSIX  ADVISORY  WRITE 100 fe:00:42 0 EOF
2: FLOCK  ADVISORY  READ  200 fe:00:42 0 EOF
3: FLOCK  ADVISORY  WRITE 300 fe:01:42 0 EOF
4: FLOCK  ADVISORY  WRITE 400 fe:00:43 0 EOF
4: -> FLOCK  ADVISORY  WRITE 500 fe:00:42 0 EOF
5: FLOCK  ADVISORY  WRITE 11356 fe:00:42 0 EOF
";
        assert_eq!(flock_holder(locks, 0xfe, 0, 42), Some(11356));
        assert_eq!(flock_holder(locks, 0xfe, 1, 42), Some(300));
        assert_eq!(flock_holder(locks, 0xfe, 0, 44), None);
        assert_eq!(flock_holder("", 0xfe, 0, 42), None);
    }
}
