//! A global allocator that keeps freed large blocks for the next request of the same size:
//! [`BlockCache`], for a training program's `#[global_allocator]`.
//!
//! Why: Flex allocates a fresh buffer for every op's output. [`crate::local::keep_freed_memory`]
//! keeps glibc's blocks up to 32 MiB on its heap, but glibc serves anything larger (its
//! ceiling for the mmap threshold on 64-bit) with a fresh `mmap` and unmaps it when freed, so
//! every step page-faults those buffers back: the GPT's MLP activation at batch 8 x seq 1,024
//! (`[8192, 1024]` f32) is exactly 32 MiB. A step asks for the same sizes every time, so a
//! cache keyed by exact size and alignment hits nearly always. Measured (PERFORMANCE, section
//! 14, 2 cores): at that shape the exact GELU's forward 30.6 -> 8.6 ms, the layer norm 15.8 ->
//! 6.5 ms.
//!
//! Bounded: at most [`BlockCache::new`]'s `cap` bytes are held, the oldest given back first;
//! off until [`crate::local::keep_freed_memory`] switches it on (`BURN_TP_KEEP_FREED_MEMORY=0`
//! keeps it off), so installing it changes nothing by itself.
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOC: burn_tp::alloc::BlockCache = burn_tp::alloc::BlockCache::new(16 << 20, 512 << 20);
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// How many freed blocks the cache holds at most (a fixed array: the allocator must not
/// allocate while it holds its lock).
const SLOTS: usize = 64;

/// Whether every [`BlockCache`] in the process caches (set by
/// [`crate::local::keep_freed_memory`]).
static ON: AtomicBool = AtomicBool::new(false);

/// Switches the process's [`BlockCache`] on or off (off: blocks already cached stay until
/// they are reused or evicted).
pub fn set_block_cache(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

#[derive(Clone, Copy)]
struct Slot {
    /// 0: empty.
    ptr: usize,
    size: usize,
    align: usize,
    /// When it was freed (a counter): the oldest is evicted first.
    stamp: u64,
}

const EMPTY: Slot = Slot {
    ptr: 0,
    size: 0,
    align: 0,
    stamp: 0,
};

struct Slots {
    slots: [Slot; SLOTS],
    bytes: usize,
    clock: u64,
}

/// The system allocator with a cache of freed blocks of at least `min` bytes, reused by exact
/// size and alignment, holding at most `cap` bytes (see the module's doc).
pub struct BlockCache {
    min: usize,
    cap: usize,
    slots: Mutex<Slots>,
}

impl BlockCache {
    /// A cache of blocks of `min` bytes or more, holding at most `cap` bytes.
    pub const fn new(min: usize, cap: usize) -> Self {
        Self {
            min,
            cap,
            slots: Mutex::new(Slots {
                slots: [EMPTY; SLOTS],
                bytes: 0,
                clock: 0,
            }),
        }
    }

    fn caches(&self, layout: Layout) -> bool {
        layout.size() >= self.min && layout.size() <= self.cap && ON.load(Ordering::Relaxed)
    }

    /// A cached block of `layout`'s size and alignment, removed from the cache.
    fn take(&self, layout: Layout) -> Option<*mut u8> {
        let mut s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let hit = s
            .slots
            .iter()
            .enumerate()
            .filter(|(_, b)| b.ptr != 0 && b.size == layout.size() && b.align == layout.align())
            .max_by_key(|(_, b)| b.stamp)
            .map(|(i, _)| i);
        let i = hit?;
        let block = std::mem::replace(&mut s.slots[i], EMPTY);
        s.bytes -= block.size;
        Some(block.ptr as *mut u8)
    }

    /// Keeps `ptr` (of `layout`, from [`System`]), giving the oldest blocks back to the system
    /// until it fits under the cap and in a slot.
    ///
    /// # Safety
    /// As [`GlobalAlloc::dealloc`].
    unsafe fn keep(&self, ptr: *mut u8, layout: Layout) {
        let mut s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let full = s.slots.iter().all(|b| b.ptr != 0);
            if !full && s.bytes + layout.size() <= self.cap {
                break;
            }
            let oldest = s
                .slots
                .iter()
                .enumerate()
                .filter(|(_, b)| b.ptr != 0)
                .min_by_key(|(_, b)| b.stamp)
                .map(|(i, _)| i)
                .expect("a full or over-cap cache holds a block");
            let block = std::mem::replace(&mut s.slots[oldest], EMPTY);
            s.bytes -= block.size;
            // Safety: the block came from `System` with this layout.
            unsafe {
                System.dealloc(
                    block.ptr as *mut u8,
                    Layout::from_size_align_unchecked(block.size, block.align),
                )
            };
        }
        s.clock += 1;
        let stamp = s.clock;
        let free = s
            .slots
            .iter()
            .position(|b| b.ptr == 0)
            .expect("made room above");
        s.slots[free] = Slot {
            ptr: ptr as usize,
            size: layout.size(),
            align: layout.align(),
            stamp,
        };
        s.bytes += layout.size();
    }

    /// The bytes the cache holds now.
    pub fn cached_bytes(&self) -> usize {
        self.slots.lock().unwrap_or_else(|e| e.into_inner()).bytes
    }
}

