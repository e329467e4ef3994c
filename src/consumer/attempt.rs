//! Phase `attempt` of a message: its key, its fingerprint and one run of the idempotency core
//! ([`crate::idempotency::Core::run`]) with the handler call, and the [`Verdict`] that tells the
//! consumer what to do with the message next.

use std::convert::Infallible;

use http::{HeaderName, HeaderValue};
use tracing::Instrument as _;

use super::handler::HandlerCall;
use super::message::Consumer;
use super::spans;
use super::{Message, Source};
use crate::config::OnUnknown;
use crate::fingerprint::{fingerprint, IgnoredFields};
use crate::idempotency::legacy::older_stored;
use crate::idempotency::{Decision, Execute, Keys, Refusal, Rules, Settled, Sought};
use crate::key::{ClientScope, Sent, StoreKey};
use crate::metrics::ConsumerOutcome;
use crate::store::{Claim, Origin, OriginKind};
use crate::telemetry::span::Trace;

/// What to do with a message after one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Its result is stored (now, or by an earlier delivery): acknowledge it.
    Ack(ConsumerOutcome),
    /// Not done: try again later. `counted`: the attempt counts against `max_attempts` (the
    /// handler failed), rather than waiting on something else (the store, the original).
    Retry { reason: String, counted: bool },
    /// The handler answered and the store did not take the answer: never acknowledged; tried
    /// again (not counted), when the key's record is found pending, then an unknown outcome.
    NotStored,
    /// Never to be tried again automatically: to the dead-letter target, with why.
    DeadLetter(String),
}

impl<S: Source> Consumer<S> {
    /// One attempt at a message, in a span of its own when traces are on.
    pub(super) async fn attempt(&self, message: &Message) -> Verdict {
        let Some(traces) = &self.ctx.traces else {
            return self.attempt_in(message, None).await;
        };
        let trace = spans::message_span(traces, &self.config, message);
        let (trace_id, span_id) = trace.ids();
        // At the error level: enabled whatever RUST_LOG lets through.
        let logs = tracing::error_span!("message", trace_id = %trace_id, span_id = %span_id);
        let verdict = (self.attempt_in(message, Some(&trace)))
            .instrument(logs)
            .await;
        spans::end_message_span(&trace, &verdict);
        verdict
    }

    /// One attempt at a message: key, fingerprint, the core.
    async fn attempt_in(&self, message: &Message, trace: Option<&Trace>) -> Verdict {
        let config = &self.config;
        if let Some(why) = &message.invalid {
            return Verdict::DeadLetter(format!("invalid-message: {why}"));
        }
        let Some(body) = &message.body else {
            return Verdict::DeadLetter(format!(
                "no-body: the entry has no field {:?}",
                config.body_field
            ));
        };
        if body.len() > config.policy.max_body {
            return Verdict::DeadLetter(format!(
                "too-large: {} bytes, over max_body ({})",
                body.len(),
                config.policy.max_body
            ));
        }
        let Sent { key, sent, older } = match config.key.extract_sent(&message.fields, body) {
            Ok(Some(k)) => k,
            Ok(None) => {
                let parts: Vec<String> = config
                    .key
                    .headers
                    .iter()
                    .map(|f| format!("the field {f}"))
                    .chain(
                        config
                            .key
                            .pointers
                            .iter()
                            .map(|p| format!("the body field {p}")),
                    )
                    .collect();
                return Verdict::DeadLetter(format!(
                    "missing-key: the message has no value for {}",
                    parts.join(" and ")
                ));
            }
            Err(e) => return Verdict::DeadLetter(format!("invalid-key: {e}")),
        };
        let lookup = crate::reconcile::Lookup::of(&config.policy, &sent);
        let mut headers = message.fields.clone();
        headers.insert(http::header::CONTENT_TYPE, config.content_type.clone());
        headers.insert(MESSAGE_ID.clone(), header_value(&message.id));
        headers.insert(DELIVERIES.clone(), HeaderValue::from(message.deliveries));
        let mut call = HandlerCall {
            consumer: config.name.clone(),
            pool: self.ctx.pool.clone(),
            handler: config.handler.clone(),
            policy: config.policy.clone(),
            headers,
            body: body.clone(),
            trace: trace.cloned(),
        };
        // Of the body and its media type (no fingerprint headers): the key is not part of it.
        let fp = fingerprint(&call.fingerprinted(), &IgnoredFields::default());
        let earlier = || call.earlier_fingerprint();
        let chosen = self
            .stored_under(key, older, &Sought::new(fp, &earlier))
            .await;
        let Some((store_key, key)) = chosen else {
            return Verdict::Retry {
                reason: "the store cannot take the key now".into(),
                counted: false,
            };
        };
        call.headers
            .insert(IDEMPOTENCY_KEY.clone(), header_value(&key));
        let claim = Claim {
            fingerprint: fp,
            origin: Some(Origin::new(OriginKind::Consumer, &config.name, sent)),
        };
        let mut rules = Rules::of(&config.policy, config.check_fingerprint);
        if message.handler_answered {
            // It ran: an abandoned record of it is never taken over to run it again.
            rules.on_unknown = OnUnknown::Reject;
        }
        let run = self.ctx.core.run(
            &self.ctx.store,
            store_key,
            claim,
            // A message has no client to count records for.
            (rules, lookup.as_ref()),
            call,
        );
        // Claimed for as long as it runs, however long the handler takes. The claim is renewed
        // beside the run, never in its way: the run renews the key's lease meanwhile.
        let decision = tokio::select! {
            d = run => d,
            never = self.keep_claimed(message) => match never {},
        };
        if let Decision::Owned { took, .. } = &decision {
            self.metrics.handler(*took);
        }
        if let Some(trace) = trace {
            spans::note_decision(trace, &decision, &store_key.key);
        }
        verdict(decision)
    }

