//! This client's long-term identity: an Ed25519 key pair kept in the state directory
//! (`identity.key`, the 32-byte seed, readable by its owner only), made on first run and
//! registered with the coordinator. Its fingerprint is printed at start, so that a site
//! can compare it with the one the coordinator's admin sees: that out-of-band check is
//! what tells a real site from an identity a coordinator made up.

use std::path::Path;

use cohort_aggregation::secagg::identity::{Identity, SEED_BYTES};

/// File name of the identity seed in the state directory.
pub const IDENTITY_FILE: &str = "identity.key";

/// Why the identity could not be loaded or made.
#[derive(Debug, thiserror::Error)]
pub enum IdentityFileError {
    /// Reading or writing the file failed.
    #[error("identity file `{path}`: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The file holds something else than a seed.
    #[error(
        "identity file `{0}` is not a 32-byte identity seed (delete it only if the admin resets this client's identity)"
    )]
    Malformed(std::path::PathBuf),
    /// No randomness for a new identity.
    #[error(transparent)]
    Identity(#[from] cohort_aggregation::secagg::identity::IdentityError),
}

/// The identity stored in `dir`, made and stored first if there is none.
pub fn load_or_create(dir: &Path) -> Result<Identity, IdentityFileError> {
    let path = dir.join(IDENTITY_FILE);
    let io = |source| IdentityFileError::Io {
        path: path.clone(),
        source,
    };
    match std::fs::read(&path) {
        Ok(bytes) => {
            let seed = zeroize::Zeroizing::new(bytes);
            if seed.len() != SEED_BYTES {
                return Err(IdentityFileError::Malformed(path));
            }
            Identity::from_seed(&seed).map_err(|_| IdentityFileError::Malformed(path))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let identity = Identity::generate()?;
            std::fs::create_dir_all(dir).map_err(io)?;
            let tmp = dir.join("identity.key.tmp");
            let mut options = std::fs::OpenOptions::new();
            options.write(true).create(true).truncate(true);
            #[cfg(unix)]
            {
                use std::os::unix::fs::OpenOptionsExt;
                options.mode(0o600);
            }
            let write = || -> std::io::Result<()> {
                use std::io::Write;
                let mut f = options.open(&tmp)?;
                f.write_all(identity.seed())?;
                f.sync_all()?;
                std::fs::rename(&tmp, &path)
            };
            write().map_err(io)?;
            Ok(identity)
        }
        Err(e) => Err(io(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_identity_survives_a_restart_and_is_private() {
        let dir = tempfile::tempdir().unwrap();
        let first = load_or_create(dir.path()).unwrap();
        let again = load_or_create(dir.path()).unwrap();
        assert_eq!(first.public(), again.public());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join(IDENTITY_FILE))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        let other = tempfile::tempdir().unwrap();
        assert_ne!(
            load_or_create(other.path()).unwrap().public(),
            first.public()
        );
    }

    #[test]
    fn a_damaged_identity_file_is_an_error_not_a_new_identity() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(IDENTITY_FILE), b"short").unwrap();
        assert!(matches!(
            load_or_create(dir.path()),
            Err(IdentityFileError::Malformed(_))
        ));
        // Still there: nothing overwrote it.
        assert_eq!(
            std::fs::read(dir.path().join(IDENTITY_FILE)).unwrap(),
            b"short"
        );
    }
}
