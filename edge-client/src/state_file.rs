//! Vectors a client keeps in its state directory between rounds and across restarts
//! (the error-feedback residual, the personal layers or model): little-endian `f32`s,
//! replaced whole (written beside, synced, renamed), so a crash leaves the old file or
//! the new one and never half of either.

use std::io::Write;
use std::path::Path;

/// The vector in `path`; `None` when there is none yet, or when what is there is not
/// `len` finite values (another model's, or damaged): the caller starts afresh.
pub fn read_f32s(path: &Path, len: usize) -> std::io::Result<Option<Vec<f32>>> {
    match std::fs::read(path) {
        Ok(bytes) => {
            let values: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let usable = bytes.len() == 4 * len
                && values.len() == len
                && values.iter().all(|v| v.is_finite());
            Ok(usable.then_some(values))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Replaces the vector in `path` with `values`, creating its directory.
pub fn write_f32s(path: &Path, values: &[f32]) -> std::io::Result<()> {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vector_survives_and_a_wrong_length_or_damage_reads_as_none() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a").join("v.f32");
        assert_eq!(read_f32s(&path, 3).unwrap(), None);
        write_f32s(&path, &[1.0, -2.5, 3.0]).unwrap();
        assert_eq!(read_f32s(&path, 3).unwrap(), Some(vec![1.0, -2.5, 3.0]));
        assert_eq!(read_f32s(&path, 4).unwrap(), None);
        std::fs::write(&path, [0u8, 0, 0xc0, 0x7f, 0, 0, 0, 0, 0, 0, 0]).unwrap();
        assert_eq!(read_f32s(&path, 2).unwrap(), None);
    }
}
