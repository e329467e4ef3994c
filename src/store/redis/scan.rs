//! The operator's listing on Redis: `SCAN` over the records' key pattern (on a cluster, on each
//! primary in turn), the first bytes of each record read to tell an unknown outcome from the
//! rest without moving response bodies, then the unknown ones read whole.
//!
//! A `SCAN` call answers a batch of keys, not a position between two keys, so a batch holding
//! more unknown outcomes than the page has room for carries the rest in the cursor it hands
//! out (their hex ids after a `.`), and the next page starts with them. The batch is kept
//! near the page's size, so what is carried stays a few ids.
//!
//! Cursor: `<scan>` on one Redis, `<slot>-<scan>` on a cluster (the primary that serves
//! `slot`, found again on the next page), then `.<id>,<id>...` when ids are carried.

use bytes::Bytes;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::Value;

use super::conn::RedisConn;
use super::RedisStore;
use crate::key::StoreKey;
use crate::store::{codec, now_ms, ScanPage, Scanned, StoreError, SCAN_BUDGET};

/// Ids carried at most; a batch with more unknown outcomes than that past the page's room
/// (only when `SCAN` answers far more keys than asked) makes the page longer instead.
const MAX_CARRIED: usize = 64;
/// `SCAN` calls per page at most: on a Redis holding mostly other keys, a call may match
/// none, and the page ends early (with a cursor) rather than walking the whole keyspace.
const MAX_SCANS: usize = 1000;

/// Where a listing is.
#[derive(Debug, Default, PartialEq)]
struct Position {
    /// On a cluster, a slot the primary being scanned serves.
    slot: Option<u16>,
    /// `None` once every primary was scanned to the end.
    scan: Option<u64>,
    carried: Vec<StoreKey>,
}

impl Position {
    fn start(cluster: bool) -> Position {
        Position {
            slot: cluster.then_some(0),
            scan: Some(0),
            carried: Vec::new(),
        }
    }

    fn parse(cursor: &str) -> Result<Position, StoreError> {
        let bad = |_| StoreError::BadCursor;
        let (at, carried) = cursor.split_once('.').unwrap_or((cursor, ""));
        let (slot, scan) = match at.split_once('-') {
            Some((slot, scan)) => (Some(slot.parse().map_err(bad)?), scan),
            None => (None, at),
        };
        let scan = match scan {
            "end" => None,
            n => Some(n.parse().map_err(bad)?),
        };
        let carried = carried
            .split(',')
            .filter(|c| !c.is_empty())
            .map(|c| StoreKey::from_hex(c).ok_or(StoreError::BadCursor))
            .collect::<Result<Vec<_>, _>>()?;
        if carried.len() > MAX_CARRIED || slot.is_some_and(|s| s >= 16384) {
            return Err(StoreError::BadCursor);
        }
        Ok(Position {
            slot,
            scan,
            carried,
        })
    }

    fn render(&self) -> String {
        let scan = self.scan.map_or("end".to_owned(), |s| s.to_string());
        let mut out = match self.slot {
            Some(slot) => format!("{slot}-{scan}"),
            None => scan,
        };
        for (i, key) in self.carried.iter().enumerate() {
            out.push(if i == 0 { '.' } else { ',' });
            out.push_str(&key.hex());
        }
        out
    }
}

impl RedisStore {
    /// [`crate::store::Store::scan_unknown`] on Redis.
    pub(super) async fn unknown_page(
        &self,
        cursor: Option<&str>,
        want: usize,
    ) -> Result<ScanPage, StoreError> {
        let mut conn = self.conn()?;
        let cluster = matches!(conn, RedisConn::Cluster(_));
        let mut at = match cursor {
            Some(c) => Position::parse(c)?,
            None => Position::start(cluster),
        };
        if at.scan.is_some() && at.slot.is_some() != cluster {
            return Err(StoreError::BadCursor);
        }
        let mut page = ScanPage::default();
        let (mut read, mut scans) = (0, 0);
        while page.records.len() < want && read < SCAN_BUDGET && scans < MAX_SCANS {
            let carried = std::mem::take(&mut at.carried);
            let keys = if carried.is_empty() {
                let Some(scan) = at.scan else { break };
                scans += 1;
                let (next, keys) = self
                    .scan(&mut conn, at.slot, scan, want - page.records.len())
                    .await?;
                at.scan = Some(next);
                if next == 0 && !self.next_primary(&mut conn, &mut at).await? {
                    at.scan = None;
                }
                keys
            } else {
                carried
            };
            read += keys.len();
            let mut found = self.unknown_of(&mut conn, &keys).await?;
            let room = want - page.records.len();
            if found.len() > room && found.len() - room <= MAX_CARRIED {
                at.carried = found.split_off(room).into_iter().map(|s| s.key).collect();
            }
            page.records.extend(found);
        }
        let finished = at.scan.is_none() && at.carried.is_empty();
        page.cursor = (!finished).then(|| at.render());
        Ok(page)
    }

