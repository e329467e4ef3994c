//! `idemgate`: see the library's documentation and the README.

// glibc's malloc was a visible share of the gateway's CPU under load (arena locking,
// consolidation); mimalloc's thread-local heaps cost a fraction of it (bench/README.md,
// "bench/run").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    // Test builds only (`--features failpoints`): the fault injections `FAILPOINTS` names.
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    idemgate::cli::main()
}
