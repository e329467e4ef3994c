//! gRPC through the gateway. Calls pass through like any HTTP/2 request (trailers and all, see
//! [`crate::upstream`]); on an idempotent route a unary call carrying `idempotency-key` in its
//! metadata is deduplicated like a POST, its trailers (`grpc-status`) stored and replayed.
//!
//! Two translations live here, both ways between gRPC status codes and HTTP statuses:
//! - what the gateway says itself ([`crate::problem::Problem`]) reaches a gRPC client as a
//!   Trailers-Only answer (`grpc-status`, `grpc-message`), which gRPC libraries read, instead
//!   of problem+json, which they report as a protocol error;
//! - a stored answer's `grpc-status` counts as the HTTP status it stands for when the core
//!   decides whether the call ran ([`effective_status`]): `UNAVAILABLE` releases the key as a
//!   503 does, `UNAUTHENTICATED` as a 401, and so on.

use http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};

use crate::store::StoredResponse;

pub const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
pub const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
/// gRPC's server pushback: how long a client's retry policy should wait.
pub const GRPC_RETRY_PUSHBACK: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// gRPC status codes the gateway answers with (google.rpc.Code).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Code {
    Unknown = 2,
    InvalidArgument = 3,
    DeadlineExceeded = 4,
    ResourceExhausted = 8,
    FailedPrecondition = 9,
    Aborted = 10,
    Internal = 13,
    Unavailable = 14,
    Unauthenticated = 16,
}

/// A gRPC request or response: `Content-Type: application/grpc`, `application/grpc+proto`, ...
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers.get(header::CONTENT_TYPE).is_some_and(is_grpc_type)
}

fn is_grpc_type(content_type: &HeaderValue) -> bool {
    let v = content_type.as_bytes();
    v.len() >= 16
        && v[..16].eq_ignore_ascii_case(b"application/grpc")
        && matches!(v.get(16), None | Some(b'+' | b';'))
}

/// The status the core judges a stored answer by: for a gRPC answer, the HTTP status its
/// `grpc-status` stands for (the mapping grpc-gateway and Google's APIs use); for anything else,
/// and for a gRPC answer whose status went unseen (its body too large to keep, so its trailers
/// streamed past), its own status: the call ran.
pub fn effective_status(response: &StoredResponse) -> u16 {
    let status = response.status.as_u16();
    if status != 200 || !is_grpc_answer(response) {
        return status;
    }
    // In the trailers, or in the head of a Trailers-Only answer.
    match grpc_status(response) {
        Some(code) => http_status_of(code),
        None => status,
    }
}

/// The `grpc-status` of a gRPC answer: in its trailers, or in the head of a Trailers-Only one.
/// One that is there but not a number reads as 2 (UNKNOWN).
fn grpc_status(response: &StoredResponse) -> Option<u16> {
    let (_, value) = response
        .trailers
        .iter()
        .chain(&response.headers)
        .find(|(n, _)| *n == GRPC_STATUS)?;
    Some(
        value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u16>().ok())
            .unwrap_or(2),
    )
}

/// A gRPC answer read to its end without a `grpc-status`: the call was cut off (an upstream or
/// proxy that reset the stream with NO_ERROR, which reads as a clean end), so whether it ran is
/// unknown.
pub fn ended_without_status(response: &StoredResponse) -> bool {
    response.body_kept
        && response.status == StatusCode::OK
        && is_grpc_answer(response)
        && grpc_status(response).is_none()
}

/// A stored answer with a gRPC content type.
fn is_grpc_answer(response: &StoredResponse) -> bool {
    response
        .headers
        .iter()
        .any(|(n, v)| n == header::CONTENT_TYPE && is_grpc_type(v))
}

/// google.rpc.Code to HTTP, as in google/rpc/code.proto.
fn http_status_of(code: u16) -> u16 {
    match code {
        0 => 200,
        1 => 499,
        3 | 9 | 11 => 400,
        4 => 504,
        5 => 404,
        6 | 10 => 409,
        7 => 403,
        8 => 429,
        12 => 501,
        14 => 503,
        16 => 401,
        // 2 UNKNOWN, 13 INTERNAL, 15 DATA_LOSS, and codes that do not exist.
        _ => 500,
    }
}

/// `grpc-message` is percent-encoded: everything outside printable ASCII, and `%`.
const MESSAGE_ESCAPES: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS.add(b'%');

