//! Memory the round engine shares with its Python workers, so that neither a model nor an
//! update crosses a pipe.
//!
//! Through pipes, a 4 MB update was copied into the pipe by the worker, out of it by the
//! engine into freshly faulted pages, and read twice more (checked, then folded): with a
//! `train` that does nothing, the engine managed about 200 updates a second. Here the
//! engine writes each worker's model into that worker's *model area* once per version
//! (the worker's NumPy views point straight into it), and a worker writes its update
//! into the *slot* the engine named in the task; the engine checks and folds it where it
//! lies. A frame on the pipe still carries every request and reply, but no tensor bytes.
//!
//! The memory is an anonymous `memfd` (Linux): it has no name, no file to clean up after
//! a crash, and it is gone once the engine and its workers have exited. Its descriptor is
//! created inheritable and kept open, so that every worker (restarts included) receives
//! it at start; the worker maps it by number.
//!
//! Who may touch which part, and when, is the protocol's business: the engine writes a
//! model area only while that worker is idle, and reads a slot only after the worker
//! that filled it has replied (the worker does not touch it again until it is named in
//! another task). Inside the engine, each area is an [`Area`] with one owner, so Rust's
//! borrows keep the engine's own threads apart.
#![allow(unsafe_code)]

#[cfg(target_os = "linux")]
pub use linux::{Area, SharedFile};
#[cfg(not(target_os = "linux"))]
pub use unsupported::{Area, SharedFile};

#[cfg(target_os = "linux")]
mod linux {
    use std::os::fd::{AsRawFd, OwnedFd, RawFd};
    use std::ptr::NonNull;
    use std::sync::Arc;

    /// Areas start on page boundaries, so a worker's writes to one slot never share a page
    /// (or a cache line) with another's.
    const ALIGN: usize = 4096;

    /// The shared file, before and after it is mapped.
    #[derive(Debug)]
    pub struct SharedFile {
        fd: OwnedFd,
    }

    impl SharedFile {
        /// A new, empty, inheritable shared file. Create it before starting the processes
        /// that are to share it.
        pub fn create() -> std::io::Result<Self> {
            // No MFD_CLOEXEC: the workers inherit the descriptor at exec.
            let fd =
                rustix::fs::memfd_create("cohort-simulation", rustix::fs::MemfdFlags::empty())?;
            Ok(Self { fd })
        }

        /// The descriptor number the workers inherit.
        pub fn raw_fd(&self) -> RawFd {
            self.fd.as_raw_fd()
        }

        /// Sizes the file for areas of `sizes` bytes each (in that order, each rounded up to
        /// a page) and maps it. Call it once: a second call maps the same pages again.
        pub fn map(&self, sizes: &[usize]) -> std::io::Result<Vec<Area>> {
            let mut offsets = Vec::with_capacity(sizes.len());
            let mut total = 0usize;
            for &size in sizes {
                offsets.push(total);
                let rounded = size
                    .checked_next_multiple_of(ALIGN)
                    .and_then(|s| total.checked_add(s.max(ALIGN)))
                    .ok_or_else(|| std::io::Error::other("shared memory larger than memory"))?;
                total = rounded;
            }
            rustix::fs::ftruncate(&self.fd, total as u64)?;
            let fd = self.fd.try_clone()?;
            // SAFETY: a fresh shared mapping of a file we sized above; nothing else in this
            // process refers to that address range.
            let ptr = unsafe {
                rustix::mm::mmap(
                    std::ptr::null_mut(),
                    total,
                    rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                    rustix::mm::MapFlags::SHARED,
                    &fd,
                    0,
                )?
            };
            let mapping = Arc::new(Mapping {
                ptr: NonNull::new(ptr.cast::<u8>())
                    .ok_or_else(|| std::io::Error::other("mmap gave null"))?,
                len: total,
                _fd: fd,
            });
            Ok(offsets
                .into_iter()
                .zip(sizes)
                .map(|(offset, &len)| Area {
                    mapping: mapping.clone(),
                    offset,
                    len,
                })
                .collect())
        }
    }

    /// The mapping; unmapped when the last [`Area`] goes.
    #[derive(Debug)]
    struct Mapping {
        ptr: NonNull<u8>,
        len: usize,
        _fd: OwnedFd,
    }

    // SAFETY: the mapping is plain memory that lives until `Drop`; which thread touches which
    // bytes is settled by the `Area`s, each of which has one owner.
    unsafe impl Send for Mapping {}
    // SAFETY: as above; `Mapping` itself hands out no access.
    unsafe impl Sync for Mapping {}

