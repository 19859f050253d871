//! Durable blobs: uploaded updates and published models, in a directory ([`dir`], the
//! default) or an object store ([`object`]: S3 and S3-compatible servers, Google Cloud
//! Storage, Azure Blob Storage; `cohort serve --blob-store URL`).
//!
//! Both keep the same promises: a blob is visible only once complete (a rename on
//! disk, a completed multipart upload in a bucket), it is durable when `put` or
//! `commit` returns (so an upload is acknowledged only then), large bodies are written
//! in pieces with memory flat in their size, and the SHA-256 computed while writing is
//! what the database records and [`BlobStore::get_verified`] checks before a blob is
//! aggregated.
//!
//! The interface is blocking: callers run it on tokio's blocking pool (or a thread of
//! their own), never on an async worker.

pub mod dir;
pub mod object;

use std::io;
use std::path::{Component, Path};

use ring::digest;

/// Where a stored blob is and what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlobInfo {
    /// Path relative to the store's root, as recorded in the database.
    pub path: String,
    /// Size in bytes.
    pub bytes: u64,
    /// SHA-256 of the contents.
    pub sha256: [u8; 32],
}

pub(crate) fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// Refuses a blob path that is empty, absolute or could leave the store's root.
pub(crate) fn check_relative(relative: &str) -> io::Result<()> {
    let plain = Path::new(relative)
        .components()
        .all(|c| matches!(c, Component::Normal(_)));
    if relative.is_empty() || !plain || relative.contains('\\') {
        return Err(invalid(format!(
            "blob path `{relative}` must be relative and plain"
        )));
    }
    Ok(())
}

/// Where blobs live: a directory or an object store.
#[derive(Debug, Clone)]
pub enum BlobStore {
    /// A directory on this machine (or a shared file system).
    Dir(dir::DirBlobs),
    /// A bucket (and prefix) of an object store.
    Object(object::ObjectBlobs),
}

impl BlobStore {
    /// A directory store rooted at `root`, created if missing.
    pub fn open(root: &Path) -> io::Result<Self> {
        dir::DirBlobs::open(root).map(BlobStore::Dir)
    }

    /// What the store is, for logs: the directory or the URL.
    pub fn describe(&self) -> String {
        match self {
            BlobStore::Dir(d) => d.root().display().to_string(),
            BlobStore::Object(o) => o.url().to_string(),
        }
    }

    /// Writes `bytes` durably at `relative`, replacing an earlier blob of that name.
    pub fn put(&self, relative: &str, bytes: &[u8]) -> io::Result<BlobInfo> {
        match self {
            BlobStore::Dir(d) => d.put(relative, bytes),
            BlobStore::Object(o) => o.put(relative, bytes),
        }?;
        let mut sha256 = [0u8; 32];
        sha256.copy_from_slice(digest::digest(&digest::SHA256, bytes).as_ref());
        Ok(BlobInfo {
            path: relative.to_string(),
            bytes: bytes.len() as u64,
            sha256,
        })
    }

    /// Starts writing a blob at `relative` piece by piece, for bodies too large to hold
    /// in memory. Nothing is visible at `relative` until [`BlobWriter::commit`]; a writer
    /// dropped before that leaves nothing behind.
    pub fn writer(&self, relative: &str) -> io::Result<BlobWriter> {
        let inner = match self {
            BlobStore::Dir(d) => d.writer(relative).map(Pieces::Dir),
            BlobStore::Object(o) => o.writer(relative).map(Pieces::Object),
        }?;
        Ok(BlobWriter {
            relative: relative.to_string(),
            inner,
            digest: digest::Context::new(&digest::SHA256),
            bytes: 0,
        })
    }

    /// Reads the blob at `relative`.
    pub fn get(&self, relative: &str) -> io::Result<Vec<u8>> {
        match self {
            BlobStore::Dir(d) => d.get(relative),
            BlobStore::Object(o) => o.get(relative),
        }
    }

    /// Deletes the blob at `relative` (an orphan whose record was refused).
    pub fn remove(&self, relative: &str) -> io::Result<()> {
        match self {
            BlobStore::Dir(d) => d.remove(relative),
            BlobStore::Object(o) => o.remove(relative),
        }
    }

    /// Reads the blob at `relative` and checks it against its recorded SHA-256, so a
    /// damaged blob is an error rather than a wrong model.
    pub fn get_verified(&self, relative: &str, sha256: &[u8]) -> io::Result<Vec<u8>> {
        let bytes = self.get(relative)?;
        if digest::digest(&digest::SHA256, &bytes).as_ref() != sha256 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("blob `{relative}` does not match its recorded checksum"),
            ));
        }
        Ok(bytes)
    }
}

/// Where a blob being written goes.
#[derive(Debug)]
enum Pieces {
    /// Into a temporary file beside its place.
    Dir(dir::DirWriter),
    /// As a multipart upload.
    Object(object::ObjectWriter),
}

/// A blob being written; see [`BlobStore::writer`]. Its checksum and size are taken
/// here, as the pieces pass, whichever store they go to.
pub struct BlobWriter {
    relative: String,
    inner: Pieces,
    digest: digest::Context,
    bytes: u64,
}

impl std::fmt::Debug for BlobWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlobWriter")
            .field("path", &self.relative)
            .field("bytes", &self.bytes)
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl BlobWriter {
    /// Appends `chunk`.
    pub fn write(&mut self, chunk: &[u8]) -> io::Result<()> {
        match &mut self.inner {
            Pieces::Dir(w) => w.write(chunk),
            Pieces::Object(w) => w.write(chunk),
        }?;
        self.digest.update(chunk);
        self.bytes += chunk.len() as u64;
        Ok(())
    }

    /// Bytes written so far.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Makes the blob durable and visible at its place.
    pub fn commit(self) -> io::Result<BlobInfo> {
        match self.inner {
            Pieces::Dir(w) => w.commit(),
            Pieces::Object(w) => w.commit(),
        }?;
        let mut sha256 = [0u8; 32];
        sha256.copy_from_slice(self.digest.finish().as_ref());
        Ok(BlobInfo {
            path: self.relative,
            bytes: self.bytes,
            sha256,
        })
    }
}
