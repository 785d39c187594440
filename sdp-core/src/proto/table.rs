//! The connection table: stable ids for connections (or whatever a driver keeps per
//! connection), with a generation so a stale id never reaches a newer connection that reused
//! the slot.

/// A connection's id in a [`Table`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(u64);

impl ConnId {
    fn new(index: usize, gen: u32) -> ConnId {
        ConnId(((gen as u64) << 32) | index as u64)
    }
    fn index(self) -> usize {
        (self.0 & 0xffff_ffff) as usize
    }
    fn gen(self) -> u32 {
        (self.0 >> 32) as u32
    }
    /// The raw value (for logs and wr_id tagging).
    pub fn as_u64(self) -> u64 {
        self.0
    }
    /// The id whose [`ConnId::as_u64`] is `raw` (an epoll token).
    pub fn from_u64(raw: u64) -> ConnId {
        ConnId(raw)
    }
}

struct Slot<T> {
    gen: u32,
    value: T,
}

/// Slab of entries keyed by [`ConnId`].
pub struct Table<T> {
    slots: slab::Slab<Slot<T>>,
    next_gen: u32,
}

impl<T> Default for Table<T> {
    fn default() -> Self {
        Table {
            slots: slab::Slab::new(),
            next_gen: 1,
        }
    }
}

impl<T> Table<T> {
    pub fn insert(&mut self, value: T) -> ConnId {
        let gen = self.next_gen;
        self.next_gen = self.next_gen.wrapping_add(1).max(1);
        let index = self.slots.insert(Slot { gen, value });
        ConnId::new(index, gen)
    }
    pub fn get(&self, id: ConnId) -> Option<&T> {
        self.slots
            .get(id.index())
            .filter(|s| s.gen == id.gen())
            .map(|s| &s.value)
    }
    pub fn get_mut(&mut self, id: ConnId) -> Option<&mut T> {
        self.slots
            .get_mut(id.index())
            .filter(|s| s.gen == id.gen())
            .map(|s| &mut s.value)
    }
    pub fn remove(&mut self, id: ConnId) -> Option<T> {
        if self.get(id).is_some() {
            Some(self.slots.remove(id.index()).value)
        } else {
            None
        }
    }
    pub fn len(&self) -> usize {
        self.slots.len()
    }
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
    pub fn ids(&self) -> Vec<ConnId> {
        self.slots
            .iter()
            .map(|(i, s)| ConnId::new(i, s.gen))
            .collect()
    }
    /// The ids, without allocating (as `ids` into a vector the caller keeps).
    pub fn ids_into(&self, out: &mut Vec<ConnId>) {
        out.clear();
        out.extend(self.slots.iter().map(|(i, s)| ConnId::new(i, s.gen)));
    }
    pub fn iter(&self) -> impl Iterator<Item = (ConnId, &T)> {
        self.slots
            .iter()
            .map(|(i, s)| (ConnId::new(i, s.gen), &s.value))
    }
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (ConnId, &mut T)> {
        self.slots
            .iter_mut()
            .map(|(i, s)| (ConnId::new(i, s.gen), &mut s.value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_ids_do_not_reach_reused_slots() {
        let mut t = Table::default();
        let a = t.insert("a");
        assert_eq!(t.remove(a), Some("a"));
        let b = t.insert("b");
        assert_eq!(a.index(), b.index(), "slot reused");
        assert_eq!(t.get(a), None);
        assert_eq!(t.get(b), Some(&"b"));
        assert_eq!(t.remove(a), None);
        assert_eq!(t.len(), 1);
    }
}
