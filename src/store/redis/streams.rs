//! Connections for the Redis-stream consumers ([`crate::consumer`]): to the Redis the settings
//! name, as the store's own handles connect, following a Sentinel's primary through failovers.
//! A cluster is refused: a stream is read from one node.

use redis::aio::ConnectionManagerConfig;
use redis::{Cmd, Value};
use tokio::task::AbortHandle;

use super::conn::{certificates, client, Connector, HandleConn};
use super::sentinel;
use crate::config::{RedisSettings, RedisTarget};
use crate::store::{OpenError, StoreError};

/// Where a consumer's connections go.
pub struct StreamRedis {
    connector: Connector,
    /// The task that asks the sentinels, with Sentinel; stopped with this.
    follow: Option<AbortHandle>,
}

/// One connection (multiplexed; a blocking read gets one of its own).
pub struct StreamConn {
    handle: HandleConn,
}

impl Drop for StreamRedis {
    fn drop(&mut self) {
        if let Some(task) = &self.follow {
            task.abort();
        }
    }
}

impl StreamRedis {
    /// Connects lazily; with Sentinel, starts asking the sentinels (on this runtime).
    pub fn open(
        settings: &RedisSettings,
        config: ConnectionManagerConfig,
    ) -> Result<Self, OpenError> {
        let certs = certificates(settings)?;
        match &settings.target {
            RedisTarget::Single(url) => Ok(StreamRedis {
                connector: Connector::Single {
                    client: client(url, certs.as_ref())?,
                    config,
                    lanes: 1,
                },
                follow: None,
            }),
            RedisTarget::Sentinel { sentinels, master } => {
                // RESP2, as with a single Redis: the stream replies are read as RESP2 arrays.
                let (sentinels, follower) =
                    sentinel::open(sentinels, master, certs.as_ref(), (config, 1), false)?;
                let task = tokio::spawn(sentinel::follow(sentinels, follower.clone()));
                Ok(StreamRedis {
                    connector: Connector::Sentinel(follower),
                    follow: Some(task.abort_handle()),
                })
            }
            RedisTarget::Cluster(_) => Err(OpenError::RedisUrl(
                "a stream is read from a single Redis or a Sentinel's primary, not a cluster"
                    .into(),
            )),
        }
    }

    pub fn conn(&self) -> Result<StreamConn, OpenError> {
        let handle = self
            .connector
            .handle()
            .map_err(|e| OpenError::RedisConnection(e.to_string()))?;
        Ok(StreamConn { handle })
    }

    /// Told of a failed command: with Sentinel, the primary may have moved.
    pub fn failed(&self, e: Option<&redis::RedisError>) {
        self.connector.failed(e);
    }
}

impl StreamConn {
    /// Sends `cmd` (on the primary of now, with Sentinel).
    pub async fn query(&self, cmd: &Cmd) -> Result<redis::RedisResult<Value>, StoreError> {
        let mut conn = self.handle.get()?;
        Ok(cmd.query_async::<Value>(&mut conn).await)
    }
}
