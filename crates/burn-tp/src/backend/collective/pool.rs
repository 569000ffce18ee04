//! Output buffers of the host collectives: reused across calls (no allocation and no page faults
//! in steady state) and handed to a tensor as its storage without a copy.
//!
//! A buffer goes back to the pool only when the last owner of its storage drops it (the
//! tensor's `Bytes` own it through [`PooledController`]), so a pooled buffer is never written
//! while a tensor still refers to it.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::collections::HashMap;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::{LazyLock, Mutex};

use burn::tensor::Bytes;
use burn_std::bytes::{AccessError, AccessPolicy, AllocationController, AllocationProperty};
use burn_tp_comm::RecvBuf;

/// Alignment of every pooled block (a cache line; enough for any SIMD load).
const ALIGN: usize = 64;
/// Free blocks kept per size.
const KEEP_PER_SIZE: usize = 4;
/// Free bytes kept over all sizes.
const KEEP_BYTES: usize = 1 << 30;

/// One heap block of `size` bytes, aligned to [`ALIGN`].
struct Block {
    ptr: NonNull<u8>,
    size: usize,
}

// Safety: a block is plain heap memory owned by exactly one holder at a time.
unsafe impl Send for Block {}
// Safety: shared access only reads (through `&`), as for a `Box<[u8]>`.
unsafe impl Sync for Block {}

impl Block {
    fn layout(size: usize) -> Layout {
        Layout::from_size_align(size.max(1), ALIGN).expect("a valid block size")
    }

    /// Zeroed, so every byte is initialised before anyone reads or writes it.
    fn alloc(size: usize) -> Self {
        let layout = Self::layout(size);
        // Safety: a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self { ptr, size }
    }

    fn free(self) {
        // Safety: allocated in `alloc` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.size)) }
    }
}

#[derive(Default)]
struct Pool {
    free: HashMap<usize, Vec<Block>>,
    bytes: usize,
    /// Blocks handed out since the start, and how many of them were reused (for tests and
    /// the benches).
    taken: u64,
    reused: u64,
}

static POOL: LazyLock<Mutex<Pool>> = LazyLock::new(|| Mutex::new(Pool::default()));

fn pool() -> std::sync::MutexGuard<'static, Pool> {
    POOL.lock().unwrap_or_else(|e| e.into_inner())
}

fn take(size: usize) -> Block {
    let mut p = pool();
    p.taken += 1;
    if let Some(block) = p.free.get_mut(&size).and_then(Vec::pop) {
        p.bytes -= size;
        p.reused += 1;
        return block;
    }
    drop(p);
    Block::alloc(size)
}

fn give_back(block: Block) {
    let mut p = pool();
    let size = block.size;
    let kept = p.free.get(&size).map_or(0, Vec::len);
    if kept < KEEP_PER_SIZE && p.bytes + size <= KEEP_BYTES {
        p.bytes += size;
        p.free.entry(size).or_default().push(block);
    } else {
        drop(p);
        block.free();
    }
}

/// `(blocks handed out, of which reused)` since the process started.
pub fn pool_stats() -> (u64, u64) {
    let p = pool();
    (p.taken, p.reused)
}

/// Bytes of the free blocks the pool keeps (allocated, held by no tensor).
pub fn pool_free_bytes() -> usize {
    pool().bytes
}

/// An output buffer of `len` elements of `T` from the pool, for a collective to write into.
pub(crate) struct PooledBuf<T> {
    block: Option<Block>,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: bytemuck::Pod> PooledBuf<T> {
    pub(crate) fn new(len: usize) -> Self {
        Self {
            block: Some(take(len * size_of::<T>())),
            len,
            _t: PhantomData,
        }
    }

    /// The buffer as a tensor's storage (no copy); it returns to the pool when the storage is
    /// dropped.
    pub(crate) fn into_bytes(mut self) -> Bytes {
        let block = self.block.take().expect("a buffer is converted once");
        let len = self.len * size_of::<T>();
        // Safety: the block holds `len` initialised bytes (zeroed at allocation, then written).
        unsafe { Bytes::from_controller(Box::new(PooledController { block: Some(block) }), len) }
    }
}

// `Pod`: any bit pattern is a valid `T`, so a view of the pool's bytes as `T` is sound; bytemuck
// checks the alignment (the blocks are ALIGN-aligned) and the length.
impl<T: bytemuck::Pod + Send + 'static> RecvBuf<T> for PooledBuf<T> {
    fn as_mut_slice(&mut self) -> &mut [T] {
        let block = self.block.as_ref().expect("not yet converted");
        let n = self.len * size_of::<T>();
        // Safety: the block holds at least `n` initialised bytes (zeroed at allocation) that
        // only this buffer refers to until it is converted or dropped.
        let bytes = unsafe { std::slice::from_raw_parts_mut(block.ptr.as_ptr(), n) };
        bytemuck::cast_slice_mut(bytes)
    }

    fn as_slice(&self) -> &[T] {
        let block = self.block.as_ref().expect("not yet converted");
        let n = self.len * size_of::<T>();
        // Safety: as `as_mut_slice`, shared.
        let bytes = unsafe { std::slice::from_raw_parts(block.ptr.as_ptr(), n) };
        bytemuck::cast_slice(bytes)
    }
}

impl<T> Drop for PooledBuf<T> {
    fn drop(&mut self) {
        if let Some(block) = self.block.take() {
            give_back(block);
        }
    }
}

/// Owns a pooled block as a tensor's storage, and gives it back when dropped.
struct PooledController {
    block: Option<Block>,
}

impl PooledController {
    fn block(&self) -> &Block {
        self.block.as_ref().expect("live until dropped")
    }
}

impl AllocationController for PooledController {
    fn alloc_align(&self) -> usize {
        ALIGN
    }

    fn property(&self) -> AllocationProperty {
        AllocationProperty::Native
    }

    unsafe fn memory_mut(
        &mut self,
        _policy: AccessPolicy,
    ) -> Result<&mut [MaybeUninit<u8>], AccessError> {
        let block = self.block();
        // Safety: the block is valid for `size` bytes and owned by this controller.
        Ok(unsafe { std::slice::from_raw_parts_mut(block.ptr.as_ptr().cast(), block.size) })
    }

    fn memory(&self, _policy: AccessPolicy) -> Result<&[MaybeUninit<u8>], AccessError> {
        let block = self.block();
        // Safety: as above, shared.
        Ok(unsafe { std::slice::from_raw_parts(block.ptr.as_ptr().cast(), block.size) })
    }
}

impl Drop for PooledController {
    fn drop(&mut self) {
        if let Some(block) = self.block.take() {
            give_back(block);
        }
    }
}
