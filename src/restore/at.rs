//! Paths longer than PATH_MAX under the destination: a tree deeper than about 2,000
//! levels names its lower entries with more than 4,096 bytes, which no system call
//! takes whole. Such a path is made and changed with the `*at` calls from its parent
//! directory, opened a piece of under PATH_MAX at a time, starting from the parent
//! opened last (restore goes depth first, so that is usually one step away).

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// The longest path (with its NUL) a system call takes.
const PATH_MAX: usize = libc::PATH_MAX as usize;

/// A path as the `*at` calls take it: a directory (`AT_FDCWD` for a path short
/// enough to go whole) and the rest.
pub(super) struct At {
    dir: Option<OwnedFd>,
    /// The path itself, or its last component when `dir` is its parent.
    pub(super) name: CString,
}

impl At {
    /// The directory `name` is relative to.
    pub(super) fn fd(&self) -> RawFd {
        self.dir.as_ref().map_or(libc::AT_FDCWD, |d| d.as_raw_fd())
    }

    /// An O_PATH descriptor of the entry itself (not following a symlink), for the
    /// calls that have no `*at` form (xattrs, through `/proc/self/fd`).
    pub(super) fn open_path(&self) -> io::Result<OwnedFd> {
        open_at(
            self.fd(),
            &self.name,
            libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    }

    /// Whether `name` is the whole path (no directory descriptor).
    pub(super) fn is_whole(&self) -> bool {
        self.dir.is_none()
    }
}

/// Opens the directories on the way to long paths, keeping the last one.
#[derive(Default)]
pub(super) struct LongPaths {
    last: Option<(Vec<u8>, OwnedFd)>,
}

impl LongPaths {
    /// Where `p` is, for the `*at` calls.
    pub(super) fn at(&mut self, p: &Path) -> io::Result<At> {
        let bytes = p.as_os_str().as_bytes();
        if bytes.len() < PATH_MAX {
            return Ok(At {
                dir: None,
                name: CString::new(bytes)?,
            });
        }
        let (Some(parent), Some(name)) = (p.parent(), p.file_name()) else {
            return Err(io::Error::from_raw_os_error(libc::ENAMETOOLONG));
        };
        let dir = self.open_dir(parent.as_os_str().as_bytes())?;
        Ok(At {
            dir: Some(dir),
            name: CString::new(name.as_bytes())?,
        })
    }