    /// One `SCAN` call (on the primary serving `slot`, on a cluster): the next cursor and the
    /// record keys it found.
    async fn scan(
        &self,
        conn: &mut RedisConn,
        slot: Option<u16>,
        scan: u64,
        room: usize,
    ) -> Result<(u64, Vec<StoreKey>), StoreError> {
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(scan)
            .arg("MATCH")
            .arg(pattern(&self.shared.prefix))
            .arg("COUNT")
            .arg(room.clamp(10, 1000))
            .arg("TYPE")
            .arg("string");
        let (next, names): (u64, Vec<Vec<u8>>) = match (conn, slot) {
            (RedisConn::Cluster(c), Some(slot)) => {
                let value = self
                    .call("scan", c.route_command(cmd, on_primary_of(slot)))
                    .await?;
                redis::from_redis_value(value).map_err(|e| unavailable("scan", e))?
            }
            (conn, _) => self.call("scan", cmd.query_async(conn)).await?,
        };
        let prefix = self.shared.prefix.len();
        let keys = names
            .iter()
            .filter_map(|n| std::str::from_utf8(n.get(prefix + 1..prefix + 65)?).ok())
            .filter_map(StoreKey::from_hex)
            .collect();
        Ok((next, keys))
    }

    /// Of `keys`, the records whose outcome is unknown, in order. The first bytes of each
    /// (state and lease) decide, so no response body is read for nothing.
    async fn unknown_of(
        &self,
        conn: &mut RedisConn,
        keys: &[StoreKey],
    ) -> Result<Vec<Scanned>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let names: Vec<Vec<u8>> = keys.iter().map(|k| self.redis_key(k)).collect();
        let heads = names.iter().map(|name| {
            let mut p = redis::pipe();
            p.cmd("GETRANGE")
                .arg(name)
                .arg(0)
                .arg(codec::PENDING_LEN - 1);
            p
        });
        let heads: Vec<(Vec<u8>,)> = self.per_key(conn, heads.collect()).await?;
        // A lease is its owner's clock: run out `max_clock_skew` past it, as a read finds it.
        let wall = now_ms();
        let now = wall.saturating_sub(crate::store::millis(self.shared.skew));
        let candidates: Vec<usize> = (0..keys.len())
            .filter(|&i| heads.get(i).is_some_and(|(h,)| maybe_unknown(h, now)))
            .collect();
        let whole = candidates.iter().map(|&i| {
            let mut p = redis::pipe();
            p.cmd("GET").arg(&names[i]).cmd("PTTL").arg(&names[i]);
            p
        });
        let values: Vec<(Option<Vec<u8>>, i64)> = self.per_key(conn, whole.collect()).await?;
        let mut found = Vec::new();
        for (&i, (value, ttl)) in candidates.iter().zip(values) {
            let Some(value) = value else { continue };
            let record = match codec::decode(&Bytes::from(value), self.seal(&keys[i])) {
                Ok(record) => record.checked_lease_at(now),
                // Listed by `GET /keys/{id}` as unreadable; a page goes on without it.
                Err(StoreError::Unreadable { key_id, .. }) => {
                    tracing::warn!(id = keys[i].hex(), key_id = ?key_id, "listing: a record that does not open with this gateway's keys (GET /keys/{{id}})");
                    continue;
                }
                Err(e) => return Err(e),
            };
            if record.is_unknown() {
                found.push(Scanned {
                    key: keys[i],
                    record,
                    expires_ms: u64::try_from(ttl).ok().map(|t| wall.saturating_add(t)),
                });
            }
        }
        Ok(found)
    }

    /// Runs one small pipeline per key: on one Redis all in one pipeline, on a cluster each
    /// on its own (a pipeline may not cross slots there), all at once.
    async fn per_key<T: redis::FromRedisValue>(
        &self,
        conn: &mut RedisConn,
        pipes: Vec<redis::Pipeline>,
    ) -> Result<Vec<T>, StoreError> {
        if pipes.is_empty() {
            return Ok(Vec::new());
        }
        match conn {
            RedisConn::Single(_) => {
                let mut all = redis::pipe();
                for p in &pipes {
                    for cmd in p.cmd_iter() {
                        all.add_command(cmd.clone());
                    }
                }
                let flat: Vec<Value> = self.call("scan", all.query_async(conn)).await?;
                let per = pipes.first().map_or(1, |p| p.cmd_iter().count());
                flat.chunks(per)
                    .map(|c| redis::from_redis_value(Value::Array(c.to_vec())))
                    .collect::<Result<_, _>>()
                    .map_err(|e| unavailable("scan", e))
            }
            RedisConn::Cluster(c) => {
                let calls = pipes.iter().map(|p| {
                    let mut c = c.clone();
                    async move { p.query_async::<T>(&mut c).await }
                });
                self.call("scan", futures_util::future::try_join_all(calls))
                    .await
            }
        }
    }

    /// On a cluster, moves `at` to the primary after the one it finished (by their lowest
    /// slots); false when there is none (or on one Redis).
    async fn next_primary(
        &self,
        conn: &mut RedisConn,
        at: &mut Position,
    ) -> Result<bool, StoreError> {
        let (RedisConn::Cluster(c), Some(slot)) = (conn, at.slot) else {
            return Ok(false);
        };
        let value = self
            .call(
                "scan",
                c.route_command(
                    redis::cmd("CLUSTER").arg("SLOTS").clone(),
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::RandomPrimary),
                ),
            )
            .await?;
        let primaries = primaries(value).map_err(|e| unavailable("scan", e))?;
        let Some(current) = primaries
            .iter()
            .find(|p| p.1.iter().any(|r| r.contains(&slot)))
        else {
            return Err(StoreError::Unavailable(
                "scan: no primary serves the listing's slot".into(),
            ));
        };
        let current = current.0;
        match primaries.iter().map(|p| p.0).filter(|&s| s > current).min() {
            Some(next) => {
                at.slot = Some(next);
                at.scan = Some(0);
                Ok(true)
            }
            None => Ok(false),
        }
    }
}

