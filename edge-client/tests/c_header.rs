//! The committed C header (`include/cohort_edge.h`) is exactly what cbindgen generates
//! from the C API today, so a C program never compiles against a stale declaration.
//! `COHORT_UPDATE_HEADER=1` rewrites it.

use std::path::Path;

#[test]
fn the_committed_header_matches_the_c_api() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).unwrap();
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen reads the crate")
        .write(&mut generated);
    let path = crate_dir.join("include/cohort_edge.h");
    if std::env::var_os("COHORT_UPDATE_HEADER").is_some() {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/cohort_edge.h is stale: run COHORT_UPDATE_HEADER=1 cargo test -p cohort-edge --test c_header\n\
         generated:\n{}",
        String::from_utf8_lossy(&generated)
    );
}
