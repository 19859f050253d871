#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cohort_fuzz::model_file_decode(data));
