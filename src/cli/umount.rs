//! `birchfs umount`: unmounts and returns once the daemon has written its last commit.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

/// The image of the birchfs mounted at `mountpoint` (the top mount there, if stacked),
/// from the text of /proc/self/mountinfo.
pub(crate) fn mounted_image(mountinfo: &str, mountpoint: &Path) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStringExt;
    // Mountinfo writes space, tab, newline and backslash in paths as \ooo (octal).
    let unescape = |f: &str| -> std::ffi::OsString {
        let b = f.as_bytes();
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
    };
    // The last mount on the path is the one on top, which an unmount would remove.
    let top: Vec<&str> = mountinfo
        .lines()
        .rev()
        .map(|line| line.split(' ').collect::<Vec<&str>>())
        .find(|f| {
            f.get(4)
                .is_some_and(|m| Path::new(&unescape(m)) == mountpoint)
        })?;
    let sep = top.iter().position(|f| *f == "-")?;
    let (fstype, source) = (top.get(sep + 1)?, top.get(sep + 2)?);
    let is_fuse = *fstype == "fuse" || *fstype == "fuseblk" || fstype.starts_with("fuse.");
    let image = unescape(source.strip_prefix("birchfs:")?);
    is_fuse.then(|| PathBuf::from(image))
}

/// Unmounts the birchfs at `mountpoint` and waits until its daemon has written its last
/// commit and let go of the image, as `umount` of a kernel filesystem returns only
/// once everything is on disk.
pub(crate) fn umount(mountpoint: &Path) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let info = std::fs::read_to_string("/proc/self/mountinfo")
        .context("cannot read /proc/self/mountinfo")?;
    let abs = std::path::absolute(mountpoint)?;
    let image = mounted_image(&info, &abs)
        .or_else(|| mounted_image(&info, &std::fs::canonicalize(&abs).ok()?))
        .ok_or_else(|| anyhow!("{} is not a birchfs mountpoint", mountpoint.display()))?;
    // Opened before the unmount: the daemon holds the image's lock until it is done.
    // Without it there is nothing to wait on, so nothing is unmounted either.
    if !image.is_absolute() {
        bail!(
            "{} was mounted by an older birchfs that gave the image as {}: use umount",
            mountpoint.display(),
            image.display()
        );
    }
    let file = std::fs::File::open(&image).with_context(|| {
        format!(
            "cannot open {} to wait for its daemon; nothing unmounted (umount does not wait)",
            image.display()
        )
    })?;
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
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            bail!("cannot wait for the daemon of {}: {e}", image.display());
        }
        if !told && start.elapsed() > Duration::from_secs(1) {
            eprintln!(
                "birchfs umount: waiting for the daemon of {} to write its last commit",
                image.display()
            );
            told = true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The image comes from the last birchfs mount on that path, with mountinfo's
    /// octal escapes undone; other filesystems and other paths give nothing.
    #[test]
    fn mounted_image_reads_the_mount_table() {
        let info = "\
22 1 8:1 / / rw - ext4 /dev/sda1 rw
44 22 0:39 / /mnt/a\\040b rw,relatime - fuse birchfs:/img/first\\040one rw,user_id=0
45 44 0:40 / /mnt/a\\040b rw - fuse.birchfs birchfs:/img/second rw
46 22 0:41 / /mnt/c rw - fuse sshfs:/x rw
47 22 0:42 / /mnt/d rw shared:5 - fuseblk birchfs:/dev/loop0 rw
";
        let img = |m: &str| mounted_image(info, Path::new(m));
        assert_eq!(img("/mnt/a b"), Some(PathBuf::from("/img/second")));
        assert_eq!(img("/mnt/d"), Some(PathBuf::from("/dev/loop0")));
        assert_eq!(img("/mnt/c"), None, "not birchfs");
        assert_eq!(img("/"), None, "not fuse");
        assert_eq!(img("/mnt"), None, "nothing mounted there");
        let first = info.replace(" fuse.birchfs birchfs:/img/second", " tmpfs none");
        assert_eq!(
            mounted_image(&first, Path::new("/mnt/a b")),
            None,
            "the top mount is not birchfs"
        );
    }
}
