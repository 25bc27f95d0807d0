//! An ordered map from u64 keys to records kept in one arena: a skip list whose nodes
//! are the records themselves (the link lives inside the record, as the kernel's
//! rb_node does), so the record type decides where its key and its link sit.
//!
//! Searching returns the predecessor at every level; with it, a run of successors is
//! unlinked one by one in O(1) each (their predecessors are already known), so
//! removing k neighbours after one search costs O(log n + k), and an insert after a
//! search needs no second one. Levels grow with probability 1/4. The delayed-ref
//! heads of a transaction live in one (seed 4, `refs.rs`).

/// Most levels of a tower: enough for 4^12 (16 million) records.
pub const MAX_LEVEL: usize = 12;

/// No node.
const NIL: u32 = u32::MAX;
/// The head, before every node.
const HEAD: u32 = u32::MAX - 1;

/// A record's tower of forward links.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct Links {
    next: [u32; MAX_LEVEL],
    height: u8,
}

impl Default for Links {
    fn default() -> Links {
        Links {
            next: [NIL; MAX_LEVEL],
            height: 0,
        }
    }
}

/// A record that can live in a [`SkipList`]: it holds its key and its links.
pub trait Linked {
    /// The record's key.
    fn key(&self) -> u64;
    /// The record's links.
    fn links(&self) -> &Links;
    /// The record's links, to change.
    fn links_mut(&mut self) -> &mut Links;
}

/// Predecessors of a key at every level, from [`SkipList::search`].
#[derive(Debug, Clone, Copy)]
pub struct Preds([u32; MAX_LEVEL]);

/// The ordered map; a node is named by its arena index, stable while it lives.
#[derive(Debug, Clone)]
pub struct SkipList<N> {
    /// The records; a freed slot keeps its old record until it is reused.
    nodes: Vec<N>,
    free: Vec<u32>,
    head: Links,
    level: usize,
    len: usize,
    rng: u64,
}

impl<N: Linked + Clone> Default for SkipList<N> {
    fn default() -> Self {
        SkipList {
            nodes: Vec::new(),
            free: Vec::new(),
            head: Links {
                next: [NIL; MAX_LEVEL],
                height: MAX_LEVEL as u8,
            },
            level: 1,
            len: 0,
            rng: 0x2545_f491_4f6c_dd1d,
        }
    }
}

