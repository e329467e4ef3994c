//! `[[consumers]]`: a broker's messages delivered to a handler through the same core, and the
//! source each one reads (a Redis stream, a NATS JetStream stream, a RabbitMQ queue or a Kafka
//! topic).

use std::time::Duration;

use super::route::{validate_key_source, KeyParts};
use super::{entry_name, pem_file, shown, validate_redis_url, Pem};
use crate::config::raw::{RawConsumer, RawPolicy, RawSource};
use crate::config::{
    redact_url, ConfigError, ConsumerConfig, KafkaSource, NatsSource, OnStoreError, Policy,
    RabbitSource, RedisSettings, RedisTarget, SourceConfig, StoreConfig, UpstreamUrl,
};

/// A message's key: fields of the entry and JSON pointers into its body.
const MESSAGE_KEY: KeyParts = KeyParts {
    named: "field",
    example: "{ field = \"messageId\" }",
};

/// Most messages one consumer handles at once.
const MAX_CONCURRENCY: i64 = 4096;
/// Most deliveries of one message before it is dead-lettered.
const MAX_ATTEMPTS: i64 = 1000;

/// A consumer's `source`: which broker, and where in it.
fn validate_source(
    at: &dyn Fn(&str) -> String,
    source: RawSource,
    store: &StoreConfig,
) -> Result<SourceConfig, ConfigError> {
    let kinds = (
        source.redis_stream.is_some(),
        source.nats_stream.is_some(),
        source.rabbitmq_queue.is_some(),
        source.kafka_topic.is_some(),
    );
    match kinds {
        (true, false, false, false) => redis_source(at, source, store),
        (false, true, false, false) => nats_source(at, source),
        (false, false, true, false) => rabbit_source(at, source),
        (false, false, false, true) => kafka_source(at, source),
        _ => Err(ConfigError::invalid(
            at("source"),
            "(none, or more than one)",
            "one of { redis_stream = \"orders\" }, { nats_stream = \"ORDERS\", url = \"nats://host:4222\", dead_letter = \"dead.orders\" }, { rabbitmq_queue = \"orders\", url = \"amqp://user:pass@host:5672/%2f\", dead_letter = \"orders.dead\" } and { kafka_topic = \"orders\", brokers = [\"host:9092\"], dead_letter = \"orders.dead\" }",
        )),
    }
}

/// librdkafka settings the gateway sets itself: what the offsets mean depends on them.
const KAFKA_OWN_OPTIONS: &[&str] = &[
    "bootstrap.servers",
    "metadata.broker.list",
    "group.id",
    "enable.auto.commit",
    "enable.auto.offset.store",
];

fn kafka_source(
    at: &dyn Fn(&str) -> String,
    source: RawSource,
) -> Result<SourceConfig, ConfigError> {
    only_with(
        at,
        &[
            ("url", source.url.is_some()),
            ("claim_idle", source.claim_idle.is_some()),
            ("subject", source.subject.is_some()),
            ("durable", source.durable.is_some()),
            ("ack_wait", source.ack_wait.is_some()),
            ("tls_ca_file", source.tls_ca_file.is_some()),
        ],
        "not with kafka_topic, which has brokers, group, dead_letter and options",
    )?;
    let topic = kafka_name(
        at,
        "source.kafka_topic",
        source.kafka_topic.unwrap_or_default(),
    )?;
    let brokers = source.brokers.unwrap_or_default();
    let well_formed = |b: &String| {
        b.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty()
                && !host.contains(['/', '@'])
                && port.parse::<u16>().is_ok_and(|p| p > 0)
        })
    };
    if brokers.is_empty() || brokers.len() > 64 || !brokers.iter().all(well_formed) {
        return Err(ConfigError::invalid(
            at("source.brokers"),
            // A broker written with credentials (`u:pw@k:9092`) is refused, and not shown.
            format!(
                "{:?}",
                brokers
                    .iter()
                    .map(|b| crate::config::redact_url(b))
                    .collect::<Vec<_>>()
            ),
            "1 to 64 brokers as \"host:port\", such as [\"kafka-1:9092\"]",
        ));
    }
    let group = stream_name(
        at,
        "source.group",
        source.group.unwrap_or_else(|| "idemgate".to_string()),
    )?;
    let dead_letter = source.dead_letter.ok_or_else(|| ConfigError::Missing {
        field: at("source.dead_letter"),
    })?;
    let dead_letter = kafka_name(at, "source.dead_letter", dead_letter)?;
    if dead_letter == topic {
        return Err(ConfigError::invalid(
            at("source.dead_letter"),
            dead_letter,
            "another topic than kafka_topic: every dead letter would come back",
        ));
    }
    let options = source.options.unwrap_or_default();
    if let Some(own) = options
        .keys()
        .find(|k| KAFKA_OWN_OPTIONS.contains(&k.as_str()))
    {
        return Err(ConfigError::invalid(
            at(&format!("source.options.{own}")),
            "(set)",
            "a setting the gateway makes itself (brokers, group; offsets are committed only past finished messages)",
        ));
    }
    Ok(SourceConfig::KafkaTopic(KafkaSource {
        brokers,
        topic,
        group,
        dead_letter,
        options,
    }))
}

