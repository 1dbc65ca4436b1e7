//! The caching allocator's size rules: request rounding, segment size on a cache miss and
//! when a found block is split. Constants carry PyTorch's names.

use crate::memory::stats::{Pool, SMALL_SIZE};

/// Every request is rounded up to a multiple of this (`kMinBlockSize`).
pub const MIN_BLOCK_SIZE: usize = 512;
/// Segment size for small-pool misses (`kSmallBuffer`).
pub const SMALL_BUFFER: usize = 2 << 20;
/// Large requests below this get a `LARGE_BUFFER` segment (`kMinLargeAlloc`).
pub const MIN_LARGE_ALLOC: usize = 10 << 20;
/// Segment size for 1–10 MiB requests (`kLargeBuffer`).
pub const LARGE_BUFFER: usize = 20 << 20;
/// Segments for requests of at least `MIN_LARGE_ALLOC` are a multiple of this (`kRoundLarge`).
pub const ROUND_LARGE: usize = 2 << 20;
/// Requests of this size or more fail at once (PyTorch: "more than 1EB").
pub const MAX_REQUEST: u64 = 1 << 60;

/// `round_size`: below 512 → 512, else the next multiple of 512.
/// (PyTorch's optional `roundup_power2_divisions` is not implemented: it is off by default.)
pub fn round_size(size: usize) -> usize {
    if size < MIN_BLOCK_SIZE {
        MIN_BLOCK_SIZE
    } else {
        size.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE
    }
}

/// `get_allocation_size`: the segment to ask the device for when no cached block fits.
pub fn allocation_size(rounded: usize) -> usize {
    if rounded <= SMALL_SIZE {
        SMALL_BUFFER
    } else if rounded < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        rounded.div_ceil(ROUND_LARGE) * ROUND_LARGE
    }
}

/// `should_split`: small-pool blocks split when at least one minimal block remains; large
/// ones only when more than 1 MiB remains, so up to 1 MiB of a large block may be handed out
/// unused (and counted as allocated). PyTorch's `max_split_size` is unlimited here.
pub fn should_split(pool: Pool, block_size: usize, rounded: usize) -> bool {
    let remaining = block_size - rounded;
    match pool {
        Pool::Small => remaining >= MIN_BLOCK_SIZE,
        Pool::Large => remaining > SMALL_SIZE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn rounding_table() {
        for (size, rounded) in [
            (1, 512),
            (511, 512),
            (512, 512),
            (513, 1024),
            (1000, 1024),
            (1024, 1024),
            (1025, 1536),
            (MIB - 1, MIB),
            (MIB + 1, MIB + 512),
            (3 * MIB + 100, 3 * MIB + 512),
        ] {
            assert_eq!(round_size(size), rounded, "round_size({size})");
        }
    }

    #[test]
    fn pool_boundary_is_one_mib_inclusive() {
        assert_eq!(Pool::for_size(round_size(MIB)), Pool::Small);
        assert_eq!(Pool::for_size(round_size(MIB - 511)), Pool::Small);
        assert_eq!(Pool::for_size(round_size(MIB + 1)), Pool::Large);
    }

    #[test]
    fn segment_sizes() {
        assert_eq!(allocation_size(512), 2 * MIB);
        assert_eq!(allocation_size(MIB), 2 * MIB);
        assert_eq!(allocation_size(MIB + 512), 20 * MIB);
        assert_eq!(allocation_size(3 * MIB), 20 * MIB);
        assert_eq!(allocation_size(10 * MIB - 512), 20 * MIB);
        assert_eq!(allocation_size(10 * MIB), 10 * MIB);
        assert_eq!(allocation_size(10 * MIB + 512), 12 * MIB);
        assert_eq!(allocation_size(25 * MIB), 26 * MIB);
    }

    #[test]
    fn split_thresholds() {
        assert!(should_split(Pool::Small, 2 * MIB, 2 * MIB - 512));
        assert!(should_split(Pool::Small, 1536, 1024));
        assert!(!should_split(Pool::Small, 1024, 1024));
        assert!(!should_split(Pool::Large, 12 * MIB, 11 * MIB));
        assert!(should_split(Pool::Large, 12 * MIB, 11 * MIB - 512));
    }
}
