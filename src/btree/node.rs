//! A decoded tree node held in memory.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::format::{leaf_item_size, Key, NodeBody, NodeHeader, NODE_HEADER_SIZE, PTR_SIZE};

/// A node: header plus items (leaf) or child pointers (internal).
#[derive(Debug)]
pub(crate) struct Node {
    pub(crate) hdr: NodeHeader,
    body: NodeBody,
    /// A leaf's encoded size once counted, else [`UNCOUNTED`]. Inserts and deletes
    /// check the size of every leaf they change, and counting costs a pass over all
    /// its items: [`Node::put_item`] and [`Node::remove_item`] keep the count, and any
    /// other change to a leaf (through [`Node::body_mut`]) drops it. Internal nodes
    /// never use it.
    leaf_size: AtomicUsize,
}

/// [`Node::leaf_size`] when not counted.
const UNCOUNTED: usize = usize::MAX;

impl Clone for Node {
    fn clone(&self) -> Node {
        Node {
            hdr: self.hdr,
            body: self.body.clone(),
            leaf_size: AtomicUsize::new(self.leaf_size.load(Ordering::Relaxed)),
        }
    }
}

impl Node {
    /// A node of `hdr` holding `body`.
    pub(crate) fn new(hdr: NodeHeader, body: NodeBody) -> Node {
        Node {
            hdr,
            body,
            leaf_size: AtomicUsize::new(UNCOUNTED),
        }
    }

    /// The node's items or child pointers.
    pub(crate) fn body(&self) -> &NodeBody {
        &self.body
    }

    /// The node's items or child pointers, to change.
    pub(crate) fn body_mut(&mut self) -> &mut NodeBody {
        *self.leaf_size.get_mut() = UNCOUNTED;
        &mut self.body
    }

    /// Bytes this node takes when encoded (a leaf's kept count, else counted and kept).
    pub(crate) fn encoded_size(&self) -> usize {
        match &self.body {
            NodeBody::Leaf(v) => {
                let counted = self.leaf_size.load(Ordering::Relaxed);
                if counted != UNCOUNTED && !cfg!(test) {
                    return counted;
                }
                let n = NODE_HEADER_SIZE
                    + v.iter()
                        .map(|(_, d)| leaf_item_size(d.len()))
                        .sum::<usize>();
                // Unit tests count every time and check the kept count against it.
                assert!(
                    counted == UNCOUNTED || counted == n,
                    "leaf size kept {counted}, is {n}"
                );
                self.leaf_size.store(n, Ordering::Relaxed);
                n
            }
            NodeBody::Internal(v) => NODE_HEADER_SIZE + v.len() * PTR_SIZE,
        }
    }

    /// Puts `val` under `key` in this leaf, replacing the value it had.
    pub(crate) fn put_item(&mut self, key: Key, val: Vec<u8>) {
        let before = self.encoded_size();
        let NodeBody::Leaf(items) = &mut self.body else {
            panic!("put_item() on an internal node");
        };
        let after = match items.binary_search_by(|(k, _)| k.cmp(&key)) {
            Ok(i) => {
                let old = std::mem::replace(&mut items[i].1, val);
                before - old.len() + items[i].1.len()
            }
            Err(i) => {
                let after = before + leaf_item_size(val.len());
                items.insert(i, (key, val));
                after
            }
        };
        *self.leaf_size.get_mut() = after;
    }

    /// Removes `key` from this leaf; returns whether it was there.
    pub(crate) fn remove_item(&mut self, key: &Key) -> bool {
        let before = self.encoded_size();
        let NodeBody::Leaf(items) = &mut self.body else {
            panic!("remove_item() on an internal node");
        };
        let Ok(i) = items.binary_search_by(|(k, _)| k.cmp(key)) else {
            return false;
        };
        let (_, val) = items.remove(i);
        *self.leaf_size.get_mut() = before - leaf_item_size(val.len());
        true
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The encoded size of `n`, counted item by item as `encode_node` lays an item
    /// out (key, 4-byte length, value), apart from `leaf_item_size`.
    fn recount(n: &Node) -> usize {
        let NodeBody::Leaf(items) = n.body() else {
            unreachable!("a leaf");
        };
        NODE_HEADER_SIZE
            + items
                .iter()
                .map(|(_, d)| Key::SIZE + 4 + d.len())
                .sum::<usize>()
    }

    /// The size a leaf keeps follows every put (new key or replaced value) and
    /// remove (present or not), and a change through `body_mut` drops it.
    #[test]
    fn a_leaf_keeps_its_size_through_puts_replaces_and_removes() {
        let hdr = NodeHeader {
            addr: 4096,
            generation: 1,
            owner: 5,
            level: 0,
        };
        let mut n = Node::new(hdr, NodeBody::Leaf(Vec::new()));
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let (mut puts, mut replaced, mut removed) = (0, 0, 0);
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = Key::new(x % 97, 1, (x >> 8) % 3);
            if (x >> 20) % 3 < 2 {
                let NodeBody::Leaf(items) = n.body() else {
                    unreachable!()
                };
                if items.iter().any(|(k, _)| *k == key) {
                    replaced += 1;
                }
                n.put_item(key, vec![7; ((x >> 24) % 300) as usize]);
                puts += 1;
            } else if n.remove_item(&key) {
                removed += 1;
            }
            assert_eq!(n.leaf_size.load(Ordering::Relaxed), recount(&n));
        }
        // Every kind of step happened many times.
        assert!(puts > 10_000 && replaced > 1_000 && removed > 1_000);
        assert_eq!(n.encoded_size(), recount(&n));
        n.body_mut();
        assert_eq!(n.leaf_size.load(Ordering::Relaxed), UNCOUNTED);
        assert_eq!(n.encoded_size(), recount(&n));
    }
}
