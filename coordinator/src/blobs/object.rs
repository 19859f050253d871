//! Blobs in an object store (`--blob-store s3://bucket/prefix`, `gs://...`, `az://...`),
//! through Apache Arrow's `object_store`: replicas then share nothing but the database
//! and the bucket.
//!
//! Credentials, region and endpoint come from the provider's usual environment
//! variables (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`,
//! `AWS_ENDPOINT_URL` and `AWS_ALLOW_HTTP` for an S3-compatible server;
//! `GOOGLE_SERVICE_ACCOUNT`; `AZURE_STORAGE_ACCOUNT_NAME`, ...).
//!
//! A `put` is one PUT, which the store makes visible whole or not at all. A writer is a
//! multipart upload in parts of [`PART_BYTES`], at most [`PARTS_IN_FLIGHT`] in flight,
//! so memory stays near `PART_BYTES * (PARTS_IN_FLIGHT + 1)` whatever the blob's size;
//! the object appears only when the upload completes, and a writer dropped before that
//! aborts it.
//!
//! `object_store` is async; this interface is blocking (see [`super`]), so each call
//! runs its future on the runtime the store was opened on.

use std::io;
use std::sync::Arc;

use super::{check_relative, invalid};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, ObjectStoreScheme, PutPayload, WriteMultipart};

/// The size of each part of a multipart upload (S3 takes parts of 5 MiB and up).
pub const PART_BYTES: usize = 8 * 1024 * 1024;

/// Parts uploaded at once by one writer.
pub const PARTS_IN_FLIGHT: usize = 2;

/// Why `--blob-store` cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ObjectStoreError {
    /// Not a URL of a supported store.
    #[error(
        "--blob-store `{0}`: expected s3://BUCKET[/PREFIX], gs://BUCKET[/PREFIX] or \
         az://CONTAINER[/PREFIX] ({1})"
    )]
    Url(String, String),
    /// The store could not be set up or reached.
    #[error("--blob-store `{0}`: {1}")]
    Unreachable(String, String),
}

/// A bucket (and prefix) of an object store.
#[derive(Debug, Clone)]
pub struct ObjectBlobs {
    store: Arc<dyn ObjectStore>,
    prefix: ObjectPath,
    url: String,
    runtime: tokio::runtime::Handle,
}

fn store_error(e: object_store::Error) -> io::Error {
    match e {
        object_store::Error::NotFound { path, .. } => {
            io::Error::new(io::ErrorKind::NotFound, format!("no blob at {path}"))
        }
        other => io::Error::other(other.to_string()),
    }
}

impl ObjectBlobs {
    /// The store `url` names, with its settings from the environment; its futures run
    /// on `runtime`. Writes and deletes a probe object, so that a wrong bucket, endpoint
    /// or credential stops start-up instead of the first upload.
    pub fn open(url: &str, runtime: tokio::runtime::Handle) -> Result<Self, ObjectStoreError> {
        Self::open_with(url, std::env::vars(), runtime)
    }