/// A Kafka topic's name: what the brokers accept.
fn kafka_name(at: &dyn Fn(&str) -> String, field: &str, v: String) -> Result<String, ConfigError> {
    let legal = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if v.is_empty() || v.len() > 249 || !v.chars().all(legal) || v == "." || v == ".." {
        Err(ConfigError::invalid(
            at(field),
            v,
            "1 to 249 characters of a-z, A-Z, 0-9, '.', '_' and '-'",
        ))
    } else {
        Ok(v)
    }
}

fn rabbit_source(
    at: &dyn Fn(&str) -> String,
    source: RawSource,
) -> Result<SourceConfig, ConfigError> {
    only_with(
        at,
        &[
            ("group", source.group.is_some()),
            ("claim_idle", source.claim_idle.is_some()),
            ("subject", source.subject.is_some()),
            ("durable", source.durable.is_some()),
            ("ack_wait", source.ack_wait.is_some()),
            ("brokers", source.brokers.is_some()),
            ("options", source.options.is_some()),
        ],
        "not with rabbitmq_queue, which has url and dead_letter",
    )?;
    let queue = stream_name(
        at,
        "source.rabbitmq_queue",
        source.rabbitmq_queue.unwrap_or_default(),
    )?;
    let url = source.url.ok_or_else(|| ConfigError::Missing {
        field: at("source.url"),
    })?;
    let parsed = url.parse::<lapin::uri::AMQPUri>();
    if !(url.starts_with("amqp://") || url.starts_with("amqps://")) || parsed.is_err() {
        return Err(ConfigError::invalid(
            at("source.url"),
            redact_url(&url),
            "an AMQP URL such as \"amqp://user:pass@127.0.0.1:5672/%2f\" (amqps:// for TLS)",
        ));
    }
    let dead_letter = source.dead_letter.ok_or_else(|| ConfigError::Missing {
        field: at("source.dead_letter"),
    })?;
    let dead_letter = stream_name(at, "source.dead_letter", dead_letter)?;
    if dead_letter == queue {
        return Err(ConfigError::invalid(
            at("source.dead_letter"),
            dead_letter,
            "another queue than rabbitmq_queue: every dead letter would come back",
        ));
    }
    let tls_ca_file = match source.tls_ca_file {
        Some(_) if !url.starts_with("amqps://") => {
            return Err(ConfigError::invalid(
                at("source.tls_ca_file"),
                "(set)",
                "only with an amqps:// url",
            ))
        }
        Some(path) => Some(pem_file(&at("source.tls_ca_file"), path, Pem::Certificate)?),
        None => None,
    };
    Ok(SourceConfig::RabbitQueue(RabbitSource {
        url,
        queue,
        dead_letter,
        tls_ca_file,
    }))
}

/// A stream, group, subject or consumer name.
fn stream_name(at: &dyn Fn(&str) -> String, field: &str, v: String) -> Result<String, ConfigError> {
    if v.is_empty() || v.len() > 256 || v.chars().any(char::is_control) {
        Err(ConfigError::invalid(
            at(field),
            v,
            "1 to 256 characters without control characters",
        ))
    } else {
        Ok(v)
    }
}

/// How long a message stays with the instance handling it: renewed every third of it.
fn hold_time(
    at: &dyn Fn(&str) -> String,
    field: &str,
    v: Option<Duration>,
    default: Duration,
) -> Result<Duration, ConfigError> {
    let d = v.unwrap_or(default);
    if d < Duration::from_millis(100) {
        return Err(ConfigError::invalid(
            at(field),
            shown(d),
            "at least 100ms: the gateway renews its claim every third of it",
        ));
    }
    Ok(d)
}

/// Fails if any of `keys` is set: they belong to the other kind of source.
fn only_with(
    at: &dyn Fn(&str) -> String,
    keys: &[(&str, bool)],
    allowed: &str,
) -> Result<(), ConfigError> {
    match keys.iter().find(|(_, set)| *set) {
        Some((key, _)) => Err(ConfigError::invalid(
            at(&format!("source.{key}")),
            "(set)",
            allowed,
        )),
        None => Ok(()),
    }
}

