//! The `cohort` command's allocator: buffers of 2 MiB and more on transparent huge pages.
//!
//! The reducers read every update of a round once, tens to hundreds of megabytes in
//! runs of 128 KiB from eight updates at a time. On 4 KiB pages every run crosses dozens
//! of pages: each needs its own address translation (a page walk once the TLB has
//! turned over) and the CPU's hardware prefetchers stop at each page's end. On 2 MiB
//! pages neither happens. Measured on the 2-core Intel Xeon this project is built on
//! (scratch harness, one run, three turns, 100 updates of 10^6 `f32` in one buffer):
//! the FedAvg fold read 24-27 GB/s from 4 KiB pages and 31-33 GB/s from huge pages, and
//! the memory read probe 28-30 and 30-33 GB/s. NumPy asks for huge pages for its large arrays in the
//! same way, so its `tensordot`, which this project's FedAvg is compared with, already
//! had them.
//!
//! Linux gives a region huge pages when it is asked to (`madvise(MADV_HUGEPAGE)`, as the
//! usual `/sys/kernel/mm/transparent_hugepage/enabled` setting, `madvise`, requires) and
//! the region covers whole 2 MiB-aligned stretches. The system allocator places large
//! blocks wherever `mmap` puts them and asks for nothing, so a large block is mapped
//! here instead, starting on a 2 MiB boundary, and advised. Its length is rounded up to
//! whole huge pages where that adds at most an eighth (a 3.8 MiB update is then on two
//! huge pages), else to 4 KiB pages, its tail on small pages: a block never holds more
//! than an eighth more memory than the system allocator would have given it. Smaller blocks, blocks
//! that ask for more than 2 MiB alignment, and every block on other systems go to the
//! system allocator unchanged. Where huge pages are off (`never`), the advice is
//! refused and ignored, and the block is an ordinary mapping.
//!
//! Large blocks do not all start on a 2 MiB boundary, though: on huge pages an address's
//! low 21 bits are its physical ones, which pick its set in the CPU's caches, so eight
//! updates read together at the same offset would all compete for the same few sets of
//! the second-level cache and the sums would lose to their own conflict misses
//! (`cohort bench reduce`, three turns each, against the probe read just before: FedAvg
//! 0.93-0.95 and the masked sum 0.92-0.95 with every block on its boundary, 0.94-0.98
//! and 0.99-1.01 coloured as here). Each block starts
//! a different number of cache lines past its boundary ([`colour`]), so that 32 blocks
//! in a row fall in 32 different sets of the first- and second-level caches; the few
//! kilobytes skipped are part of the mapping's first huge page.
//!
//! The cost: faulting a huge page zeroes 2 MiB at once, and where memory is fragmented
//! the kernel compacts it first (the `defrag` setting decides), which a first touch
//! waits for. The coordinator's large buffers (updates, models, sums) are read and
//! written whole, so it pays that for every page it uses anyway.
// A global allocator is `unsafe` by contract; its mapping calls take raw pointers.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};

/// The size of a transparent huge page on x86-64 and on most aarch64 kernels.
pub const HUGE_PAGE: usize = 2 << 20;

/// The `cohort` command's global allocator (see the module documentation).
#[derive(Debug, Default, Clone, Copy)]
pub struct HugePageAllocator;

/// Whether a block of `layout` is mapped on huge pages rather than taken from the system
/// allocator: one whole huge page at least, and an alignment a huge page's start has.
fn is_large(layout: Layout) -> bool {
    cfg!(target_os = "linux") && layout.size() >= HUGE_PAGE && layout.align() <= HUGE_PAGE
}

/// Bytes between one large block's start and the next one's colour: a page and a
/// cache line, so that consecutive blocks differ by one set in a first-level cache
/// (whose sets repeat every 4 KiB) and by 65 sets in a second-level one (every 128 KiB
/// on the 2 MiB, 16-way caches of this project's CPUs).
const COLOUR_STEP: usize = 4096 + 64;

/// Colours before they repeat: 32 x 4,160 bytes is about the 128 KiB a second-level
/// cache's sets span.
const COLOURS: usize = 32;

/// Where the next large block starts past its 2 MiB boundary: the next of [`COLOURS`]
/// offsets, each a multiple of `align` (blocks aligned to more than a cache line start on
/// the boundary).
fn colour(align: usize) -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    if align > 64 {
        return 0;
    }
    NEXT.fetch_add(1, Ordering::Relaxed) % COLOURS * COLOUR_STEP
}

