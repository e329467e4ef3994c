//! An OTLP/HTTP receiver on loopback: decodes every `POST /v1/traces` with the official
//! protobuf types (opentelemetry-proto) and keeps the spans.
#![allow(dead_code)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use tokio::net::TcpListener;

pub struct Collector {
    pub url: String,
    spans: Arc<Mutex<Vec<Span>>>,
    /// Each export's resource `service.name`.
    services: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Collector {
    pub async fn start() -> Collector {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let spans = Arc::new(Mutex::new(Vec::new()));
        let services = Arc::new(Mutex::new(Vec::new()));
        let kept = Arc::clone(&spans);
        let named = Arc::clone(&services);
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let kept = Arc::clone(&kept);
                let named = Arc::clone(&named);
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let kept = Arc::clone(&kept);
                        let named = Arc::clone(&named);
                        async move {
                            let path = req.uri().path().to_string();
                            let body = req.into_body().collect().await.unwrap().to_bytes();
                            assert_eq!(path, "/v1/traces");
                            let export = ExportTraceServiceRequest::decode(body).unwrap();
                            for resource in export.resource_spans {
                                let service = resource.resource.as_ref().and_then(|r| {
                                    r.attributes.iter().find(|kv| kv.key == "service.name")
                                });
                                if let Some(AnyValue::StringValue(name)) =
                                    service.and_then(|kv| kv.value.as_ref()?.value.clone())
                                {
                                    named.lock().unwrap().push(name);
                                }
                                for scope in resource.scope_spans {
                                    kept.lock().unwrap().extend(scope.spans);
                                }
                            }
                            Ok::<_, std::convert::Infallible>(Response::new(
                                Full::new(Bytes::new()),
                            ))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Collector {
            url,
            spans,
            services,
            task,
        }
    }

    pub fn services(&self) -> Vec<String> {
        self.services.lock().unwrap().clone()
    }

    pub fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }

    /// Waits (up to 10 s: spans are sent every second) until a span satisfies `f`.
    pub async fn span(&self, f: impl Fn(&Span) -> bool) -> Span {
        for _ in 0..100 {
            if let Some(s) = self.spans().into_iter().find(|s| f(s)) {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("no such span exported: {:?}", self.spans());
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A span's attribute as text (strings, ints and booleans).
pub fn attribute(span: &Span, key: &str) -> Option<String> {
    let kv = span.attributes.iter().find(|kv| kv.key == key)?;
    match kv.value.as_ref()?.value.as_ref()? {
        AnyValue::StringValue(s) => Some(s.clone()),
        AnyValue::IntValue(i) => Some(i.to_string()),
        AnyValue::BoolValue(b) => Some(b.to_string()),
        other => Some(format!("{other:?}")),
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