    /// [`open`](Self::open) with `vars` in place of the process environment (the
    /// provider's `AWS_*`, `GOOGLE_*` or `AZURE_*` variables; others are ignored).
    pub fn open_with(
        url: &str,
        vars: impl IntoIterator<Item = (String, String)>,
        runtime: tokio::runtime::Handle,
    ) -> Result<Self, ObjectStoreError> {
        let bad_url = |why: String| ObjectStoreError::Url(url.to_string(), why);
        let parsed = url::Url::parse(url).map_err(|e| bad_url(e.to_string()))?;
        let (scheme, path) =
            ObjectStoreScheme::parse(&parsed).map_err(|e| bad_url(e.to_string()))?;
        let unreachable = |e: &dyn std::fmt::Display| {
            ObjectStoreError::Unreachable(url.to_string(), e.to_string())
        };
        let vars: Vec<(String, String)> = vars.into_iter().collect();
        // A provider's settings: its variables, named as its documentation names them.
        let settings = |prefix: &'static str| {
            vars.iter()
                .filter(move |(k, _)| k.starts_with(prefix))
                .map(|(k, v)| (k.to_ascii_lowercase(), v.clone()))
        };
        // The provider's variables first and the URL last, so that the bucket named on
        // the command line wins over a stray variable's (`object_store::parse_url_opts`
        // applies them the other way round).
        macro_rules! build {
            ($builder:ty, $prefix:literal) => {{
                let b = settings($prefix).fold(<$builder>::new(), |b, (key, value)| {
                    match key.parse() {
                        Ok(key) => b.with_config(key, value),
                        Err(_) => b,
                    }
                });
                Arc::new(b.with_url(url).build().map_err(|e| unreachable(&e))?)
            }};
        }
        let store: Arc<dyn ObjectStore> = match scheme {
            ObjectStoreScheme::AmazonS3 => build!(object_store::aws::AmazonS3Builder, "AWS_"),
            ObjectStoreScheme::GoogleCloudStorage => {
                build!(object_store::gcp::GoogleCloudStorageBuilder, "GOOGLE_")
            }
            ObjectStoreScheme::MicrosoftAzure => {
                build!(object_store::azure::MicrosoftAzureBuilder, "AZURE_")
            }
            other => return Err(bad_url(format!("{other:?} is not an object store"))),
        };
        let prefix = ObjectPath::parse(path.as_ref()).map_err(|e| bad_url(e.to_string()))?;
        let blobs = Self {
            store,
            prefix,
            url: url.to_string(),
            runtime,
        };
        let probe = format!(".cohort-probe-{}", uuid::Uuid::new_v4().simple());
        blobs
            .put(&probe, b"cohort")
            .and_then(|_| blobs.remove(&probe))
            .map_err(|e| unreachable(&e))?;
        Ok(blobs)
    }

    /// The URL it was opened with.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn location(&self, relative: &str) -> io::Result<ObjectPath> {
        check_relative(relative)?;
        let mut parts: Vec<String> = self
            .prefix
            .parts()
            .map(|p| p.as_ref().to_string())
            .collect();
        parts.extend(relative.split('/').map(str::to_string));
        ObjectPath::parse(parts.join("/")).map_err(|e| invalid(e.to_string()))
    }

    /// Runs `work` to its end on the store's runtime, from a thread that is not one of
    /// its workers.
    fn block<T>(&self, work: impl std::future::Future<Output = T>) -> T {
        self.runtime.block_on(work)
    }

    /// Writes `bytes` at `relative` in one PUT: visible whole or not at all.
    pub fn put(&self, relative: &str, bytes: &[u8]) -> io::Result<()> {
        let location = self.location(relative)?;
        let payload = PutPayload::from(bytes.to_vec());
        self.block(self.store.put(&location, payload))
            .map(drop)
            .map_err(store_error)
    }

    /// Starts a multipart upload at `relative`.
    pub fn writer(&self, relative: &str) -> io::Result<ObjectWriter> {
        let location = self.location(relative)?;
        let upload = self
            .block(self.store.put_multipart(&location))
            .map_err(store_error)?;
        Ok(ObjectWriter {
            location,
            upload: Some(WriteMultipart::new_with_chunk_size(upload, PART_BYTES)),
            runtime: self.runtime.clone(),
        })
    }

    /// Reads the blob at `relative`.
    pub fn get(&self, relative: &str) -> io::Result<Vec<u8>> {
        let location = self.location(relative)?;
        self.block(async {
            let found = self.store.get(&location).await?;
            found.bytes().await
        })
        .map(|b| b.to_vec())
        .map_err(store_error)
    }

    /// Deletes the blob at `relative`.
    pub fn remove(&self, relative: &str) -> io::Result<()> {
        let location = self.location(relative)?;
        self.block(self.store.delete(&location))
            .map_err(store_error)
    }
}

/// A multipart upload in progress; see [`ObjectBlobs::writer`].
pub struct ObjectWriter {
    location: ObjectPath,
    upload: Option<WriteMultipart>,
    runtime: tokio::runtime::Handle,
}

impl std::fmt::Debug for ObjectWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectWriter")
            .field("path", &self.location)
            .finish_non_exhaustive()
    }
}

impl ObjectWriter {
    fn upload(&mut self) -> io::Result<&mut WriteMultipart> {
        self.upload
            .as_mut()
            .ok_or_else(|| io::Error::other("blob writer already committed"))
    }

    /// Appends `chunk`, waiting while [`PARTS_IN_FLIGHT`] parts are uploading.
    pub fn write(&mut self, chunk: &[u8]) -> io::Result<()> {
        let runtime = self.runtime.clone();
        let upload = self.upload()?;
        runtime
            .block_on(upload.wait_for_capacity(PARTS_IN_FLIGHT))
            .map_err(store_error)?;
        // Full parts start uploading as tasks of the store's runtime.
        let _inside = runtime.enter();
        upload.write(chunk);
        Ok(())
    }

    /// Uploads the last part and completes the upload: the object appears whole.
    pub fn commit(mut self) -> io::Result<()> {
        let upload = self
            .upload
            .take()
            .ok_or_else(|| io::Error::other("blob writer already committed"))?;
        let _inside = self.runtime.enter();
        self.runtime
            .block_on(upload.finish())
            .map(drop)
            .map_err(store_error)
    }
}

impl Drop for ObjectWriter {
    fn drop(&mut self) {
        // Never completed: abort the upload so that its parts do not linger in the
        // bucket. Dropped anywhere (an async handler that gave up, too), so the abort
        // runs as a task rather than here.
        if let Some(upload) = self.upload.take() {
            self.runtime.spawn(async move {
                let _ = upload.abort().await;
            });
        }
    }
}