// SAFETY: every block is either the system allocator's (passed through with its own
// layout) or a mapping of at least `layout.size()` bytes aligned to 2 MiB, which only
// this allocator unmaps, and only when its block is freed or shrunk; which of the two a
// block is follows from its layout alone, which the caller hands back unchanged.
unsafe impl GlobalAlloc for HugePageAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if is_large(layout) {
            map::huge(layout.size(), colour(layout.align()))
        } else {
            // SAFETY: the caller's contract (a layout of non-zero size) is passed on.
            unsafe { System.alloc(layout) }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if is_large(layout) {
            // A fresh anonymous mapping reads as zeros.
            map::huge(layout.size(), colour(layout.align()))
        } else {
            // SAFETY: as in `alloc`.
            unsafe { System.alloc_zeroed(layout) }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if is_large(layout) {
            // SAFETY: a large layout's block is a mapping this allocator made of that size.
            unsafe { map::unmap(ptr, layout.size()) }
        } else {
            // SAFETY: a small layout's block is the system allocator's.
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller guarantees `new_size`, rounded up to the alignment, does not
        // overflow `isize`, which is all a layout asks.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        match (is_large(layout), is_large(new_layout)) {
            // SAFETY: both blocks are the system allocator's.
            (false, false) => unsafe { System.realloc(ptr, layout, new_size) },
            // Shrinking a mapping in place: its start keeps its alignment and its pages.
            (true, true) if new_size <= layout.size() => {
                // SAFETY: the block is a mapping of `layout.size()` bytes made here.
                unsafe { map::shrink(ptr, layout.size(), new_size) };
                ptr
            }
            _ => {
                // SAFETY: `new_layout` has a non-zero size (at least the old block's, or
                // a large one's).
                let new = unsafe { self.alloc(new_layout) };
                if !new.is_null() {
                    // SAFETY: both blocks hold at least the smaller size, and a fresh block
                    // does not overlap a live one.
                    unsafe {
                        std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                        self.dealloc(ptr, layout);
                    }
                }
                new
            }
        }
    }
}

#[cfg(target_os = "linux")]
mod map {
    use std::ffi::c_void;

    use rustix::mm::{Advice, MapFlags, ProtFlags};

    use super::HUGE_PAGE;

    /// The kernel's page size on the machines Cohort runs on; mappings are rounded to it.
    const PAGE: usize = 4096;

    /// The length mapped for a block that ends `bytes` past its 2 MiB boundary: whole
    /// huge pages when that costs at most an eighth more memory (a 3.8 MiB update is
    /// then all on huge pages, where the tail past its second boundary would otherwise
    /// be on small ones), else whole small pages.
    fn mapped_len(bytes: usize) -> usize {
        let small = bytes.div_ceil(PAGE) * PAGE;
        let huge = bytes.div_ceil(HUGE_PAGE) * HUGE_PAGE;
        if huge - small <= small / 8 {
            huge
        } else {
            small
        }
    }

