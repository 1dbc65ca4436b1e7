//! PyTorch-style allocator statistics: each `Stat` has current / peak / allocated (sum of
//! increases) / freed (sum of decreases); a `StatArray` has `all`, `small_pool`, `large_pool`.
//! Keys and meanings follow `torch.cuda.memory_stats()`.

use std::collections::BTreeMap;

/// Requests of at most this many bytes (after rounding) belong to the small pool.
pub const SMALL_SIZE: usize = 1 << 20;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    pub current: i64,
    pub peak: i64,
    pub allocated: i64,
    pub freed: i64,
}

impl Stat {
    pub fn increase(&mut self, amount: i64) {
        self.current += amount;
        self.peak = self.peak.max(self.current);
        self.allocated += amount;
    }
    pub fn decrease(&mut self, amount: i64) {
        self.current -= amount;
        self.freed += amount;
    }
    fn reset_peak(&mut self) {
        self.peak = self.current;
    }
    fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.freed = 0;
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pool {
    Small,
    Large,
}

impl Pool {
    pub fn for_size(rounded: usize) -> Pool {
        if rounded <= SMALL_SIZE {
            Pool::Small
        } else {
            Pool::Large
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatArray {
    pub all: Stat,
    pub small_pool: Stat,
    pub large_pool: Stat,
}

impl StatArray {
    pub fn increase(&mut self, pool: Pool, amount: i64) {
        self.all.increase(amount);
        self.pool_mut(pool).increase(amount);
    }
    pub fn decrease(&mut self, pool: Pool, amount: i64) {
        self.all.decrease(amount);
        self.pool_mut(pool).decrease(amount);
    }
    fn pool_mut(&mut self, pool: Pool) -> &mut Stat {
        match pool {
            Pool::Small => &mut self.small_pool,
            Pool::Large => &mut self.large_pool,
        }
    }
    fn each_mut(&mut self) -> [&mut Stat; 3] {
        [&mut self.all, &mut self.small_pool, &mut self.large_pool]
    }
}

/// Every statistic one device's allocator keeps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceStats {
    pub allocation: StatArray,
    pub segment: StatArray,
    pub active: StatArray,
    pub inactive_split: StatArray,
    pub allocated_bytes: StatArray,
    pub reserved_bytes: StatArray,
    pub active_bytes: StatArray,
    pub inactive_split_bytes: StatArray,
    pub requested_bytes: StatArray,
    pub num_alloc_retries: i64,
    pub num_ooms: i64,
    pub num_device_alloc: i64,
    pub num_device_free: i64,
}

impl DeviceStats {
    fn arrays_mut(&mut self) -> [&mut StatArray; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    fn arrays(&self) -> [(&'static str, &StatArray); 9] {
        [
            ("active", &self.active),
            ("active_bytes", &self.active_bytes),
            ("allocated_bytes", &self.allocated_bytes),
            ("allocation", &self.allocation),
            ("inactive_split", &self.inactive_split),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("segment", &self.segment),
        ]
    }

    /// `reset_peak_memory_stats`: every peak becomes its current value.
    pub fn reset_peak(&mut self) {
        for a in self.arrays_mut() {
            for s in a.each_mut() {
                s.reset_peak();
            }
        }
    }

    /// `reset_accumulated_memory_stats`: allocated/freed totals and counters go to zero.
    pub fn reset_accumulated(&mut self) {
        for a in self.arrays_mut() {
            for s in a.each_mut() {
                s.reset_accumulated();
            }
        }
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
    }

    /// The flat, key-sorted map `torch.cuda.memory_stats()` returns
    /// (e.g. `"allocated_bytes.all.current"`).
    pub fn to_flat_map(&self) -> BTreeMap<String, i64> {
        let mut map = BTreeMap::new();
        for (name, array) in self.arrays() {
            for (pool, stat) in [
                ("all", &array.all),
                ("small_pool", &array.small_pool),
                ("large_pool", &array.large_pool),
            ] {
                for (field, v) in [
                    ("current", stat.current),
                    ("peak", stat.peak),
                    ("allocated", stat.allocated),
                    ("freed", stat.freed),
                ] {
                    map.insert(format!("{name}.{pool}.{field}"), v);
                }
            }
        }
        map.insert("num_alloc_retries".into(), self.num_alloc_retries);
        map.insert("num_ooms".into(), self.num_ooms);
        map.insert("num_device_alloc".into(), self.num_device_alloc);
        map.insert("num_device_free".into(), self.num_device_free);
        map
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_tracks_peak_and_totals() {
        let mut s = Stat::default();
        s.increase(10);
        s.increase(5);
        s.decrease(12);
        assert_eq!((s.current, s.peak, s.allocated, s.freed), (3, 15, 15, 12));
        s.reset_peak();
        assert_eq!(s.peak, 3);
    }

    #[test]
    fn flat_map_has_pytorch_keys() {
        let mut st = DeviceStats::default();
        st.allocated_bytes.increase(Pool::Small, 512);
        let m = st.to_flat_map();
        assert_eq!(m["allocated_bytes.all.current"], 512);
        assert_eq!(m["allocated_bytes.small_pool.peak"], 512);
        assert_eq!(m["allocation.large_pool.freed"], 0);
        assert!(m.contains_key("num_ooms"));
    }
}