fn redis_source(
    at: &dyn Fn(&str) -> String,
    source: RawSource,
    store: &StoreConfig,
) -> Result<SourceConfig, ConfigError> {
    only_with(
        at,
        &[
            ("subject", source.subject.is_some()),
            ("durable", source.durable.is_some()),
            ("ack_wait", source.ack_wait.is_some()),
            ("tls_ca_file", source.tls_ca_file.is_some()),
            ("brokers", source.brokers.is_some()),
            ("options", source.options.is_some()),
        ],
        "not with redis_stream, which has group, claim_idle, url and dead_letter",
    )?;
    let stream = stream_name(
        at,
        "source.redis_stream",
        source.redis_stream.unwrap_or_default(),
    )?;
    let group = stream_name(
        at,
        "source.group",
        source.group.unwrap_or_else(|| "idemgate".to_string()),
    )?;
    let dead_letter = stream_name(
        at,
        "source.dead_letter",
        source
            .dead_letter
            .unwrap_or_else(|| format!("{stream}:dead")),
    )?;
    if dead_letter == stream {
        return Err(ConfigError::invalid(
            at("source.dead_letter"),
            dead_letter,
            "another stream than the one read",
        ));
    }
    let redis = match (source.url, store) {
        (Some(url), _) => RedisSettings {
            target: RedisTarget::Single(validate_redis_url(&at("source.url"), url)?),
            key_prefix: String::new(),
            command_timeout: Duration::from_secs(5),
            // No record is kept there: no lease is read.
            max_clock_skew: Duration::ZERO,
            tls_ca_file: None,
            require_noeviction: false,
            tls_client: None,
            // The source's Redis holds the stream, not records: nothing is acted on from it.
            replicas: None,
        },
        (None, StoreConfig::Redis(settings))
            if matches!(
                settings.target,
                RedisTarget::Single(_) | RedisTarget::Sentinel { .. }
            ) =>
        {
            settings.clone()
        }
        (None, _) => {
            return Err(ConfigError::invalid(
                at("source.url"),
                "(none)",
                "the Redis holding the stream (\"redis://host:6379\"); without it the [store]'s, which must then be a single Redis or a Sentinel's primary",
            ))
        }
    };
    let claim_idle = hold_time(
        at,
        "source.claim_idle",
        source.claim_idle,
        Duration::from_secs(60),
    )?;
    Ok(SourceConfig::RedisStream {
        stream,
        group,
        redis,
        dead_letter,
        claim_idle,
    })
}

fn nats_source(
    at: &dyn Fn(&str) -> String,
    source: RawSource,
) -> Result<SourceConfig, ConfigError> {
    only_with(
        at,
        &[
            ("group", source.group.is_some()),
            ("claim_idle", source.claim_idle.is_some()),
            ("tls_ca_file", source.tls_ca_file.is_some()),
            ("brokers", source.brokers.is_some()),
            ("options", source.options.is_some()),
        ],
        "not with nats_stream, which has url, subject, durable, ack_wait and dead_letter",
    )?;
    let stream = stream_name(
        at,
        "source.nats_stream",
        source.nats_stream.unwrap_or_default(),
    )?;
    let url = source.url.ok_or_else(|| ConfigError::Missing {
        field: at("source.url"),
    })?;
    if !url.starts_with("nats://") && !url.starts_with("tls://") {
        return Err(ConfigError::invalid(
            at("source.url"),
            redact_url(&url),
            "a NATS URL such as \"nats://127.0.0.1:4222\"",
        ));
    }
    let subject = source
        .subject
        .map(|s| stream_name(at, "source.subject", s))
        .transpose()?;
    let durable = stream_name(
        at,
        "source.durable",
        source.durable.unwrap_or_else(|| "idemgate".to_string()),
    )?;
    if durable.contains(['.', '*', '>', ' ']) {
        return Err(ConfigError::invalid(
            at("source.durable"),
            durable,
            "a name without '.', '*', '>' or spaces",
        ));
    }
    let dead_letter = source.dead_letter.ok_or_else(|| ConfigError::Missing {
        field: at("source.dead_letter"),
    })?;
    let dead_letter = stream_name(at, "source.dead_letter", dead_letter)?;
    let ack_wait = hold_time(
        at,
        "source.ack_wait",
        source.ack_wait,
        Duration::from_secs(30),
    )?;
    Ok(SourceConfig::NatsStream(NatsSource {
        url,
        stream,
        subject,
        durable,
        dead_letter,
        ack_wait,
    }))
}

