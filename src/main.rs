//! `idemgate`: see the library's documentation and the README.

// glibc's malloc showed up at ~10% of the gateway's CPU under load (arena locking, consolidation);
// mimalloc's thread-local heaps cost a fraction of that.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    idemgate::cli::main()
}