    impl Drop for Mapping {
        fn drop(&mut self) {
            // SAFETY: the range was mapped in `SharedFile::map` and every `Area` that pointed
            // into it is gone (each holds the `Arc` this is the last of).
            unsafe {
                let _ = rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len);
            }
        }
    }

    /// One disjoint part of the shared memory: a worker's model area or an update slot.
    #[derive(Debug)]
    pub struct Area {
        mapping: Arc<Mapping>,
        offset: usize,
        len: usize,
    }

    impl Area {
        /// Where the area starts in the shared file, in bytes (what a worker is told).
        pub fn offset(&self) -> usize {
            self.offset
        }

        /// The area's size in bytes.
        pub fn size(&self) -> usize {
            self.len
        }

        fn ptr(&self) -> *mut u8 {
            // SAFETY: `offset + len` is within the mapping (`SharedFile::map`).
            unsafe { self.mapping.ptr.as_ptr().add(self.offset) }
        }

        /// The first `n` bytes, as a worker left them. `None` past the area's end.
        pub fn bytes(&self, n: usize) -> Option<&[u8]> {
            // SAFETY: within the area, which no other `Area` overlaps; by the protocol no
            // worker writes it while the engine reads it.
            (n <= self.len).then(|| unsafe { std::slice::from_raw_parts(self.ptr(), n) })
        }

        /// The first `n` values as `f32`s (areas are page-aligned). `None` past the end.
        pub fn f32s(&self, n: usize) -> Option<&[f32]> {
            let bytes = n.checked_mul(4)?;
            // SAFETY: as in `bytes`; page alignment makes the pointer `f32`-aligned, and
            // every bit pattern is an `f32`.
            (bytes <= self.len)
                .then(|| unsafe { std::slice::from_raw_parts(self.ptr().cast::<f32>(), n) })
        }

        /// Copies `values` to the start of the area. Fails (writing nothing) when they do
        /// not fit.
        pub fn write_f32s(&mut self, values: &[f32]) -> std::io::Result<()> {
            let bytes: &[u8] = bytemuck::cast_slice(values);
            if bytes.len() > self.len {
                return Err(std::io::Error::other(format!(
                    "{} bytes do not fit a {}-byte shared area",
                    bytes.len(),
                    self.len
                )));
            }
            // SAFETY: within the area, owned exclusively through `&mut self`; by the protocol
            // the worker does not read it while the engine writes it.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr(), bytes.len()) };
            Ok(())
        }
    }
}

/// Elsewhere there is no shared file to create, and the pipes carry everything.
#[cfg(not(target_os = "linux"))]
mod unsupported {
    use std::convert::Infallible;

    /// Cannot be made off Linux.
    #[derive(Debug)]
    pub struct SharedFile(Infallible);

    impl SharedFile {
        /// Always fails: no `memfd` here.
        pub fn create() -> std::io::Result<Self> {
            Err(std::io::ErrorKind::Unsupported.into())
        }

        /// Never called: there is no file.
        pub fn raw_fd(&self) -> i32 {
            match self.0 {}
        }

        /// Never called: there is no file.
        pub fn map(&self, _sizes: &[usize]) -> std::io::Result<Vec<Area>> {
            match self.0 {}
        }
    }

    /// Cannot be made off Linux.
    #[derive(Debug)]
    pub struct Area(Infallible);

    impl Area {
        /// Never called.
        pub fn offset(&self) -> usize {
            match self.0 {}
        }

        /// Never called.
        pub fn size(&self) -> usize {
            match self.0 {}
        }

        /// Never called.
        pub fn bytes(&self, _n: usize) -> Option<&[u8]> {
            match self.0 {}
        }

        /// Never called.
        pub fn f32s(&self, _n: usize) -> Option<&[f32]> {
            match self.0 {}
        }

        /// Never called.
        pub fn write_f32s(&mut self, _values: &[f32]) -> std::io::Result<()> {
            match self.0 {}
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn areas_are_disjoint_aligned_and_hold_what_was_written() {
        let file = SharedFile::create().unwrap();
        let mut areas = file.map(&[10, 4096, 5000, 0]).unwrap();
        assert_eq!(
            areas.iter().map(Area::offset).collect::<Vec<_>>(),
            [0, 4096, 8192, 16384]
        );
        for (i, a) in areas.iter_mut().enumerate() {
            let n = a.size() / 4;
            let values: Vec<f32> = (0..n).map(|k| (i * 10_000 + k) as f32).collect();
            a.write_f32s(&values).unwrap();
        }
        for (i, a) in areas.iter().enumerate() {
            let n = a.size() / 4;
            let want: Vec<f32> = (0..n).map(|k| (i * 10_000 + k) as f32).collect();
            assert_eq!(a.f32s(n).unwrap(), want.as_slice());
        }
        // 10 bytes hold two whole f32s; a third would reach past the area.
        assert!(areas[0].f32s(2).is_some());
        assert!(areas[0].f32s(3).is_none(), "past the area's end");
        assert!(areas[0].bytes(10).is_some() && areas[0].bytes(11).is_none());
        assert!(areas[1].write_f32s(&[0.0; 1025]).is_err());
    }

    #[test]
    fn another_process_sees_what_the_engine_wrote() {
        // The same file mapped a second time stands in for the worker's mapping: both
        // see one set of pages.
        let file = SharedFile::create().unwrap();
        let mut a = file.map(&[16]).unwrap().pop().unwrap();
        a.write_f32s(&[1.5, 2.5, 3.5, 4.5]).unwrap();
        let again = file.map(&[16]).unwrap().pop().unwrap();
        assert_eq!(again.f32s(4).unwrap(), &[1.5, 2.5, 3.5, 4.5]);
        let path = format!("/proc/self/fd/{}", file.raw_fd());
        let seen = std::fs::read(path).unwrap();
        assert_eq!(
            &seen[..16],
            bytemuck::cast_slice::<f32, u8>(&[1.5, 2.5, 3.5, 4.5])
        );
    }
}