pub(super) fn validate_consumer(
    index: usize,
    raw: RawConsumer,
    defaults: &Policy,
    store: &StoreConfig,
) -> Result<ConsumerConfig, ConfigError> {
    let at = |f: &str| format!("consumers[{index}].{f}");
    let name = raw
        .name
        .ok_or_else(|| ConfigError::Missing { field: at("name") })?;
    let name = entry_name(&at("name"), name)?;
    let handler = raw.handler.ok_or_else(|| ConfigError::Missing {
        field: at("handler"),
    })?;
    let mut handler = UpstreamUrl::parse(&at("handler"), &handler)?;
    if let Some(p) = raw.protocol {
        handler.protocol = p;
    }
    let key = raw
        .key
        .ok_or_else(|| ConfigError::Missing { field: at("key") })?;
    let key = validate_key_source(&at("key"), key.field, key.json, &MESSAGE_KEY)?;
    let source = raw.source.ok_or_else(|| ConfigError::Missing {
        field: at("source"),
    })?;
    let source = validate_source(&at, source, store)?;
    if raw.body_field.is_some() && !matches!(source, SourceConfig::RedisStream { .. }) {
        return Err(ConfigError::invalid(
            at("body_field"),
            "(set)",
            "only with redis_stream: a NATS, RabbitMQ or Kafka message's payload is the body",
        ));
    }
    let body_field = raw.body_field.unwrap_or_else(|| "body".to_string());
    let content_type = raw
        .content_type
        .unwrap_or_else(|| "application/json".to_string());
    let content_type = http::HeaderValue::from_str(&content_type).map_err(|_| {
        ConfigError::invalid(
            at("content_type"),
            &content_type,
            "a media type such as \"application/json\"",
        )
    })?;
    let retries = retries(
        &at,
        (raw.concurrency, raw.max_attempts),
        (raw.backoff, raw.max_backoff),
    )?;
    let policy_raw = RawPolicy {
        ttl: raw.ttl,
        lock_timeout: raw.lock_timeout,
        wait: raw.wait,
        max_body: raw.max_body,
        max_stored_response: raw.max_stored_response,
        upstream_timeout: raw.upstream_timeout,
        store_server_errors: raw.store_server_errors,
        unknown_statuses: raw.unknown_statuses,
        on_unknown: raw.on_unknown,
        reconcile: raw.reconcile,
        ..RawPolicy::default()
    };
    let mut policy =
        super::policy::apply_policy(&format!("consumers[{index}]"), defaults, &policy_raw)?;
    // A message is never handled without its key being kept: there is no client to tell.
    policy.on_store_error = OnStoreError::Reject;
    // A consumer answers no HTTP client: `[defaults]`' answers are not its settings (and a
    // change to them is no consumer's change on reload).
    policy.answers = crate::config::answers::Answers::builtin();
    policy.require_key = true;
    Ok(ConsumerConfig {
        name,
        source,
        handler,
        key,
        check_fingerprint: raw.check_fingerprint.unwrap_or(true),
        body_field,
        content_type,
        concurrency: retries.concurrency,
        max_attempts: retries.max_attempts,
        backoff: retries.backoff,
        max_backoff: retries.max_backoff,
        policy,
    })
}

/// How many messages at once, and how often and how far apart one is tried.
struct Retries {
    concurrency: usize,
    max_attempts: u64,
    backoff: Duration,
    max_backoff: Duration,
}

const MAX_BACKOFF: Duration = Duration::from_secs(24 * 3600);

/// `(concurrency, max_attempts)` and `(backoff, max_backoff)` as written.
fn retries(
    at: &dyn Fn(&str) -> String,
    (concurrency, max_attempts): (Option<i64>, Option<i64>),
    (backoff, max_backoff): (Option<Duration>, Option<Duration>),
) -> Result<Retries, ConfigError> {
    let int = |field: &str, v: Option<i64>, default: i64, max: i64| -> Result<i64, ConfigError> {
        match v {
            None => Ok(default),
            Some(n) if (1..=max).contains(&n) => Ok(n),
            Some(n) => Err(ConfigError::invalid(
                at(field),
                n.to_string(),
                format!("from 1 to {max}"),
            )),
        }
    };
    let concurrency = int("concurrency", concurrency, 16, MAX_CONCURRENCY)?;
    let max_attempts = int("max_attempts", max_attempts, 5, MAX_ATTEMPTS)?;
    let backoff = backoff.unwrap_or(Duration::from_secs(1));
    let max_backoff = max_backoff.unwrap_or(Duration::from_secs(60));
    if max_backoff < backoff {
        return Err(ConfigError::invalid(
            at("max_backoff"),
            shown(max_backoff),
            "at least backoff",
        ));
    }
    // A message waiting longer than a day holds its slot for nothing; and a deadline past what
    // the clock can hold would panic.
    if max_backoff > MAX_BACKOFF {
        return Err(ConfigError::invalid(
            at("max_backoff"),
            shown(max_backoff),
            "at most 24h",
        ));
    }
    Ok(Retries {
        // Both within bounds checked above.
        concurrency: usize::try_from(concurrency).unwrap_or(16),
        max_attempts: u64::try_from(max_attempts).unwrap_or(5),
        backoff,
        max_backoff,
    })
}
