//! `mount -o remount,ro|rw MOUNTPOINT` (and `birchfs mount -o remount,… IMAGE
//! MOUNTPOINT`): the kernel's read-only state and generic flags of a birchfs mount
//! changed in place.

use std::path::Path;

use anyhow::{bail, Context, Result};

/// The remount that `options` (which hold `remount`) ask for, as mount(2) flags
/// (MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_NOATIME, MS_NODIRATIME,
/// MS_SYNCHRONOUS), and birchfs's own options among them (`cache_size=` and the
/// like), which stay as mounted. mount(8) passes the mount's options as the mount
/// table shows them: the kernel's FUSE ones and `relatime` are taken as they are; a
/// later flag overrides an earlier one.
fn parse(options: &[String]) -> Result<(libc::c_ulong, Vec<String>)> {
    let mut own = Vec::new();
    let mut flags = 0;
    let mut set = |flag: libc::c_ulong, on: bool| {
        if on {
            flags |= flag;
        } else {
            flags &= !flag;
        }
    };
    for opt in options {
        match opt.as_str() {
            "remount" | "defaults" | "relatime" | "default_permissions" | "allow_other" => {}
            "ro" => set(libc::MS_RDONLY, true),
            "rw" => set(libc::MS_RDONLY, false),
            "nosuid" => set(libc::MS_NOSUID, true),
            "suid" => set(libc::MS_NOSUID, false),
            "nodev" => set(libc::MS_NODEV, true),
            "dev" => set(libc::MS_NODEV, false),
            "noexec" => set(libc::MS_NOEXEC, true),
            "exec" => set(libc::MS_NOEXEC, false),
            "noatime" => set(libc::MS_NOATIME, true),
            "nodiratime" => set(libc::MS_NODIRATIME, true),
            "sync" => set(libc::MS_SYNCHRONOUS, true),
            "async" => set(libc::MS_SYNCHRONOUS, false),
            o if ["user_id=", "group_id=", "max_read=", "blksize="]
                .iter()
                .any(|p| o.starts_with(p)) => {}
            o => {
                // birchfs's own options keep what the mount has; an unknown or
                // malformed one is still an error.
                super::options::parse_mount_options(&[o.to_owned()])
                    .with_context(|| format!("remount: option '{o}'"))?;
                own.push(o.to_owned());
            }
        }
    }
    Ok((flags, own))
}

/// The `-o` options in a command line (`/proc/PID/cmdline`'s NUL-separated words):
/// each `-o LIST` and `-oLIST`, split at commas.
fn options_in_cmdline(cmdline: &[u8]) -> Vec<String> {
    let words: Vec<String> = cmdline
        .split(|&b| b == 0)
        .map(|w| String::from_utf8_lossy(w).into_owned())
        .collect();
    let mut out = Vec::new();
    let mut it = words.iter();
    while let Some(w) = it.next() {
        let list = match w.strip_prefix("-o") {
            Some("") => it.next().map(String::as_str),
            Some(rest) => Some(rest),
            None => None,
        };
        out.extend(
            list.into_iter()
                .flat_map(|l| l.split(','))
                .map(str::to_owned),
        );
    }
    out
}

/// birchfs's own options among `given` that the daemon serving `image` was not
/// started with: a remount leaves them as mounted, so they change nothing. `None`
/// when the daemon's command line cannot be read.
fn not_applied(image: &Path, given: &[String]) -> Option<Vec<String>> {
    let pid = super::umount::lock_holder(&std::fs::metadata(image).ok()?)?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let running = options_in_cmdline(&cmdline);
    Some(
        given
            .iter()
            .filter(|o| !running.iter().any(|r| same_option(o, r)))
            .cloned()
            .collect(),
    )
}

/// Whether two options say the same: equal, or the same key with values that are
/// the same size (`cache_size=256M` and `cache_size=268435456`).
fn same_option(a: &str, b: &str) -> bool {
    if a == b {
        return true;
    }
    match (a.split_once('='), b.split_once('=')) {
        (Some((ka, va)), Some((kb, vb))) if ka == kb => {
            matches!((crate::parse_size(va), crate::parse_size(vb)), (Ok(x), Ok(y)) if x == y)
        }
        _ => false,
    }
}

