//! A Kafka message's headers, read as bytes. rdkafka's own reader (`Headers::iter`,
//! `try_get`) unwraps each header name as UTF-8 and panics on one that is not, which any
//! producer can write (names are bytes on the wire): one such message would stop the consumer
//! on every instance in turn. This reads them through librdkafka's C API, the way rdkafka does,
//! but hands the names over as bytes, for the caller to check.
//!
//! The crate's only `unsafe` code (the rest forbids it): three calls into librdkafka and the
//! views of the memory they return, which belongs to the message.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_void, CStr};
use std::ptr;

use rdkafka::bindings::{
    rd_kafka_header_get_all, rd_kafka_headers_t, rd_kafka_message_headers, rd_kafka_resp_err_t,
};
use rdkafka::message::BorrowedMessage;

/// One header as it came: name and value as bytes (no value for a null one).
pub(super) struct RawHeader<'m> {
    pub name: &'m [u8],
    pub value: Option<&'m [u8]>,
}

/// Every header of `m`, in order; none when it has none.
pub(super) fn raw_headers<'m>(m: &'m BorrowedMessage<'_>) -> Vec<RawHeader<'m>> {
    let mut headers: *mut rd_kafka_headers_t = ptr::null_mut();
    // SAFETY: `m.ptr()` is the live message librdkafka handed out, kept alive by `m`; the call
    // only writes `headers`, a pointer into the message (rdkafka's `headers()` does the same).
    let err = unsafe { rd_kafka_message_headers(m.ptr(), &mut headers) };
    if err != rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || headers.is_null() {
        return Vec::new();
    }
    let mut out = Vec::new();
    for idx in 0.. {
        let mut name: *const c_char = ptr::null();
        let mut value: *const c_void = ptr::null();
        let mut size = 0usize;
        // SAFETY: `headers` belongs to the message, alive for 'm; the call writes only the
        // three out-parameters, and returns an error past the last header.
        let err =
            unsafe { rd_kafka_header_get_all(headers, idx, &mut name, &mut value, &mut size) };
        if err != rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
            break;
        }
        if name.is_null() {
            continue;
        }
        // SAFETY: librdkafka keeps each name NUL-terminated in the message's memory, alive and
        // unchanged for 'm.
        let name = unsafe { CStr::from_ptr(name) }.to_bytes();
        let value = (!value.is_null()).then(|| {
            // SAFETY: `value` points at `size` bytes of the message's memory, alive for 'm.
            unsafe { std::slice::from_raw_parts(value.cast::<u8>(), size) }
        });
        out.push(RawHeader { name, value });
    }
    out
}
