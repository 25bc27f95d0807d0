//! `birchfs IMAGE MOUNTPOINT -o OPTIONS`: the call `mount -t fuse.birchfs` and
//! `/etc/fstab` make (through fuse3's `mount.fuse3`, or a `mount.fuse.birchfs` link),
//! turned into `birchfs mount`.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStringExt;
use std::path::Path;

use anyhow::{bail, Result};

/// Options meant for mount(8) or systemd, not for the filesystem; a helper drops them.
fn for_mount_only(opt: &str) -> bool {
    matches!(opt, "auto" | "noauto" | "nofail" | "_netdev")
        || opt.starts_with("x-")
        || opt.starts_with("comment=")
}

/// The arguments of a mount-helper call rewritten as `birchfs mount -o … IMAGE
/// MOUNTPOINT`; `None` when `args` is an ordinary command line. It is a helper call
/// when the program runs as `mount.*`, or when its first argument is no subcommand but
/// a path: one with a `/` (fstab's are absolute), or one that exists. A mistyped
/// subcommand is left to the usual error.
pub(crate) fn rewrite(args: Vec<OsString>, subcommands: &[&str]) -> Result<Option<Vec<OsString>>> {
    let Some((prog, rest)) = args.split_first() else {
        return Ok(None);
    };
    let as_helper = Path::new(prog)
        .file_name()
        .is_some_and(|n| n.as_encoded_bytes().starts_with(b"mount."));
    let first = rest.first().map(OsString::as_os_str);
    let looks_like_call = first.is_some_and(|f| {
        !f.as_encoded_bytes().starts_with(b"-")
            && !subcommands.iter().any(|s| OsStr::new(s) == f)
            && (f.as_encoded_bytes().contains(&b'/') || Path::new(f).exists())
    });
    if !as_helper && !looks_like_call {
        return Ok(None);
    }
    let mut paths: Vec<OsString> = Vec::new();
    let mut options: Vec<String> = Vec::new();
    let mut it = rest.iter();
    while let Some(a) = it.next() {
        let Some(s) = a.to_str().filter(|s| s.starts_with('-')) else {
            paths.push(a.clone());
            continue;
        };
        match s {
            "-o" => match it.next().and_then(|v| v.to_str()) {
                Some(v) => options.extend(v.split(',').map(str::to_owned)),
                None => bail!("mount helper: -o needs a list of options"),
            },
            _ if s.starts_with("-o") => options.extend(s[2..].split(',').map(str::to_owned)),
            // mount(8)'s own flags for a helper: the filesystem type (known), no mtab
            // (there is none to write), sloppy (unknown options stay errors), verbose.
            "-t" => {
                it.next();
            }
            "-n" | "-s" | "-v" => {}
            _ => bail!(
                "mount helper: unknown flag '{s}' (usage: birchfs IMAGE MOUNTPOINT [-o OPTIONS])"
            ),
        }
    }
    let [image, mountpoint] = <[OsString; 2]>::try_from(paths).map_err(|p| {
        anyhow::anyhow!(
            "mount helper: expected an image and a mountpoint, got {} paths (usage: birchfs \
             IMAGE MOUNTPOINT [-o OPTIONS])",
            p.len()
        )
    })?;
    // The source as the mount table shows it ("birchfs:" and the path), which is
    // what scripts such as xfstests read back and mount again.
    let image = match image.as_encoded_bytes().strip_prefix(b"birchfs:") {
        Some(path) => OsString::from_vec(super::umount::from_fsname(path)),
        None => image,
    };
    options.retain(|o| !o.is_empty() && !for_mount_only(o));
    let mut out: Vec<OsString> = vec![prog.clone(), "mount".into()];
    if !options.is_empty() {
        out.push("-o".into());
        out.push(options.join(",").into());
    }
    out.extend([image, mountpoint]);
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SUBS: &[&str] = &["mkfs", "mount", "check", "help"];

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn mount_fuse3_call_becomes_birchfs_mount() {
        // The exact call mount.fuse3 made for `mount -t fuse.birchfs -o noatime /tmp /mnt`.
        let got = rewrite(
            os(&["birchfs", "/tmp", "/mnt", "-o", "rw,noatime,dev,suid"]),
            SUBS,
        );
        assert_eq!(
            got.unwrap().unwrap(),
            os(&[
                "birchfs",
                "mount",
                "-o",
                "rw,noatime,dev,suid",
                "/tmp",
                "/mnt"
            ])
        );
    }

    #[test]
    fn mount8_flags_and_fstab_only_options_are_dropped() {
        let got = rewrite(
            os(&[
                "/sbin/mount.fuse.birchfs",
                "img",
                "/mnt",
                "-n",
                "-o",
                "ro,nofail,_netdev,x-systemd.automount,noauto,comment=x",
                "-t",
                "fuse.birchfs",
                "-ocache_size=64M",
            ]),
            SUBS,
        );
        assert_eq!(
            got.unwrap().unwrap(),
            os(&[
                "/sbin/mount.fuse.birchfs",
                "mount",
                "-o",
                "ro,cache_size=64M",
                "img",
                "/mnt"
            ])
        );
        // The source as the mount table names it.
        let got = rewrite(os(&["birchfs", "birchfs:/img/a\\\\b\\xff", "/mnt"]), SUBS);
        let mut want = os(&["birchfs", "mount", "", "/mnt"]);
        want[2] = OsString::from_vec(b"/img/a\\b\xff".to_vec());
        assert_eq!(got.unwrap().unwrap(), want);
        // No options at all: none passed on.
        let got = rewrite(os(&["mount.birchfs", "img", "/mnt"]), SUBS);
        assert_eq!(
            got.unwrap().unwrap(),
            os(&["mount.birchfs", "mount", "img", "/mnt"])
        );
    }

    #[test]
    fn ordinary_command_lines_are_left_alone() {
        for args in [
            &["birchfs", "mount", "/tmp", "/mnt"][..],
            &["birchfs", "--help"],
            &["birchfs"],
            // A mistyped subcommand that names no path: clap's own error.
            &["birchfs", "moutn", "/tmp", "/mnt"],
        ] {
            assert_eq!(rewrite(os(args), SUBS).unwrap(), None, "{args:?}");
        }
        // A path that does not exist yet is still a path, and its mount says why it fails.
        let got = rewrite(os(&["birchfs", "/no/such/img", "/mnt"]), SUBS);
        assert_eq!(
            got.unwrap().unwrap(),
            os(&["birchfs", "mount", "/no/such/img", "/mnt"])
        );
    }

    #[test]
    fn a_malformed_helper_call_is_an_error() {
        let e = rewrite(os(&["mount.birchfs", "img"]), SUBS).unwrap_err();
        assert!(e.to_string().contains("got 1 paths"), "{e}");
        let e = rewrite(os(&["birchfs", "/tmp", "/mnt", "-o"]), SUBS).unwrap_err();
        assert!(e.to_string().contains("-o needs"), "{e}");
        let e = rewrite(os(&["birchfs", "/tmp", "/mnt", "-f"]), SUBS).unwrap_err();
        assert!(e.to_string().contains("unknown flag '-f'"), "{e}");
    }
}
