//! `idemgate`: see the library's documentation and the README.

fn main() -> std::process::ExitCode {
    idemgate::cli::main()
}