/// A Trailers-Only answer: status 200, the gRPC status and message in the head, no body.
pub fn trailers_only(code: Code, message: &str, retry_after_ms: Option<u64>) -> http::Response<()> {
    let mut resp = http::Response::new(());
    *resp.status_mut() = StatusCode::OK;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    h.insert(GRPC_STATUS, HeaderValue::from(code as u16));
    let message = percent_encoding::utf8_percent_encode(message, MESSAGE_ESCAPES).to_string();
    if let Ok(v) = HeaderValue::from_str(&message) {
        h.insert(GRPC_MESSAGE, v);
    }
    if let Some(ms) = retry_after_ms {
        h.insert(GRPC_RETRY_PUSHBACK, HeaderValue::from(ms));
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn stored(
        headers: &[(&'static str, &'static str)],
        trailers: &[(&'static str, &'static str)],
    ) -> StoredResponse {
        let f = |l: &[(&'static str, &'static str)]| {
            l.iter()
                .map(|(n, v)| (HeaderName::from_static(n), HeaderValue::from_static(v)))
                .collect()
        };
        StoredResponse {
            status: StatusCode::OK,
            headers: f(headers),
            trailers: f(trailers),
            body: Bytes::new(),
            body_kept: true,
            completed_ms: 0,
            link: None,
        }
    }

    #[test]
    fn grpc_content_types_are_recognised_and_lookalikes_are_not() {
        let h = |v: &'static str| {
            let mut m = HeaderMap::new();
            m.insert(header::CONTENT_TYPE, HeaderValue::from_static(v));
            m
        };
        assert!(is_grpc(&h("application/grpc")));
        assert!(is_grpc(&h("application/grpc+proto")));
        assert!(is_grpc(&h("Application/GRPC;charset=x")));
        assert!(!is_grpc(&h("application/grpc-web")));
        assert!(!is_grpc(&h("application/grpcx")));
        assert!(!is_grpc(&h("application/json")));
        assert!(!is_grpc(&HeaderMap::new()));
    }

    #[test]
    fn a_grpc_answer_is_judged_by_its_grpc_status() {
        let ct = ("content-type", "application/grpc");
        assert_eq!(
            effective_status(&stored(&[ct], &[("grpc-status", "0")])),
            200
        );
        assert_eq!(
            effective_status(&stored(&[ct], &[("grpc-status", "14")])),
            503
        );
        assert_eq!(
            effective_status(&stored(&[ct], &[("grpc-status", "16")])),
            401
        );
        assert_eq!(
            effective_status(&stored(&[ct], &[("grpc-status", "8")])),
            429
        );
        assert_eq!(
            effective_status(&stored(&[ct], &[("grpc-status", "6")])),
            409
        );
        // Trailers-Only: the status in the head.
        assert_eq!(
            effective_status(&stored(&[ct, ("grpc-status", "5")], &[])),
            404
        );
        // None seen: judged by the HTTP status (the core never stores a complete answer so, see
        // `ended_without_status`).
        assert_eq!(effective_status(&stored(&[ct], &[])), 200);
        assert!(ended_without_status(&stored(&[ct], &[])));
        assert!(!ended_without_status(&stored(
            &[ct],
            &[("grpc-status", "0")]
        )));
        let mut unkept = stored(&[ct], &[]);
        unkept.body_kept = false;
        assert!(
            !ended_without_status(&unkept),
            "its trailers streamed past unseen"
        );
        // One that does not exist, or is not a number: a server error.
        assert_eq!(
            effective_status(&stored(&[ct], &[("grpc-status", "x")])),
            500
        );
        assert_eq!(
            effective_status(&stored(&[ct], &[("grpc-status", "99")])),
            500
        );
        // Not gRPC: its own status, whatever it carries.
        assert_eq!(
            effective_status(&stored(
                &[("content-type", "application/json")],
                &[("grpc-status", "14")]
            )),
            200
        );
    }

    #[test]
    fn the_message_is_percent_encoded() {
        let resp = trailers_only(Code::Aborted, "100% \"in\" flight é", Some(1000));
        assert_eq!(resp.headers()[GRPC_STATUS], "10");
        assert_eq!(resp.headers()[GRPC_MESSAGE], "100%25 \"in\" flight %C3%A9");
        assert_eq!(resp.headers()[GRPC_RETRY_PUSHBACK], "1000");
    }
}
