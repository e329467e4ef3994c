//! Phase `decode`: a request body's `Content-Encoding` undone for its key and fingerprint, so
//! that the same content compressed twice (gzip writes the time into its header) is the same
//! request. The body is forwarded as it came; only the gateway reads the decoded bytes.
//!
//! Bounded: at most two codings stacked, each undone into a buffer of at most `max_body` (a
//! decompression bomb is refused with `413` once it passes it, before more is decoded), counted
//! in the memory budget; bytes after a coded stream are refused, not ignored. Decoding is synchronous (on the worker, as the
//! canonical JSON reading of a body is: at most two passes over `max_body` of output), so no
//! more bodies are being decoded at once than there are worker threads, each decoder's window
//! bounded by its format (gzip and deflate 32 KiB, br 16 MiB) or by the gateway (zstd 8 MiB,
//! what RFC 9659 asks of HTTP decoders).

use std::cell::Cell;
use std::io::{BufRead, Read};

use bytes::Bytes;
use http::HeaderMap;

use crate::body::{Lease, OverBudget};

/// The codings the gateway decodes, as `Accept-Encoding` lists them.
pub const DECODED: &str = "gzip, deflate, br, zstd";

/// Why a body could not be decoded.
#[derive(Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// A coding the gateway cannot decode (its name, when it is a short token).
    Unsupported(Option<String>),
    /// More codings stacked than the gateway undoes.
    TooMany,
    /// The bytes are not what the coding says.
    Corrupt(&'static str),
    /// The decoded body passes `max_body`.
    TooLarge,
    /// The decoded body does not fit in the memory budget.
    OverBudget,
}

/// Codings undone in one body at most: one is what clients send (two are legal, and seen); more
/// would only stack decoders, each with its own state, for a hostile client.
const MAX_CODINGS: usize = 2;

/// The body's content: `Ok(None)` when it is empty or has no coding but `identity` (the body is
/// its own content), else the decoded bytes, counted in `lease`.
pub fn decode(
    headers: &HeaderMap,
    body: &[u8],
    limit: usize,
    lease: &mut Lease,
) -> Result<Option<Bytes>, DecodeError> {
    if body.is_empty() {
        return Ok(None);
    }
    let codings = codings(headers)?;
    // Listed in the order they were applied: the last one is undone first. Each layer is read
    // from a slice, so that what its decoder leaves unread is known (bytes after a stream
    // would be content the fingerprint never saw), and into a buffer bounded by `limit`.
    let mut content: Option<Vec<u8>> = None;
    for coding in codings.iter().rev() {
        let input = content.as_deref().unwrap_or(body);
        let read = Cell::new(0);
        let mut decoder = coding.decoder(Tracked {
            data: input,
            read: &read,
        })?;
        let out = read_within(&mut decoder, limit, lease)?;
        let mut probe = [0u8; 1];
        if !matches!(decoder.read(&mut probe), Ok(0)) || read.get() != input.len() {
            return Err(DecodeError::Corrupt("bytes after the coded stream"));
        }
        drop(decoder);
        content = Some(out);
    }
    Ok(content.map(Bytes::from))
}

/// The codings of `Content-Encoding`, every field in order, `identity` left out.
fn codings(headers: &HeaderMap) -> Result<Vec<Coding>, DecodeError> {
    let mut codings = Vec::new();
    for value in headers.get_all(http::header::CONTENT_ENCODING) {
        let Ok(value) = value.to_str() else {
            return Err(DecodeError::Unsupported(None));
        };
        for coding in value.split(',').map(str::trim).filter(|c| !c.is_empty()) {
            let coding = Coding::of(coding)?;
            if coding != Coding::Identity {
                if codings.len() == MAX_CODINGS {
                    return Err(DecodeError::TooMany);
                }
                codings.push(coding);
            }
        }
    }
    Ok(codings)
}

/// A layer's input: a slice, and how much of it its decoder took.
struct Tracked<'a> {
    data: &'a [u8],
    read: &'a Cell<usize>,
}

impl Read for Tracked<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let rest = self.fill_buf()?;
        let n = rest.len().min(buf.len());
        buf[..n].copy_from_slice(&rest[..n]);
        self.consume(n);
        Ok(n)
    }
}

