//! Buffers aligned for direct I/O: whole 4 KiB blocks on 4 KiB boundaries.

/// One block, aligned as direct I/O wants it.
#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct Block([u8; 4096]);

/// A growable byte buffer of whole 4 KiB blocks, 4 KiB aligned, so a device can
/// hand it to O_DIRECT without a bounce copy.
#[derive(Clone, Default)]
pub struct AlignedBuf {
    blocks: Vec<Block>,
}

impl AlignedBuf {
    /// `len` zero bytes; `len` must be a multiple of 4096.
    pub fn zeroed(len: usize) -> AlignedBuf {
        assert_eq!(len % 4096, 0, "aligned buffers hold whole blocks");
        AlignedBuf {
            blocks: vec![Block([0; 4096]); len / 4096],
        }
    }

    /// Appends whole blocks.
    pub fn extend_from_slice(&mut self, bytes: &[u8]) {
        assert_eq!(bytes.len() % 4096, 0, "aligned buffers hold whole blocks");
        for b in bytes.chunks_exact(4096) {
            self.blocks
                .push(Block(b.try_into().expect("a whole block")));
        }
    }

    /// An empty buffer with room for `len` bytes without growing.
    pub fn with_capacity(len: usize) -> AlignedBuf {
        AlignedBuf {
            blocks: Vec::with_capacity(len.div_ceil(4096)),
        }
    }

    /// Empties it, keeping its memory.
    pub fn clear(&mut self) {
        self.blocks.clear();
    }

    /// Bytes it holds without growing.
    pub fn capacity(&self) -> usize {
        self.blocks.capacity() * 4096
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.blocks.len() * 4096
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: Block is repr(C) of 4096 bytes with no padding; the Vec owns them.
        unsafe { std::slice::from_raw_parts(self.blocks.as_ptr().cast(), self.len()) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.blocks.as_mut_ptr().cast(), self.len()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_whole_blocks() {
        let mut b = AlignedBuf::zeroed(8192);
        assert_eq!(b.as_ptr() as usize % 4096, 0);
        b[5000] = 7;
        b.extend_from_slice(&[1u8; 4096]);
        assert_eq!(b.len(), 12288);
        assert_eq!(b.as_ptr() as usize % 4096, 0);
        assert_eq!((b[5000], b[8192], b[12287]), (7, 1, 1));
    }
}
