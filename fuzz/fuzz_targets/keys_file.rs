//! cargo-fuzz target `keys_file`: the checks of [`checks::run`] on each input.
#![no_main]

#[path = "../../tests/fuzz/checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::run("keys_file", data));