    /// A block of `size` bytes `colour` bytes past the 2 MiB boundary where a fresh
    /// mapping starts (its length from [`mapped_len`]), advised to be backed by
    /// huge pages; null when the system has no memory for it. `colour` is less than
    /// 2 MiB, so the block's boundary is its address rounded down.
    pub(super) fn huge(size: usize, colour: usize) -> *mut u8 {
        let Some(len) = size.checked_add(colour).map(mapped_len) else {
            return std::ptr::null_mut();
        };
        // Enough to find a 2 MiB boundary with `len` bytes after it; the rest is returned.
        let Some(reserve) = len.checked_add(HUGE_PAGE - PAGE) else {
            return std::ptr::null_mut();
        };
        // SAFETY: a new private anonymous mapping touches no memory the program holds.
        let Ok(start) = (unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                reserve,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        }) else {
            return std::ptr::null_mut();
        };
        let start = start.cast::<u8>();
        let head = start.align_offset(HUGE_PAGE);
        // SAFETY: `head < HUGE_PAGE` and a multiple of the page size (mappings start on
        // pages), so `aligned + len` is within the reservation; the pieces unmapped
        // before and after it are whole pages of this fresh mapping, which nothing uses.
        unsafe {
            let aligned = start.add(head);
            if head > 0 {
                let _ = rustix::mm::munmap(start.cast::<c_void>(), head);
            }
            let tail = reserve - head - len;
            if tail > 0 {
                let _ = rustix::mm::munmap(aligned.add(len).cast::<c_void>(), tail);
            }
            // Refused where huge pages are off; the mapping is then an ordinary one.
            let _ = rustix::mm::madvise(aligned.cast::<c_void>(), len, Advice::LinuxHugepage);
            aligned.add(colour)
        }
    }

    /// The mapping under a block from [`huge`]: its start (the block's 2 MiB boundary)
    /// and the length mapped to cover `size` bytes of the block.
    fn mapping(ptr: *mut u8, size: usize) -> (*mut u8, usize) {
        let colour = ptr as usize % HUGE_PAGE;
        (ptr.wrapping_sub(colour), mapped_len(colour + size))
    }

    /// Returns a mapping made by [`huge`] for `size` bytes to the system.
    ///
    /// # Safety
    /// `ptr` and `size` are a live block from [`huge`] (or what [`shrink`] left of one),
    /// which nothing reads after this.
    pub(super) unsafe fn unmap(ptr: *mut u8, size: usize) {
        let (start, len) = mapping(ptr, size);
        // SAFETY: per the contract, the pages are this block's alone.
        let _ = unsafe { rustix::mm::munmap(start.cast::<c_void>(), len) };
    }

    /// Returns the pages of a block of `size` bytes from [`huge`] past its first
    /// `new_size` bytes.
    ///
    /// # Safety
    /// As [`unmap`], for the bytes past `new_size`.
    pub(super) unsafe fn shrink(ptr: *mut u8, size: usize, new_size: usize) {
        let ((start, held), (_, kept)) = (mapping(ptr, size), mapping(ptr, new_size));
        if held > kept {
            // SAFETY: whole pages of this block's mapping past what it keeps.
            let _ = unsafe { rustix::mm::munmap(start.add(kept).cast::<c_void>(), held - kept) };
        }
    }
}

#[cfg(not(target_os = "linux"))]
mod map {
    // `is_large` is false on other systems: nothing here is called.
    pub(super) fn huge(_size: usize, _colour: usize) -> *mut u8 {
        std::ptr::null_mut()
    }
    pub(super) unsafe fn unmap(_ptr: *mut u8, _size: usize) {}
    pub(super) unsafe fn shrink(_ptr: *mut u8, _size: usize, _new_size: usize) {}
}