// Safety: every block handed out comes from `System` with the caller's layout (a cached block
// was allocated with exactly that size and alignment), and every block is given back to
// `System` with the layout it was allocated with.
unsafe impl GlobalAlloc for BlockCache {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if self.caches(layout)
            && let Some(ptr) = self.take(layout)
        {
            return ptr;
        }
        // Safety: forwarded as given.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if self.caches(layout)
            && let Some(ptr) = self.take(layout)
        {
            // Safety: `ptr` holds `layout.size()` bytes.
            unsafe { std::ptr::write_bytes(ptr, 0, layout.size()) };
            return ptr;
        }
        // Safety: forwarded as given.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if self.caches(layout) {
            // Safety: forwarded as given.
            unsafe { self.keep(ptr, layout) };
        } else {
            // Safety: forwarded as given.
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // Safety: `ptr` came from `System` with `layout` (cached or not).
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(size: usize) -> Layout {
        Layout::from_size_align(size, 64).unwrap()
    }

    /// A freed block comes back for the same size and alignment, zeroed where asked; another
    /// size misses; the cap gives the oldest back; nothing is cached while it is off. One test:
    /// the switch is process-wide.
    #[test]
    fn reuses_by_exact_size_within_the_cap() {
        let cache = BlockCache::new(1024, 3 * 4096);
        set_block_cache(false);
        unsafe {
            let p = cache.alloc(layout(4096));
            cache.dealloc(p, layout(4096));
            assert_eq!(cache.cached_bytes(), 0, "off: nothing cached");

            set_block_cache(true);
            let small = cache.alloc(layout(512));
            cache.dealloc(small, layout(512));
            assert_eq!(cache.cached_bytes(), 0, "below min: not cached");

            let p = cache.alloc(layout(4096));
            std::ptr::write_bytes(p, 7, 4096);
            cache.dealloc(p, layout(4096));
            assert_eq!(cache.cached_bytes(), 4096);
            let other = cache.alloc(layout(8192));
            assert_ne!(other, p, "another size misses");
            let again = cache.alloc_zeroed(layout(4096));
            assert_eq!(again, p, "the same size is the cached block");
            assert!(
                std::slice::from_raw_parts(again, 4096)
                    .iter()
                    .all(|&b| b == 0)
            );
            assert_eq!(cache.cached_bytes(), 0);
            let aligned = Layout::from_size_align(4096, 4096).unwrap();
            cache.dealloc(again, layout(4096));
            let q = cache.alloc(aligned);
            assert_ne!(q, again, "another alignment misses");
            cache.dealloc(q, aligned);

            // The cap: 8192 + 4096 (two blocks) held; one more 4096 evicts the oldest.
            cache.dealloc(other, layout(8192));
            assert_eq!(cache.cached_bytes(), 3 * 4096);
            let r = cache.alloc(layout(1024));
            cache.dealloc(r, layout(1024));
            assert_eq!(
                cache.cached_bytes(),
                8192 + 1024,
                "the oldest (q) given back"
            );
            assert_eq!(cache.take(aligned), None, "q was evicted");
            set_block_cache(false);
            for size in [8192, 1024] {
                let p = cache.take(layout(size)).expect("still cached");
                System.dealloc(p, layout(size));
            }
            assert_eq!(cache.cached_bytes(), 0);
        }
    }
}
