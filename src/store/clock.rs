//! The wall clock records are written with: milliseconds since the Unix epoch, shared by
//! every instance of a shared store (within `store.max_clock_skew`), and a test's offset of it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Wall-clock milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    #[cfg(feature = "failpoints")]
    let now = now.saturating_add_signed(clock_offset_ms());
    now
}

/// A test's clock offset for this process (`IDEMGATE_TEST_CLOCK_OFFSET_MS`, in ms, signed): a
/// gateway whose clock is ahead of or behind the others', in the tests of clock skew. Only in
/// builds with the `failpoints` feature (the tests'); nothing of it in others.
#[cfg(feature = "failpoints")]
fn clock_offset_ms() -> i64 {
    static OFFSET: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    *OFFSET.get_or_init(|| {
        std::env::var("IDEMGATE_TEST_CLOCK_OFFSET_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    })
}

/// `d` in whole milliseconds, saturating.
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// `now_ms() + d`, saturating.
pub fn ms_after(d: Duration) -> u64 {
    now_ms().saturating_add(d.as_millis().min(u64::MAX as u128) as u64)
}
