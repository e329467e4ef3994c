//! A [`Store`] wrapper that times every call and counts failures, for `/metrics`.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use super::wait::Subscription;
use super::{OwnerToken, Record, Reservation, Store, StoreError, StoredResponse, UnknownReason};
use crate::fingerprint::Fingerprint;
use crate::key::StoreKey;
use crate::metrics::{Metrics, StoreOp};

pub struct Instrumented {
    inner: Arc<dyn Store>,
    metrics: Arc<Metrics>,
}

impl Instrumented {
    pub fn new(inner: Arc<dyn Store>, metrics: Arc<Metrics>) -> Self {
        Instrumented { inner, metrics }
    }

    async fn timed<T>(
        &self,
        op: StoreOp,
        fut: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let result = fut.await;
        // Losing ownership is an answer, not a store failure.
        let failed = matches!(
            result,
            Err(StoreError::Unavailable(_) | StoreError::Full(_) | StoreError::Corrupt(_))
        );
        self.metrics.store_call(op, started.elapsed(), failed);
        result
    }
}

#[async_trait]
impl Store for Instrumented {
    async fn reserve(
        &self,
        key: &StoreKey,
        fingerprint: Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reservation, StoreError> {
        self.timed(
            StoreOp::Reserve,
            self.inner.reserve(key, fingerprint, lease, ttl),
        )
        .await
    }

    async fn get(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        self.timed(StoreOp::Get, self.inner.get(key)).await
    }

    async fn get_watched(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        self.timed(StoreOp::Get, self.inner.get_watched(key)).await
    }

    async fn complete(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        response: StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.timed(
            StoreOp::Complete,
            self.inner.complete(key, owner, response, ttl),
        )
        .await
    }

    async fn mark_unknown(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        reason: UnknownReason,
    ) -> Result<(), StoreError> {
        self.timed(
            StoreOp::MarkUnknown,
            self.inner.mark_unknown(key, owner, reason),
        )
        .await
    }

    async fn release(&self, key: &StoreKey, owner: OwnerToken) -> Result<(), StoreError> {
        self.timed(StoreOp::Release, self.inner.release(key, owner))
            .await
    }

    async fn renew(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.timed(StoreOp::Renew, self.inner.renew(key, owner, lease))
            .await
    }

    async fn take_over(
        &self,
        key: &StoreKey,
        expected: &Record,
        fingerprint: Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Option<OwnerToken>, StoreError> {
        self.timed(
            StoreOp::TakeOver,
            self.inner.take_over(key, expected, fingerprint, lease, ttl),
        )
        .await
    }

    async fn delete(&self, key: &StoreKey) -> Result<bool, StoreError> {
        self.timed(StoreOp::Delete, self.inner.delete(key)).await
    }

    fn subscribe(&self, key: &StoreKey) -> Subscription {
        self.inner.subscribe(key)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.timed(StoreOp::Ping, self.inner.ping()).await
    }

    fn purged(&self) -> u64 {
        self.inner.purged()
    }
}