/// Remounts the birchfs at `mountpoint` (which must hold `image`) as `options` say.
/// Going read-only, the kernel writes its cached pages back first, and the daemon
/// then commits, so that the image is whole while the mount stays read-only.
pub(crate) fn remount(image: &Path, mountpoint: &Path, options: &[String]) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let (want, own) = parse(options)?;
    let ro = want & libc::MS_RDONLY != 0;
    let mounted = super::umount::image_mounted_at(mountpoint)?;
    if !super::umount::same_path(image, &mounted) {
        bail!(
            "remount: {} holds {}, not {}",
            mountpoint.display(),
            mounted.display(),
            image.display()
        );
    }
    if !ro {
        let raw = crate::read_stats(mountpoint, birchfs::fuse::STATS_XATTR)?;
        let stats: serde_json::Value = serde_json::from_str(&raw).context("bad stats")?;
        if stats["readonly"] == serde_json::Value::Bool(true) {
            bail!(
                "remount: {} was mounted with -o ro, and its daemon writes nothing; unmount \
                 it and mount it again to write",
                mountpoint.display()
            );
        }
    }
    let target = std::ffi::CString::new(mountpoint.as_os_str().as_bytes())?;
    let flags = libc::MS_REMOUNT | want;
    // SAFETY: a valid C string; no source, type or data, as a remount takes.
    let rc = unsafe {
        libc::mount(
            std::ptr::null(),
            target.as_ptr(),
            std::ptr::null(),
            flags,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        bail!(
            "cannot remount {}: {}",
            mountpoint.display(),
            std::io::Error::last_os_error()
        );
    }
    let ignored = if own.is_empty() {
        own
    } else {
        not_applied(image, &own).unwrap_or(own)
    };
    if !ignored.is_empty() {
        eprintln!(
            "birchfs: warning: {} not applied: a remount changes only the generic flags \
             (ro, rw, nosuid, nodev, noexec, noatime, sync), and {} keeps the options it \
             was mounted with until it is unmounted and mounted again",
            ignored.join(","),
            mountpoint.display()
        );
    }
    if ro {
        let done = crate::sync_cmd(mountpoint)
            .with_context(|| format!("{} is read-only now, but", mountpoint.display()))?;
        if done != std::process::ExitCode::SUCCESS {
            bail!(
                "{} is read-only now, but its last changes are not committed (see above); \
                 `birchfs sync` tries again",
                mountpoint.display()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(s: &str) -> Vec<String> {
        s.split(',').map(str::to_owned).collect()
    }

    #[test]
    fn what_mount_8_passes_on_a_remount_is_understood() {
        // What mount(8) passed for `mount -o remount,ro` of a birchfs mount.
        let r = parse(&opts(
            "ro,relatime,remount,user_id=0,group_id=0,default_permissions,allow_other,dev,suid",
        ))
        .unwrap()
        .0;
        assert_eq!(r, libc::MS_RDONLY);
        let r = parse(&opts("rw,nosuid,nodev,remount,cache_size=1G,noexec,exec"))
            .unwrap()
            .0;
        assert_eq!(r, libc::MS_NOSUID | libc::MS_NODEV);
        let r = parse(&opts("remount,noatime,sync,ro,rw")).unwrap().0;
        assert_eq!(r, libc::MS_NOATIME | libc::MS_SYNCHRONOUS);
    }

    #[test]
    fn birchfs_own_options_on_a_remount_are_told_apart_from_the_running_ones() {
        let (_, own) = parse(&opts("remount,ro,cache_size=1G,user_id=0,commit=5")).unwrap();
        assert_eq!(own, ["cache_size=1G", "commit=5"]);
        let cmdline = b"birchfs\0/img\0/mnt\0-o\0rw,commit=5,cache_size=256M\0-othreads=2\0";
        assert_eq!(
            options_in_cmdline(cmdline),
            ["rw", "commit=5", "cache_size=256M", "threads=2"]
        );
        assert!(options_in_cmdline(b"birchfs\0mount\0/img\0/mnt\0").is_empty());
        assert!(same_option("cache_size=256M", "cache_size=268435456"));
        assert!(same_option("commit=5", "commit=5"));
        assert!(!same_option("cache_size=256M", "cache_size=1G"));
        assert!(!same_option("cache_size=256M", "folio_size=256M"));
        assert!(!same_option("ro", "rw"));
    }

    #[test]
    fn a_bad_option_on_a_remount_is_an_error() {
        for bad in [
            "remount,bogus",
            "remount,cache_size=lots",
            "remount,strictatime",
        ] {
            assert!(parse(&opts(bad)).is_err(), "{bad}");
        }
    }
}
