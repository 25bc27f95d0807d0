//! The library's error type and its one mapping to errno.

use std::io;

/// Every failure the engine reports; `errno()` is the one place it maps to POSIX.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No such file, directory or attribute owner.
    #[error("not found")]
    NotFound,
    /// The name already exists.
    #[error("already exists")]
    Exists,
    /// A path component or target is not a directory.
    #[error("not a directory")]
    NotDir,
    /// The operation needs a non-directory.
    #[error("is a directory")]
    IsDir,
    /// The directory still has entries.
    #[error("directory not empty")]
    NotEmpty,
    /// A name longer than 255 bytes.
    #[error("name too long")]
    NameTooLong,
    /// No space left for data or metadata.
    #[error("no space left on device")]
    NoSpace,
    /// The argument is not valid for this operation.
    #[error("invalid argument: {0}")]
    Invalid(&'static str),
    /// The operation is not permitted (e.g. hard link to a directory).
    #[error("operation not permitted")]
    Perm,
    /// A file has as many links as it can hold (in all, or in one directory).
    #[error("too many links")]
    TooManyLinks,
    /// The names in a directory that share one hash fill their item (btrfs answers
    /// the same).
    #[error("directory entries sharing a name hash fill their item")]
    Overflow,
    /// Access denied by permission bits.
    #[error("permission denied")]
    Access,
    /// The extended attribute does not exist.
    #[error("no such attribute")]
    NoData,
    /// The caller's buffer is too small.
    #[error("result too large for buffer")]
    Range,
    /// A value or file size beyond what the format stores.
    #[error("too large")]
    TooBig,
    /// No data (or hole) at or after an offset: it is at or past the end of the file.
    #[error("offset at or past the end of the file")]
    PastEnd,
    /// An xattr value longer than Linux allows (64 KiB).
    #[error("xattr value too large")]
    ArgTooBig,
    /// The filesystem is mounted read-only.
    #[error("read-only filesystem")]
    ReadOnly,
    /// The operation is not supported.
    #[error("operation not supported")]
    NotSupported,
    /// On-disk data failed verification; it is never returned to the caller.
    #[error("corrupt {what} at {addr:#x}: {why}")]
    Corrupt {
        /// What was being read (node, data block, superblock).
        what: &'static str,
        /// Device byte address.
        addr: u64,
        /// Which check failed.
        why: String,
    },
    /// The image is not birchfs, or of a format this build refuses.
    #[error("{0}")]
    BadImage(String),
    /// A mount option out of range.
    #[error("bad option: {0}")]
    BadOption(String),
    /// The device returned an I/O error.
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
}

impl Error {
    /// The error of a filesystem that stopped changes after a failed write, flush or
    /// tree change.
    pub(crate) fn stopped() -> Error {
        Error::Io(std::io::Error::from_raw_os_error(libc::EIO))
    }

    /// The errno a system call reports for this error.
    pub fn errno(&self) -> i32 {
        match self {
            Error::NotFound => libc::ENOENT,
            Error::Exists => libc::EEXIST,
            Error::NotDir => libc::ENOTDIR,
            Error::IsDir => libc::EISDIR,
            Error::NotEmpty => libc::ENOTEMPTY,
            Error::NameTooLong => libc::ENAMETOOLONG,
            Error::NoSpace => libc::ENOSPC,
            Error::Invalid(_) | Error::BadOption(_) => libc::EINVAL,
            Error::Perm => libc::EPERM,
            Error::TooManyLinks => libc::EMLINK,
            Error::Overflow => libc::EOVERFLOW,
            Error::Access => libc::EACCES,
            Error::NoData => libc::ENODATA,
            Error::Range => libc::ERANGE,
            Error::TooBig => libc::EFBIG,
            Error::ArgTooBig => libc::E2BIG,
            Error::PastEnd => libc::ENXIO,
            Error::ReadOnly => libc::EROFS,
            Error::NotSupported => libc::EOPNOTSUPP,
            Error::Corrupt { .. } | Error::BadImage(_) => libc::EIO,
            Error::Io(e) => match e.raw_os_error() {
                // The host's own state reaches the caller as such: out of room
                // (see `birchfs sync`), out of quota, read-only, out of memory.
                Some(c @ (libc::ENOSPC | libc::EDQUOT | libc::EROFS | libc::ENOMEM)) => c,
                // A block device set read-only refuses writes with EPERM, which a
                // caller would take for a permission of its own.
                Some(libc::EPERM) => libc::EROFS,
                // Anything else the device answers (a device gone: ENXIO, ENODEV;
                // EBADF, EINVAL, EFBIG of the image on its host) is an I/O error here.
                _ => libc::EIO,
            },
        }
    }

    pub(crate) fn corrupt(what: &'static str, addr: u64, why: impl Into<String>) -> Error {
        Error::Corrupt {
            what,
            addr,
            why: why.into(),
        }
    }
}

/// Result with the library's error.
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;

    /// What the device answers reaches the caller as the host's state where it says
    /// something about it, EROFS for a device set read-only (EPERM), else EIO.
    #[test]
    fn device_errors_become_errnos_a_caller_can_act_on() {
        let io = |c| Error::Io(io::Error::from_raw_os_error(c)).errno();
        for (device, caller) in [
            (libc::ENOSPC, libc::ENOSPC),
            (libc::EDQUOT, libc::EDQUOT),
            (libc::EROFS, libc::EROFS),
            (libc::EPERM, libc::EROFS),
            (libc::EIO, libc::EIO),
            (libc::ENXIO, libc::EIO),
            (libc::EACCES, libc::EIO),
            (libc::EBADF, libc::EIO),
        ] {
            assert_eq!(io(device), caller, "device errno {device}");
        }
        assert_eq!(Error::Io(io::Error::other("no errno")).errno(), libc::EIO);
    }
}