impl BufRead for Tracked<'_> {
    fn fill_buf(&mut self) -> std::io::Result<&[u8]> {
        Ok(self.data.get(self.read.get()..).unwrap_or_default())
    }

    fn consume(&mut self, n: usize) {
        self.read
            .set(self.read.get().saturating_add(n).min(self.data.len()));
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Coding {
    Identity,
    Gzip,
    Deflate,
    Brotli,
    Zstd,
}

/// zstd's largest window: 8 MiB (RFC 9659, section 3).
const ZSTD_WINDOW_LOG_MAX: u32 = 23;

impl Coding {
    fn of(name: &str) -> Result<Coding, DecodeError> {
        Ok(match name.to_ascii_lowercase().as_str() {
            "identity" => Coding::Identity,
            "gzip" | "x-gzip" => Coding::Gzip,
            "deflate" => Coding::Deflate,
            "br" => Coding::Brotli,
            "zstd" => Coding::Zstd,
            _ => {
                let shown = (name.len() <= 32
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"-_.+".contains(&b)))
                .then(|| name.to_string());
                return Err(DecodeError::Unsupported(shown));
            }
        })
    }

    fn decoder<'a>(self, inner: impl BufRead + 'a) -> Result<Box<dyn Read + 'a>, DecodeError> {
        Ok(match self {
            Coding::Identity => Box::new(inner),
            // Several members are one body (RFC 1952, 2.2).
            Coding::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(inner)),
            // HTTP's deflate is the zlib format (RFC 9110, 8.4.1.2). The bufread decoders take
            // from their input only what their stream holds.
            Coding::Deflate => Box::new(flate2::bufread::ZlibDecoder::new(inner)),
            // Reads ahead into its own buffer, and says so on the read after its end when some
            // of that is left.
            Coding::Brotli => Box::new(brotli_decompressor::Decompressor::new(inner, 4096)),
            Coding::Zstd => {
                let mut decoder = zstd::stream::read::Decoder::with_buffer(inner)
                    .map_err(|_| DecodeError::Corrupt("zstd"))?;
                decoder
                    .window_log_max(ZSTD_WINDOW_LOG_MAX)
                    .map_err(|_| DecodeError::Corrupt("zstd"))?;
                Box::new(decoder)
            }
        })
    }
}