    /// The store key of `key`, and the key the handler is told: a number or boolean key part
    /// made another key before issue 45, so a message the previous version stored, delivered
    /// again across the upgrade, is found under that one (and the handler is told the key it
    /// was told then, for its own inbox). `None` when the store cannot say.
    async fn stored_under(
        &self,
        key: String,
        older: Option<String>,
        sought: &Sought<'_>,
    ) -> Option<(Keys, String)> {
        let config = &self.config;
        let store_key = StoreKey::new(&ClientScope::shared(), &config.name, &key);
        let Some(older) = older.filter(|_| self.ctx.legacy.open(config.policy.ttl)) else {
            return Some((Keys::of(store_key), key));
        };
        let older_key = StoreKey::new(&ClientScope::shared(), &config.name, &older);
        let accept = (config.check_fingerprint, sought);
        match older_stored(&*self.ctx.store, store_key, &[older_key], accept).await {
            Ok(found) if found == older_key => {
                let keys = Keys {
                    key: found,
                    instead: Some(store_key),
                };
                Some((keys, older))
            }
            Ok(_) => Some((Keys::of(store_key), key)),
            Err(e) => {
                tracing::warn!(error = %e, "a key's older derivation not read");
                None
            }
        }
    }

    /// Renews `message`'s claim every [`Consumer::keep_every`], for as long as it is polled.
    async fn keep_claimed(&self, message: &Message) -> Infallible {
        let every = self.keep_every();
        loop {
            tokio::time::sleep(every).await;
            let _ = self.source.keep(message, false).await;
        }
    }
}

/// What became of one attempt, as the broker must see it: the pure core of this module.
pub(super) fn verdict(decision: Decision<HandlerCall>) -> Verdict {
    match decision {
        Decision::Owned { settled, .. } => match settled {
            Settled::Stored(_) => Verdict::Ack(ConsumerOutcome::Delivered),
            // Its record is someone else's now, or gone: another attempt could run it again.
            Settled::NotStored { lost: true, .. } => Verdict::DeadLetter(
                "outcome-unknown: the handler answered, and the key's record was no longer this delivery's (its lease ran out, or it was released): its answer is not stored".into(),
            ),
            Settled::NotStored { lost: false, .. } => Verdict::NotStored,
            Settled::Released(status) => Verdict::Retry {
                reason: format!("the handler answered {status}"),
                counted: true,
            },
            Settled::NotSent(e) => Verdict::Retry {
                reason: format!("the handler could not be reached: {e}"),
                counted: true,
            },
            Settled::Unknown {
                retryable: true, ..
            } => Verdict::Retry {
                reason: "outcome unknown (on_unknown = \"retry\")".into(),
                counted: true,
            },
            Settled::Unknown { reason, .. } => Verdict::DeadLetter(format!(
                "outcome-unknown: the handler was called and gave no complete answer ({})",
                reason.as_str()
            )),
            Settled::AnsweredUnknown {
                retryable: true,
                status,
                ..
            } => Verdict::Retry {
                reason: format!("the handler answered {status}, which may follow a commit; outcome unknown (on_unknown = \"retry\")"),
                counted: true,
            },
            Settled::AnsweredUnknown { status, .. } => Verdict::DeadLetter(format!(
                "outcome-unknown: the handler answered {status}, which may follow a commit (unknown_statuses)"
            )),
        },
        Decision::Replay { .. } => Verdict::Ack(ConsumerOutcome::Deduplicated),
        Decision::Refused(refusal) => match refusal {
            Refusal::KeyReused => Verdict::DeadLetter(
                "key-reused: a message with this key and other content was handled before".into(),
            ),
            Refusal::OutcomeUnknown(reason) | Refusal::LookupDue { reason, .. } => Verdict::DeadLetter(format!(
                "outcome-unknown: an earlier delivery called the handler and its outcome is not known ({})",
                reason.as_str()
            )),
            Refusal::InFlight => Verdict::Retry {
                reason: "another delivery of this key is still being handled".into(),
                counted: false,
            },
            // Counted: tried again with the growing backoff, and dead-lettered as an unknown
            // outcome after max_attempts if the lookup never gets asked.
            Refusal::Reconciling(_) => Verdict::Retry {
                reason: "an earlier delivery's outcome is unknown, and the handler's lookup is still to say".into(),
                counted: true,
            },
            // Counted: until an operator lists the key again or settles the record, then
            // dead-lettered.
            Refusal::Unreadable => Verdict::Retry {
                reason: "record-unreadable: the key's stored record does not open with this gateway's keys".into(),
                counted: true,
            },
            Refusal::StoreUnavailable | Refusal::StoreFull | Refusal::OverQuota { .. } => {
                Verdict::Retry {
                    reason: "the store cannot take the key now".into(),
                    counted: false,
                }
            }
        },
        // on_store_error is always "reject" for consumers (config).
        Decision::Bypass(_) => Verdict::Retry {
            reason: "the store cannot take the key now".into(),
            counted: false,
        },
    }
}

