//! A fixed-capacity ring buffer: once full, each new item overwrites the oldest, and the
//! count of overwritten items is kept so a summary can say how much history was lost.

pub struct Ring<T> {
    items: Vec<T>,
    capacity: usize,
    /// Where the next item goes once the ring is full.
    next: usize,
    dropped: u64,
}

impl<T> Ring<T> {
    /// A ring of `capacity` items (at least 1).
    pub fn new(capacity: usize) -> Ring<T> {
        let capacity = capacity.max(1);
        Ring {
            // Grown on demand: a large capacity costs nothing until it is used.
            items: Vec::new(),
            capacity,
            next: 0,
            dropped: 0,
        }
    }

    pub fn push(&mut self, item: T) {
        if self.items.len() < self.capacity {
            self.items.push(item);
            return;
        }
        self.items[self.next] = item;
        self.next = (self.next + 1) % self.capacity;
        self.dropped += 1;
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Items overwritten since the ring was created.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// The retained items, oldest first.
    pub fn into_vec(mut self) -> Vec<T> {
        self.items.rotate_left(self.next);
        self.items
    }
}

#[cfg(test)]
mod tests {
    use super::Ring;

    #[test]
    fn keeps_the_newest_and_counts_the_overwritten() {
        let mut r = Ring::new(3);
        (0..7).for_each(|i| r.push(i));
        assert_eq!(r.dropped(), 4);
        assert_eq!(r.into_vec(), vec![4, 5, 6]);
    }

    #[test]
    fn below_capacity_nothing_is_dropped() {
        let mut r = Ring::new(4);
        (0..4).for_each(|i| r.push(i));
        assert_eq!(r.dropped(), 0);
        assert_eq!(r.into_vec(), vec![0, 1, 2, 3]);
    }
}
