//! The test binary's global allocator: the system's, counting what each thread allocates and
//! frees while [`peak_of`] measures it (every other thread, and this one outside it, pays one
//! thread-local read an allocation).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// The system allocator, counting this thread's bytes while [`peak_of`] runs.
struct Counting;

thread_local! {
    /// `(held, peak)` bytes since [`peak_of`] began on this thread; `None` outside it.
    static COUNT: Cell<Option<(isize, isize)>> = const { Cell::new(None) };
}

fn add(bytes: isize) {
    // `try_with`: an allocation while the thread's locals are torn down counts nothing.
    let _ = COUNT.try_with(|c| {
        if let Some((held, peak)) = c.get() {
            let held = held + bytes;
            c.set(Some((held, peak.max(held))));
        }
    });
}

// SAFETY: every call is the system allocator's; the counting touches no allocation.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            add(layout.size() as isize);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            add(layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        add(-(layout.size() as isize));
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            add(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// `f()` and the most bytes this thread held at once while it ran, beyond what it held before
/// (what other threads allocate for it is not counted: run `f` where its work is this
/// thread's).
pub fn peak_of<T>(f: impl FnOnce() -> T) -> (T, usize) {
    COUNT.with(|c| c.set(Some((0, 0))));
    let out = f();
    let (_, peak) = COUNT.with(|c| c.replace(None)).expect("set above");
    (out, peak.max(0) as usize)
}