    /// Opens directory `want` (O_PATH), from the one opened last: up to where the
    /// two paths part, then down.
    fn open_dir(&mut self, want: &[u8]) -> io::Result<OwnedFd> {
        let (start, path): (RawFd, Vec<&[u8]>) = match &self.last {
            Some((had, fd)) => {
                let split = parting(had, want);
                let up = components(&had[split..]).map(|_| &b".."[..]);
                (
                    fd.as_raw_fd(),
                    up.chain(components(&want[split..])).collect(),
                )
            }
            None => {
                let root = want.first() == Some(&b'/');
                let lead = root.then_some(&b"/"[..]);
                (
                    libc::AT_FDCWD,
                    lead.into_iter().chain(components(want)).collect(),
                )
            }
        };
        let fd = walk(start, &path)?;
        self.last = Some((want.to_vec(), fd.try_clone()?));
        Ok(fd)
    }
}

/// The non-empty components of a path (no `.`).
fn components(p: &[u8]) -> impl Iterator<Item = &[u8]> {
    p.split(|&b| b == b'/')
        .filter(|c| !c.is_empty() && *c != b".")
}

/// Where paths `a` and `b` part: the end of the components they share.
fn parting(a: &[u8], b: &[u8]) -> usize {
    let same = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let boundary = |p: &[u8], i: usize| i == p.len() || p[i] == b'/';
    if boundary(a, same) && boundary(b, same) {
        return same;
    }
    a[..same].iter().rposition(|&c| c == b'/').unwrap_or(0)
}

/// Opens the directory reached from `start` through `path`'s components, in pieces
/// of under PATH_MAX; `start` itself again when `path` is empty.
fn walk(start: RawFd, path: &[&[u8]]) -> io::Result<OwnedFd> {
    let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    let mut at: Option<OwnedFd> = None;
    let mut piece: Vec<u8> = Vec::with_capacity(PATH_MAX);
    let open = |at: &Option<OwnedFd>, piece: &[u8]| {
        let from = at.as_ref().map_or(start, |d| d.as_raw_fd());
        open_at(from, &CString::new(piece)?, flags)
    };
    for &c in path {
        if !piece.is_empty() && piece.len() + 1 + c.len() >= PATH_MAX {
            at = Some(open(&at, &piece)?);
            piece.clear();
        }
        if !piece.is_empty() && piece.last() != Some(&b'/') {
            piece.push(b'/');
        }
        piece.extend_from_slice(c);
    }
    if piece.is_empty() {
        piece.push(b'.');
    }
    open(&at, &piece)
}

/// openat(2) as an owned descriptor.
fn open_at(dir: RawFd, name: &CString, flags: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: a valid C string; the descriptor returned is ours.
    let fd = unsafe { libc::openat(dir, name.as_ptr(), flags, 0o600) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor just opened, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Makes a new file (O_EXCL) at `at` for writing.
pub(super) fn create_file(at: &At) -> io::Result<std::fs::File> {
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    open_at(at.fd(), &at.name, flags).map(std::fs::File::from)
}

/// Maps a libc return code to an io::Result.
pub(super) fn check(rc: libc::c_int) -> io::Result<()> {
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn paths_past_path_max_are_made_and_found_again() {
        let t = tempfile::tempdir().unwrap();
        let name = "n".repeat(200);
        let mut lp = LongPaths::default();
        let mut p = t.path().to_path_buf();
        for _ in 0..50 {
            p.push(&name);
            let at = lp.at(&p).unwrap();
            // SAFETY: a valid C string.
            check(unsafe { libc::mkdirat(at.fd(), at.name.as_ptr(), 0o755) }).unwrap();
        }
        assert!(p.as_os_str().len() > 2 * PATH_MAX);
        let f = p.join("leaf");
        let at = lp.at(&f).unwrap();
        assert!(!at.is_whole());
        create_file(&at).unwrap().write_all(b"deep").unwrap();
        // Back up to a shallower long path, then over to a fresh tracker.
        let mid = p.ancestors().nth(15).unwrap().join("leaf2");
        let at = lp.at(&mid).unwrap();
        create_file(&at).unwrap();
        let mut fresh = LongPaths::default();
        for q in [&f, &mid] {
            let at = fresh.at(q).unwrap();
            let fd = at.open_path().unwrap();
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: a valid descriptor, an empty path and a stat buffer.
            check(unsafe {
                libc::fstatat(fd.as_raw_fd(), c"".as_ptr(), &mut st, libc::AT_EMPTY_PATH)
            })
            .unwrap();
            assert_eq!(st.st_mode & libc::S_IFMT, libc::S_IFREG);
        }
        let at = fresh.at(&f).unwrap();
        let mut buf = [0u8; 8];
        let fd = open_at(at.fd(), &at.name, libc::O_RDONLY | libc::O_CLOEXEC).unwrap();
        let n = std::fs::File::from(fd).read(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"deep");
        assert_eq!(parting(b"/a/bc/d", b"/a/bc/e"), 5);
        assert_eq!(parting(b"/a/bc", b"/a/bd"), 2);
        assert_eq!(parting(b"/a/b", b"/a/b/c"), 4);
        assert_eq!(parting(b"/a/b/c", b"/a/b"), 4);
        assert_eq!(parting(b"x/y", b"x/y"), 3);
        // A short path goes whole.
        assert!(lp.at(&t.path().join("x")).unwrap().is_whole());
    }
}
