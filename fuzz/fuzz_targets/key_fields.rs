//! cargo-fuzz target `key_fields`: the checks of [`checks::run`] on each input.
#![no_main]

#[path = "../../tests/fuzz/checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::run("key_fields", data));
