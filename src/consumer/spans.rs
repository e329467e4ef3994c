//! A message's trace span (`[telemetry]`): one per attempt, continuing the `traceparent` the
//! message carries (a Kafka, RabbitMQ or NATS header, a Redis stream field), ended with what
//! became of the attempt; the handler's call is its child, and the handler's `traceparent`.

use http::HeaderMap;
use opentelemetry::trace::SpanKind;
use opentelemetry::KeyValue;

use super::attempt::Verdict;
use super::handler::HandlerCall;
use super::Message;
use crate::config::{ConsumerConfig, SourceConfig};
use crate::idempotency::Decision;
use crate::key::StoreKey;
use crate::store::TraceLink;
use crate::telemetry::span::Trace;
use crate::telemetry::traces::Traces;

/// The span of one attempt at `message`.
pub(super) fn message_span(traces: &Traces, config: &ConsumerConfig, message: &Message) -> Trace {
    let (system, destination) = match &config.source {
        SourceConfig::RedisStream { stream, .. } => ("redis", stream),
        SourceConfig::NatsStream(s) => ("nats", &s.stream),
        SourceConfig::RabbitQueue(s) => ("rabbitmq", &s.queue),
        SourceConfig::KafkaTopic(s) => ("kafka", &s.topic),
    };
    let attributes = vec![
        KeyValue::new("messaging.system", system),
        KeyValue::new("messaging.destination.name", destination.clone()),
        KeyValue::new("messaging.operation.type", "process"),
        KeyValue::new("messaging.message.id", message.id.clone()),
        KeyValue::new("idemgate.consumer", config.name.clone()),
        KeyValue::new(
            "idemgate.deliveries",
            i64::try_from(message.deliveries).unwrap_or(i64::MAX),
        ),
    ];
    let name = format!("process {}", config.name);
    traces.span(name, SpanKind::Consumer, &message.fields, attributes)
}

/// What the core decided, on the attempt's span: the key's id; for a duplicate delivery, a link
/// to the attempt that ran the handler.
pub(super) fn note_decision(trace: &Trace, decision: &Decision<HandlerCall>, key: &StoreKey) {
    trace.set(KeyValue::new("idemgate.key.id", key.short()));
    if let Decision::Replay { response, .. } = decision {
        if let Some(link) = response.link {
            trace.link_to(link);
        }
    }
}

/// Ends an attempt's span with its verdict.
pub(super) fn end_message_span(trace: &Trace, verdict: &Verdict) {
    let (outcome, error) = match verdict {
        Verdict::Ack(outcome) => (outcome.as_str(), false),
        Verdict::Retry { .. } => ("retry", false),
        Verdict::NotStored => ("not_stored", true),
        Verdict::DeadLetter(_) => ("dead_letter", true),
    };
    trace.set(KeyValue::new("idemgate.outcome", outcome));
    trace.end(error.then_some(outcome));
}

/// The handler call's client span, a child of the message's, put in `headers` as the
/// handler's `traceparent` (in place of the producer's, which is the message span's parent);
/// and the message span's link, for the answer to keep.
pub(super) fn handler_call(message: &Trace, headers: &mut HeaderMap) -> (Trace, Option<TraceLink>) {
    let call = message.phase(
        "handler",
        SpanKind::Client,
        vec![KeyValue::new("http.request.method", "POST")],
    );
    call.hand_on(headers);
    (call, message.link())
}