/// The system's transparent huge page setting (`always`, `madvise` or `never`, from
/// `/sys/kernel/mm/transparent_hugepage/enabled`), or `unavailable` where there is
/// none: what the large buffers of this process got. Benchmarks report it.
pub fn transparent_huge_pages() -> String {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .ok()
        .and_then(|s| {
            // The chosen value is the bracketed one: "always [madvise] never".
            let start = s.find('[')?;
            let end = s[start..].find(']')?;
            Some(s[start + 1..start + end].to_string())
        })
        .unwrap_or_else(|| "unavailable".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(size: usize, align: usize) -> Layout {
        Layout::from_size_align(size, align).unwrap()
    }

    /// Blocks of every size class keep what is written to them, start where their
    /// layout asks, and come back zeroed from `alloc_zeroed`.
    #[test]
    fn blocks_large_and_small_hold_their_contents() {
        let a = HugePageAllocator;
        for (size, align) in [
            (1, 1),
            (4096, 64),
            (HUGE_PAGE - 1, 8),
            (HUGE_PAGE, 8),
            (4_000_016, 16),
            (3 * HUGE_PAGE + 5, 4096),
            (HUGE_PAGE, HUGE_PAGE),
            (HUGE_PAGE, 2 * HUGE_PAGE),
        ] {
            let l = layout(size, align);
            // SAFETY: non-zero sizes; each block is written within its size and freed
            // with its own layout.
            unsafe {
                let z = a.alloc_zeroed(l);
                assert!(!z.is_null(), "{size}");
                assert_eq!(z as usize % align, 0, "{size} aligned to {align}");
                assert!(std::slice::from_raw_parts(z, size).iter().all(|&b| b == 0));
                let p = a.alloc(l);
                assert_eq!(p as usize % align, 0, "{size} aligned to {align}");
                for i in (0..size).step_by(4093).chain([size - 1]) {
                    p.add(i).write((i % 251) as u8);
                }
                for i in (0..size).step_by(4093).chain([size - 1]) {
                    assert_eq!(p.add(i).read(), (i % 251) as u8, "{size} at {i}");
                }
                if is_large(l) {
                    assert!(p as usize % HUGE_PAGE < COLOURS * COLOUR_STEP, "{size}");
                }
                a.dealloc(p, l);
                a.dealloc(z, l);
            }
        }
    }

    /// Growing and shrinking across the 2 MiB line, both ways, keeps the bytes both
    /// sizes share, as `Vec` growth and `shrink_to_fit` rely on.
    #[test]
    fn realloc_keeps_the_common_bytes_across_the_threshold() {
        let a = HugePageAllocator;
        let steps = [
            100,
            HUGE_PAGE - 8,
            HUGE_PAGE,
            5 * HUGE_PAGE + 123,
            3 * HUGE_PAGE,
            HUGE_PAGE + 7,
            4096,
            24,
        ];
        let fill = |p: *mut u8, n: usize| {
            for i in 0..n {
                // SAFETY: `p` holds `n` bytes.
                unsafe { p.add(i).write((i * 7 % 253) as u8) };
            }
        };
        // SAFETY: each step reallocates the live block with the layout it was made with.
        unsafe {
            let mut size = 16;
            let mut p = a.alloc(layout(size, 8));
            fill(p, size);
            for next in steps {
                p = a.realloc(p, layout(size, 8), next);
                assert!(!p.is_null());
                let kept = size.min(next);
                for i in (0..kept).step_by(997).chain([kept - 1]) {
                    assert_eq!(
                        p.add(i).read(),
                        (i * 7 % 253) as u8,
                        "{size} -> {next} at {i}"
                    );
                }
                fill(p, next);
                size = next;
            }
            a.dealloc(p, layout(size, 8));
        }
    }

    /// Large blocks made one after another start at different offsets from their
    /// 2 MiB boundaries, in different cache sets.
    #[test]
    fn consecutive_large_blocks_start_in_different_cache_sets() {
        let a = HugePageAllocator;
        let l = layout(HUGE_PAGE + 100, 4);
        // SAFETY: blocks freed with their own layout, untouched.
        let offsets: std::collections::BTreeSet<usize> = (0..COLOURS)
            .map(|_| unsafe {
                let p = a.alloc(l);
                assert!(!p.is_null());
                let offset = p as usize % HUGE_PAGE;
                a.dealloc(p, l);
                offset
            })
            .collect();
        // Another thread's large blocks may take colours meanwhile; most stay distinct.
        assert!(offsets.len() > COLOURS / 2, "{offsets:?}");
        let sets: std::collections::BTreeSet<usize> = offsets.iter().map(|o| o / 64 % 64).collect();
        assert!(sets.len() > COLOURS / 2, "first-level sets {sets:?}");
    }

    /// With huge pages on (`madvise` or `always`), a large block that is touched is
    /// backed by them: the kernel's own account of this process's memory
    /// (`AnonHugePages` in `/proc/self/smaps_rollup`) grows by at least one huge page.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_large_block_is_backed_by_huge_pages_where_the_system_has_them() {
        let mode = transparent_huge_pages();
        if !["madvise", "always"].contains(&mode.as_str()) {
            eprintln!("transparent huge pages are {mode} here: nothing to check");
            return;
        }
        let anon_huge_kib = || -> u64 {
            std::fs::read_to_string("/proc/self/smaps_rollup")
                .unwrap()
                .lines()
                .find_map(|l| l.strip_prefix("AnonHugePages:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap()
        };
        let before = anon_huge_kib();
        let l = layout(8 * HUGE_PAGE, 64);
        let a = HugePageAllocator;
        // SAFETY: the block is written within its size and freed with its layout.
        unsafe {
            let p = a.alloc(l);
            assert!(!p.is_null());
            std::ptr::write_bytes(p, 1, l.size());
            let after = anon_huge_kib();
            a.dealloc(p, l);
            assert!(
                after >= before + (HUGE_PAGE / 1024) as u64,
                "AnonHugePages {before} kB -> {after} kB with 16 MiB touched on {mode}"
            );
        }
    }

    #[test]
    fn the_setting_is_read_from_its_brackets() {
        let mode = transparent_huge_pages();
        assert!(
            ["always", "madvise", "never", "unavailable"].contains(&mode.as_str()),
            "{mode}"
        );
    }
}
