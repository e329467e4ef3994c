//! The boxed error that crosses the boundaries every layer shares with hyper, the bodies and
//! the stores' clients: what failed is kept for the log, while each layer's own typed errors
//! (`ConfigError`, `StoreError`, `UpstreamError`, `Problem`, ...) say what it means.

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
