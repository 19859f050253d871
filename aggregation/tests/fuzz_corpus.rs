//! Every committed fuzz corpus input (`fuzz/corpus/<target>/`) replayed through its
//! target's harness on stable Rust: the harness bodies are `fuzz/src/lib.rs` itself, so a
//! decoder that panics, or breaks a round-trip invariant, on any input the fuzzers kept
//! fails here too, without nightly or libFuzzer.

#[allow(dead_code, missing_docs)]
#[path = "../../fuzz/src/lib.rs"]
mod harness;

use std::path::PathBuf;

use cohort_aggregation::secagg::ServerStage;

/// Runs `harness` on every file of `target`'s corpus and names each file that panicked.
fn replay(target: &str, harness: fn(&[u8])) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .collect();
    files.sort();
    assert!(
        files.len() >= 5,
        "{} holds only {} inputs",
        dir.display(),
        files.len()
    );
    let mut failed = Vec::new();
    for file in &files {
        let bytes = std::fs::read(file).expect("a corpus file");
        if std::panic::catch_unwind(|| harness(&bytes)).is_err() {
            failed.push(file.display().to_string());
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} {target} inputs failed:\n{}",
        failed.len(),
        files.len(),
        failed.join("\n")
    );
}

#[test]
fn wire_decode_corpus_decodes_without_panics_and_round_trips() {
    replay("wire_decode", harness::wire_decode);
}

#[test]
fn model_file_corpus_decodes_without_panics_and_round_trips() {
    replay("model_file_decode", harness::model_file_decode);
}

#[test]
fn secagg_message_corpus_decodes_without_panics_and_round_trips() {
    replay("secagg_messages", harness::secagg_messages);
}

#[test]
fn secagg_round_corpus_scripts_never_panic_the_server() {
    replay("secagg_round", harness::secagg_round);
}

/// The round harness is only worth its fuzzing if honest scripts really reach the end.
#[test]
fn honest_round_scripts_in_the_corpus_finish_the_round() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/secagg_round");
    for seed in [
        "seed-honest",
        "seed-external-sum",
        "seed-honest-consistency-check",
        "seed-external-sum-consistency-check",
    ] {
        let script = std::fs::read(dir.join(seed)).expect("a committed seed");
        assert_eq!(
            harness::secagg_round_stage(&script),
            ServerStage::Finished,
            "{seed}"
        );
    }
}