/// Reads `reader` to its end, refusing the body as soon as it passes `limit` bytes, and counting
/// what it holds in `lease`.
fn read_within(
    reader: &mut dyn Read,
    limit: usize,
    lease: &mut Lease,
) -> Result<Vec<u8>, DecodeError> {
    let mut out = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let n = match reader.read(&mut chunk) {
            Ok(0) => return Ok(out),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return Err(DecodeError::Corrupt("the coded bytes")),
        };
        if out.len() + n > limit {
            return Err(DecodeError::TooLarge);
        }
        let before = out.capacity();
        out.extend_from_slice(&chunk[..n]);
        lease
            .take(out.capacity() - before)
            .map_err(|OverBudget| DecodeError::OverBudget)?;
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;
    use crate::body::Budget;
    use prometheus_client::metrics::gauge::Gauge;

    fn lease() -> Lease {
        Budget::new(1 << 30, Gauge::default()).lease()
    }

    fn headers(coding: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(http::header::CONTENT_ENCODING, coding.parse().unwrap());
        h
    }

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn zlib(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn brotli(data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut w = ::brotli::CompressorWriter::new(&mut out, 4096, 5, 22);
        w.write_all(data).unwrap();
        drop(w);
        out
    }

    fn zstd(data: &[u8]) -> Vec<u8> {
        zstd::stream::encode_all(data, 3).unwrap()
    }

    fn decoded(coding: &str, body: &[u8], limit: usize) -> Result<Option<Bytes>, DecodeError> {
        decode(&headers(coding), body, limit, &mut lease())
    }

    #[test]
    fn each_coding_gives_the_content_back() {
        let content = br#"{"amount":1000}"#;
        for (coding, body) in [
            ("gzip", gzip(content)),
            ("x-gzip", gzip(content)),
            ("GZIP", gzip(content)),
            ("deflate", zlib(content)),
            ("br", brotli(content)),
            ("zstd", zstd(content)),
            ("gzip, br", brotli(&gzip(content))),
            ("identity, zstd", zstd(content)),
        ] {
            let got = decoded(coding, &body, 1 << 20).unwrap().unwrap();
            assert_eq!(&got[..], content, "{coding}");
        }
        assert_eq!(decoded("identity", content, 1 << 20), Ok(None));
        assert_eq!(
            decode(&HeaderMap::new(), content, 1, &mut lease()),
            Ok(None)
        );
    }

    #[test]
    fn a_bomb_stops_at_the_limit() {
        let bomb = gzip(&vec![0u8; 8 << 20]);
        assert!(bomb.len() < 16 * 1024, "{}", bomb.len());
        assert_eq!(decoded("gzip", &bomb, 1 << 20), Err(DecodeError::TooLarge));
        let nested = gzip(&bomb);
        assert_eq!(
            decoded("gzip, gzip", &nested, 1 << 20),
            Err(DecodeError::TooLarge)
        );
        // An outer layer that expands past the limit into nothing: stopped there too.
        let mut empties = Vec::new();
        for _ in 0..60_000 {
            empties.extend_from_slice(&gzip(b""));
        }
        let hidden = gzip(&empties);
        assert!(hidden.len() < 64 * 1024, "{}", hidden.len());
        assert_eq!(
            decoded("gzip, gzip", &hidden, 1 << 20),
            Err(DecodeError::TooLarge)
        );
        assert_eq!(
            decoded("gzip", &bomb, 8 << 20).unwrap().unwrap().len(),
            8 << 20
        );
    }

    #[test]
    fn at_most_two_codings_and_an_empty_body_is_empty() {
        let content = b"{}";
        assert_eq!(
            decoded("gzip, gzip, gzip", &gzip(&gzip(&gzip(content))), 100),
            Err(DecodeError::TooMany)
        );
        let many = vec!["br"; 8000].join(",");
        assert_eq!(decoded(&many, b"x", 100), Err(DecodeError::TooMany));
        assert_eq!(
            decoded("identity, gzip, identity", &gzip(content), 100)
                .unwrap()
                .unwrap(),
            &content[..]
        );
        for coding in [
            "gzip",
            "deflate",
            "br",
            "zstd",
            "compress",
            "gzip, gzip, gzip",
        ] {
            assert_eq!(decoded(coding, b"", 100), Ok(None), "{coding}");
        }
    }

    #[test]
    fn unknown_codings_and_broken_bytes_are_refused() {
        assert_eq!(
            decoded("compress", b"x", 100),
            Err(DecodeError::Unsupported(Some("compress".into())))
        );
        assert_eq!(
            decoded(&"x".repeat(40), b"x", 100),
            Err(DecodeError::Unsupported(None))
        );
        for coding in ["gzip", "deflate", "br", "zstd"] {
            assert!(
                matches!(
                    decoded(coding, b"not compressed at all", 100),
                    Err(DecodeError::Corrupt(_))
                ),
                "{coding}"
            );
        }
        for (coding, body) in [
            ("gzip", gzip(b"{}")),
            ("deflate", zlib(b"{}")),
            ("br", brotli(b"{}")),
            ("zstd", zstd(b"{}")),
            ("gzip, br", brotli(&gzip(b"{}"))),
        ] {
            let mut junk = body.clone();
            junk.extend_from_slice(b"junk after the stream");
            // Refused, by the decoder (gzip reads on for another member) or after it.
            assert!(
                matches!(decoded(coding, &junk, 100), Err(DecodeError::Corrupt(_))),
                "{coding}"
            );
        }
        let mut inner_junk = gzip(b"{}");
        inner_junk.extend_from_slice(b"junk");
        assert!(matches!(
            decoded("gzip, br", &brotli(&inner_junk), 100),
            Err(DecodeError::Corrupt(_))
        ));
        let mut cut = gzip(b"hello world");
        cut.truncate(cut.len() - 4);
        assert!(matches!(
            decoded("gzip", &cut, 100),
            Err(DecodeError::Corrupt(_))
        ));
    }

    #[test]
    fn a_zstd_window_past_8_mib_is_refused() {
        let mut e = zstd::stream::Encoder::new(Vec::new(), 3).unwrap();
        e.window_log(27).unwrap();
        e.long_distance_matching(true).unwrap();
        let big: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 251) as u8).collect();
        e.write_all(&big).unwrap();
        let body = e.finish().unwrap();
        assert!(matches!(
            decoded("zstd", &body, 64 << 20),
            Err(DecodeError::Corrupt(_))
        ));
    }

    #[test]
    fn the_decoded_bytes_are_counted_in_the_budget() {
        let budget = Budget::new(1000, Gauge::default());
        let body = gzip(&[7u8; 5000]);
        assert_eq!(
            decode(&headers("gzip"), &body, 1 << 20, &mut budget.lease()),
            Err(DecodeError::OverBudget)
        );
        assert_eq!(budget.used(), 0, "given back");
    }
}