impl<N: Linked + Clone> SkipList<N> {
    /// Number of records.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn links(&self, at: u32) -> &Links {
        if at == HEAD {
            &self.head
        } else {
            self.node(at).links()
        }
    }

    fn links_mut(&mut self, at: u32) -> &mut Links {
        if at == HEAD {
            &mut self.head
        } else {
            self.node_mut(at).links_mut()
        }
    }

    /// The record at `at`, which must be live.
    pub fn node(&self, at: u32) -> &N {
        &self.nodes[at as usize]
    }

    /// The record at `at`, to change (not its key's order).
    pub fn node_mut(&mut self, at: u32) -> &mut N {
        &mut self.nodes[at as usize]
    }

    /// The node after `at` (`None` at the end).
    pub fn next(&self, at: u32) -> Option<u32> {
        let n = self.node(at).links().next[0];
        (n != NIL).then_some(n)
    }

    /// The first node.
    pub fn first(&self) -> Option<u32> {
        let n = self.head.next[0];
        (n != NIL).then_some(n)
    }

    /// The predecessors of `key`: at each level, the last node whose key is below it.
    pub fn search(&self, key: u64) -> Preds {
        let mut preds = [HEAD; MAX_LEVEL];
        let mut at = HEAD;
        for l in (0..self.level).rev() {
            loop {
                let n = self.links(at).next[l];
                if n == NIL || self.node(n).key() >= key {
                    break;
                }
                at = n;
            }
            preds[l] = at;
        }
        Preds(preds)
    }

    /// The first node after `preds` (the first with a key at or above the searched one).
    pub fn after(&self, preds: &Preds) -> Option<u32> {
        let n = self.links(preds.0[0]).next[0];
        (n != NIL).then_some(n)
    }

    /// The node with exactly `key`.
    pub fn find(&self, key: u64) -> Option<u32> {
        let p = self.search(key);
        self.after(&p).filter(|&n| self.node(n).key() == key)
    }

    fn random_height(&mut self) -> usize {
        // xorshift64*: deterministic per map, good enough for tower heights.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        let r = self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d);
        (1 + (r.trailing_zeros() / 2) as usize).min(MAX_LEVEL)
    }

    /// Inserts `node` right after `preds` (from a search for its key, with nothing
    /// changed since but earlier inserts and removals through the same `preds`);
    /// `preds` then names the new node as the predecessor of what follows.
    pub fn insert_at(&mut self, preds: &mut Preds, mut node: N) -> u32 {
        let h = self.random_height();
        if h > self.level {
            for p in &mut preds.0[self.level..h] {
                *p = HEAD;
            }
            self.level = h;
        }
        let mut links = Links {
            next: [NIL; MAX_LEVEL],
            height: h as u8,
        };
        for l in 0..h {
            links.next[l] = self.links(preds.0[l]).next[l];
        }
        *node.links_mut() = links;
        let at = match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        for l in 0..h {
            self.links_mut(preds.0[l]).next[l] = at;
            preds.0[l] = at;
        }
        self.len += 1;
        at
    }

    /// Inserts `node` in key order (a search, then [`SkipList::insert_at`]).
    pub fn insert(&mut self, node: N) -> u32 {
        let mut p = self.search(node.key());
        self.insert_at(&mut p, node)
    }

    /// Removes the node right after `preds` and returns it; `preds` stay valid for
    /// the node that follows, so a run of successors goes in O(1) each.
    pub fn remove_after(&mut self, preds: &Preds) -> Option<N> {
        let at = self.links(preds.0[0]).next[0];
        if at == NIL {
            return None;
        }
        let links = *self.node(at).links();
        for l in 0..links.height as usize {
            self.links_mut(preds.0[l]).next[l] = links.next[l];
        }
        self.len -= 1;
        self.free.push(at);
        Some(self.nodes[at as usize].clone())
    }

    /// Removes every record, keeping the arena's memory.
    pub fn clear(&mut self) {
        self.nodes.clear();
        self.free.clear();
        self.head.next = [NIL; MAX_LEVEL];
        self.level = 1;
        self.len = 0;
    }

    /// Every node in key order.
    pub fn iter(&self) -> impl Iterator<Item = &N> + '_ {
        std::iter::successors(self.first(), move |&n| self.next(n)).map(move |n| self.node(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[derive(Debug, Clone)]
    struct T {
        key: u64,
        links: Links,
        val: u32,
    }

    impl Linked for T {
        fn key(&self) -> u64 {
            self.key
        }
        fn links(&self) -> &Links {
            &self.links
        }
        fn links_mut(&mut self) -> &mut Links {
            &mut self.links
        }
    }

    fn t(key: u64, val: u32) -> T {
        T {
            key,
            links: Links::default(),
            val,
        }
    }

    #[test]
    fn matches_a_btreemap_through_inserts_finds_and_run_removals() {
        let mut s: SkipList<T> = SkipList::default();
        let mut m: BTreeMap<u64, u32> = BTreeMap::new();
        let mut x = 12345u64;
        for round in 0..20_000u32 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let key = (x >> 33) % 5000;
            if round % 7 == 0 {
                // Remove the run of keys in [key, key + 40).
                let p = s.search(key);
                while let Some(n) = s.after(&p) {
                    if s.node(n).key() >= key + 40 {
                        break;
                    }
                    s.remove_after(&p).unwrap();
                }
                m.retain(|k, _| !(key..key + 40).contains(k));
            } else if let Some(v) = m.get(&key) {
                assert_eq!(s.node(s.find(key).unwrap()).val, *v);
            } else {
                s.insert(t(key, round));
                m.insert(key, round);
            }
            if round % 997 == 0 {
                let got: Vec<(u64, u32)> = s.iter().map(|n| (n.key, n.val)).collect();
                let want: Vec<(u64, u32)> = m.iter().map(|(k, v)| (*k, *v)).collect();
                assert_eq!(got, want);
            }
        }
        assert_eq!(s.len(), m.len());
    }

    #[test]
    fn freed_slots_are_reused() {
        let mut s: SkipList<T> = SkipList::default();
        for k in 0..100 {
            s.insert(t(k, 0));
        }
        let p = s.search(10);
        for _ in 0..50 {
            s.remove_after(&p).unwrap();
        }
        let cap = s.nodes.len();
        for k in 10..60 {
            s.insert(t(k, 1));
        }
        assert_eq!(s.nodes.len(), cap, "the arena did not grow");
        assert_eq!(
            s.iter().map(|n| n.key).collect::<Vec<_>>(),
            (0..100).collect::<Vec<_>>()
        );
    }
}