static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
static MESSAGE_ID: HeaderName = HeaderName::from_static("idemgate-message-id");
static DELIVERIES: HeaderName = HeaderName::from_static("idemgate-deliveries");

fn header_value(s: &str) -> HeaderValue {
    HeaderValue::from_str(s).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::store::UnknownReason;

    fn owned(settled: Settled<u16>) -> Decision<HandlerCall> {
        Decision::Owned {
            settled,
            took: Duration::ZERO,
        }
    }

    #[test]
    fn stored_answers_and_replays_are_acknowledged() {
        assert_eq!(
            verdict(owned(Settled::Stored(201))),
            Verdict::Ack(ConsumerOutcome::Delivered)
        );
        assert_eq!(
            verdict(owned(Settled::Stored(422))),
            Verdict::Ack(ConsumerOutcome::Delivered)
        );
        let replay = Decision::Replay {
            response: Arc::new(crate::store::StoredResponse {
                status: http::StatusCode::CREATED,
                headers: Vec::new(),
                trailers: Vec::new(),
                body: bytes::Bytes::new(),
                body_kept: true,
                completed_ms: 0,
                link: None,
            }),
            waited: false,
        };
        assert_eq!(verdict(replay), Verdict::Ack(ConsumerOutcome::Deduplicated));
    }

    #[test]
    fn handler_failures_are_retried_and_counted() {
        for d in [
            owned(Settled::Released(503)),
            owned(Settled::NotSent("refused".into())),
            owned(Settled::Unknown {
                reason: UnknownReason::Timeout,
                retryable: true,
            }),
        ] {
            assert!(matches!(verdict(d), Verdict::Retry { counted: true, .. }));
        }
    }

    #[test]
    fn waiting_on_others_is_retried_without_counting() {
        for r in [
            Refusal::InFlight,
            Refusal::StoreUnavailable,
            Refusal::StoreFull,
        ] {
            assert!(matches!(
                verdict(Decision::Refused(r)),
                Verdict::Retry { counted: false, .. }
            ));
        }
    }

    #[test]
    fn unknown_outcomes_and_reused_keys_go_to_an_operator() {
        let unknown = verdict(owned(Settled::Unknown {
            reason: UnknownReason::Interrupted,
            retryable: false,
        }));
        assert!(matches!(unknown, Verdict::DeadLetter(r) if r.starts_with("outcome-unknown")));
        let earlier = verdict(Decision::Refused(Refusal::OutcomeUnknown(
            UnknownReason::Abandoned,
        )));
        assert!(matches!(earlier, Verdict::DeadLetter(r) if r.starts_with("outcome-unknown")));
        let reused = verdict(Decision::Refused(Refusal::KeyReused));
        assert!(matches!(reused, Verdict::DeadLetter(r) if r.starts_with("key-reused")));
    }

    #[test]
    fn an_answer_the_store_refused_is_not_acknowledged() {
        let down = Settled::NotStored {
            output: 201,
            lost: false,
        };
        assert_eq!(verdict(owned(down)), Verdict::NotStored);
        let lost = Settled::NotStored {
            output: 201,
            lost: true,
        };
        assert!(
            matches!(verdict(owned(lost)), Verdict::DeadLetter(r) if r.starts_with("outcome-unknown")),
            "never tried again: the record is no longer this delivery's"
        );
    }
}
