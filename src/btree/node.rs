//! A decoded tree node held in memory.

use crate::format::{Key, NodeBody, NodeHeader, NODE_HEADER_SIZE};

/// A node: header plus items (leaf) or child pointers (internal).
#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub(crate) hdr: NodeHeader,
    pub(crate) body: NodeBody,
}

pub(crate) const LEAF_ITEM_OVERHEAD: usize = Key::SIZE + 4;
pub(crate) const PTR_SIZE: usize = Key::SIZE + 16;

impl Node {
    /// Bytes this node takes when encoded.
    pub(crate) fn encoded_size(&self) -> usize {
        NODE_HEADER_SIZE
            + match &self.body {
                NodeBody::Leaf(v) => v.iter().map(|(_, d)| LEAF_ITEM_OVERHEAD + d.len()).sum(),
                NodeBody::Internal(v) => v.len() * PTR_SIZE,
            }
    }

    pub(crate) fn first_key(&self) -> Option<Key> {
        match &self.body {
            NodeBody::Leaf(v) => v.first().map(|i| i.0),
            NodeBody::Internal(v) => v.first().map(|i| i.0),
        }
    }

    pub(crate) fn len(&self) -> usize {
        match &self.body {
            NodeBody::Leaf(v) => v.len(),
            NodeBody::Internal(v) => v.len(),
        }
    }

    pub(crate) fn ptrs(&self) -> &Vec<(Key, u64, u64)> {
        match &self.body {
            NodeBody::Internal(v) => v,
            NodeBody::Leaf(_) => panic!("ptrs() on a leaf"),
        }
    }

    pub(crate) fn ptrs_mut(&mut self) -> &mut Vec<(Key, u64, u64)> {
        match &mut self.body {
            NodeBody::Internal(v) => v,
            NodeBody::Leaf(_) => panic!("ptrs_mut() on a leaf"),
        }
    }

    pub(crate) fn items_mut(&mut self) -> &mut Vec<(Key, Vec<u8>)> {
        match &mut self.body {
            NodeBody::Leaf(v) => v,
            NodeBody::Internal(_) => panic!("items_mut() on an internal node"),
        }
    }

    /// Index of the child whose subtree may hold `key`.
    pub(crate) fn child_index(&self, key: &Key) -> usize {
        let p = self.ptrs();
        match p.binary_search_by(|(k, _, _)| k.cmp(key)) {
            Ok(i) => i,
            Err(0) => 0,
            Err(i) => i - 1,
        }
    }
}