/// `SCAN`'s pattern for the records under `prefix`: `<prefix>{<64 characters>}`, with the
/// prefix's glob characters escaped (the channel and other keys under it do not match).
fn pattern(prefix: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(prefix.len() * 2 + 66);
    for b in prefix.bytes() {
        if matches!(b, b'*' | b'?' | b'[' | b']' | b'\\') {
            out.push(b'\\');
        }
        out.push(b);
    }
    out.push(b'{');
    out.extend_from_slice(&[b'?'; 64]);
    out.push(b'}');
    out
}

/// Whether a record's first bytes may be an unknown outcome: marked unknown, or pending with
/// its lease over.
fn maybe_unknown(head: &[u8], now: u64) -> bool {
    match head.get(1) {
        Some(&codec::STATE_UNKNOWN) => true,
        Some(&codec::STATE_PENDING) => head
            .get(codec::HEADER_LEN + 16..codec::PENDING_LEN)
            .and_then(|l| <[u8; 8]>::try_from(l).ok())
            .is_some_and(|l| u64::from_be_bytes(l) < now),
        _ => false,
    }
}

fn on_primary_of(slot: u16) -> RoutingInfo {
    RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::new(
        slot,
        SlotAddr::Master,
    )))
}

/// Slot ranges, as one primary serves them.
type Slots = Vec<std::ops::RangeInclusive<u16>>;

/// `CLUSTER SLOTS` as (lowest slot, slots) per primary.
fn primaries(value: Value) -> Result<Vec<(u16, Slots)>, redis::ParsingError> {
    let ranges: Vec<Vec<Value>> = redis::from_redis_value(value)?;
    let mut by_node: Vec<(Vec<u8>, u16, Slots)> = Vec::new();
    for range in ranges {
        let [start, end, node, ..] = range.as_slice() else {
            continue;
        };
        let start: u16 = redis::from_redis_value(start.clone())?;
        let end: u16 = redis::from_redis_value(end.clone())?;
        let node: Vec<Value> = redis::from_redis_value(node.clone())?;
        let id: Vec<u8> = match node.as_slice() {
            [host, port, ..] => {
                let host: Vec<u8> = redis::from_redis_value(host.clone())?;
                let port: u16 = redis::from_redis_value(port.clone())?;
                [host, port.to_be_bytes().to_vec()].concat()
            }
            _ => continue,
        };
        match by_node.iter_mut().find(|n| n.0 == id) {
            Some(n) => {
                n.1 = n.1.min(start);
                n.2.push(start..=end);
            }
            None => by_node.push((id, start, vec![start..=end])),
        }
    }
    Ok(by_node.into_iter().map(|(_, low, r)| (low, r)).collect())
}

fn unavailable(what: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(format!("{what}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_reads_back_as_it_was_written() {
        let key = StoreKey::from_bytes([7; 32]);
        for at in [
            Position::start(false),
            Position::start(true),
            Position {
                slot: Some(5461),
                scan: Some(12),
                carried: vec![key, key],
            },
            Position {
                slot: None,
                scan: None,
                carried: vec![key],
            },
        ] {
            assert_eq!(Position::parse(&at.render()).unwrap(), at);
        }
        for bad in ["", "x", "1-", "16384-0", "0.zz", "-1", "1-2-3", "0.0"] {
            assert!(Position::parse(bad).is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn the_pattern_matches_records_only() {
        assert_eq!(
            pattern("a*b:"),
            [&b"a\\*b:{"[..], &[b'?'; 64], b"}"].concat()
        );
    }

    #[test]
    fn a_lease_over_or_an_unknown_state_may_be_unknown() {
        let mut head = vec![1u8, codec::STATE_PENDING];
        head.resize(codec::HEADER_LEN + 16, 0);
        head.extend_from_slice(&100u64.to_be_bytes());
        assert!(maybe_unknown(&head, 101));
        assert!(!maybe_unknown(&head, 100));
        head[1] = codec::STATE_UNKNOWN;
        assert!(maybe_unknown(&head, 0));
        head[1] = codec::STATE_COMPLETED;
        assert!(!maybe_unknown(&head, u64::MAX));
        assert!(!maybe_unknown(&[], 0));
    }
}
