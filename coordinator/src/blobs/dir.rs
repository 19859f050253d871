//! Blobs in a directory (the default, and replicas sharing a file system).
//!
//! A blob is written to a temporary file, flushed to disk, renamed into place and its
//! directory flushed too, so once `put` returns the bytes survive a crash or a SIGKILL;
//! only then may the upload be acknowledged.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use super::{check_relative, invalid};

/// A directory of blobs addressed by relative paths.
#[derive(Debug, Clone)]
pub struct DirBlobs {
    root: PathBuf,
}

impl DirBlobs {
    /// A store rooted at `root`, created if missing.
    pub fn open(root: &Path) -> io::Result<Self> {
        fs::create_dir_all(root)?;
        Ok(Self {
            root: root.to_path_buf(),
        })
    }

    /// The directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Resolves `relative`, refusing anything that could leave the root.
    fn resolve(&self, relative: &str) -> io::Result<PathBuf> {
        check_relative(relative)?;
        Ok(self.root.join(relative))
    }

    /// Writes `bytes` durably at `relative`, replacing an earlier blob of that name.
    pub fn put(&self, relative: &str, bytes: &[u8]) -> io::Result<()> {
        let target = self.resolve(relative)?;
        let dir = target
            .parent()
            .ok_or_else(|| invalid(format!("blob path `{relative}` has no directory")))?;
        fs::create_dir_all(dir)?;
        let tmp = target.with_extension(format!("tmp-{}", uuid::Uuid::new_v4().simple()));
        let result = (|| {
            let mut file = File::create(&tmp)?;
            file.write_all(bytes)?;
            file.sync_all()?;
            fs::rename(&tmp, &target)?;
            File::open(dir)?.sync_all()
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result
    }

    /// Starts writing a blob at `relative` piece by piece, for bodies too large to hold
    /// in memory. Nothing is visible at `relative` until [`DirWriter::commit`]; a writer
    /// dropped before that removes its temporary file.
    pub fn writer(&self, relative: &str) -> io::Result<DirWriter> {
        let target = self.resolve(relative)?;
        let dir = target
            .parent()
            .ok_or_else(|| invalid(format!("blob path `{relative}` has no directory")))?
            .to_path_buf();
        fs::create_dir_all(&dir)?;
        let tmp = target.with_extension(format!("tmp-{}", uuid::Uuid::new_v4().simple()));
        let file = File::create(&tmp)?;
        Ok(DirWriter {
            target,
            dir,
            tmp,
            file: Some(file),
        })
    }

    /// Reads the blob at `relative`.
    pub fn get(&self, relative: &str) -> io::Result<Vec<u8>> {
        fs::read(self.resolve(relative)?)
    }

    /// Deletes the blob at `relative` (an orphan whose record was refused).
    pub fn remove(&self, relative: &str) -> io::Result<()> {
        fs::remove_file(self.resolve(relative)?)
    }
}

/// A blob being written; see [`DirBlobs::writer`].
pub struct DirWriter {
    target: PathBuf,
    dir: PathBuf,
    tmp: PathBuf,
    file: Option<File>,
}

impl std::fmt::Debug for DirWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirWriter")
            .field("path", &self.target)
            .finish_non_exhaustive()
    }
}

impl DirWriter {
    /// Appends `chunk`.
    pub fn write(&mut self, chunk: &[u8]) -> io::Result<()> {
        let file = self
            .file
            .as_mut()
            .ok_or_else(|| io::Error::other("blob writer already committed"))?;
        file.write_all(chunk)
    }

    /// Flushes the blob to disk and moves it into place, as durably as
    /// [`DirBlobs::put`].
    pub fn commit(mut self) -> io::Result<()> {
        let file = self
            .file
            .take()
            .ok_or_else(|| io::Error::other("blob writer already committed"))?;
        file.sync_all()?;
        drop(file);
        fs::rename(&self.tmp, &self.target)?;
        File::open(&self.dir)?.sync_all()
    }
}

impl Drop for DirWriter {
    fn drop(&mut self) {
        // Still holding the file means it was never committed: leave no orphan behind.
        if self.file.take().is_some() {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use crate::blobs::BlobStore;

    #[test]
    fn put_then_get_round_trips_and_leaves_no_temporary_files() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let info = store.put("uploads/e/1-1/c.bin", b"hello").unwrap();
        assert_eq!(info.bytes, 5);
        assert_eq!(store.get("uploads/e/1-1/c.bin").unwrap(), b"hello");
        assert_eq!(
            store.get_verified(&info.path, &info.sha256).unwrap(),
            b"hello"
        );
        let names: Vec<_> = fs::read_dir(dir.path().join("uploads/e/1-1"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec!["c.bin"]);
    }

    #[test]
    fn a_blob_written_in_pieces_matches_one_put_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let whole = store.put("a/whole", b"hello, world").unwrap();
        let mut w = store.writer("a/pieces").unwrap();
        for piece in [&b"hel"[..], b"", b"lo, w", b"orld"] {
            w.write(piece).unwrap();
        }
        assert!(store.get("a/pieces").is_err(), "not visible before commit");
        let pieces = w.commit().unwrap();
        assert_eq!((pieces.bytes, pieces.sha256), (whole.bytes, whole.sha256));
        assert_eq!(store.get("a/pieces").unwrap(), b"hello, world");
    }

    #[test]
    fn a_dropped_writer_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let mut w = store.writer("u/x.bin").unwrap();
        w.write(b"partial").unwrap();
        drop(w);
        assert_eq!(fs::read_dir(dir.path().join("u")).unwrap().count(), 0);
    }

    #[test]
    fn paths_that_escape_the_root_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        for bad in ["", "../x", "/etc/passwd", "a/../../x", "./a"] {
            assert!(store.put(bad, b"x").is_err(), "{bad}");
        }
    }

    #[test]
    fn damaged_blob_fails_verification() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let info = store.put("m/1", b"weights").unwrap();
        fs::write(dir.path().join("m/1"), b"weightz").unwrap();
        assert!(store.get_verified(&info.path, &info.sha256).is_err());
    }
}
