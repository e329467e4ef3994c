//! `[store] backend = "postgres"`: the URL (checked by the driver's own parser), the table's
//! name (it goes into SQL text, so only a plain identifier), the pool and the TLS files.

use std::str::FromStr;
use std::time::Duration;

use super::whole_number;
use crate::config::raw::RawStore;
use crate::config::{redact_url, ConfigError, PostgresSettings};

pub(super) fn postgres(raw: RawStore, workers: usize) -> Result<PostgresSettings, ConfigError> {
    let (command_timeout, tls_ca_file, tls_client) =
        super::connection::connection(&raw, Duration::from_secs(1))?;
    let max_clock_skew = super::connection::clock_skew(&raw)?;
    let url = raw.url.ok_or_else(|| ConfigError::Missing {
        field: "store.url (postgres://user:password@host:5432/database)".into(),
    })?;
    let url = postgres_url(url)?;
    let table = raw.table.unwrap_or_else(|| "idemgate_records".into());
    if !is_table_name(&table) {
        return Err(ConfigError::invalid(
            "store.table",
            table,
            "a table name of lowercase letters, digits and _ (up to 48 characters), optionally schema-qualified, such as \"idemgate_records\" or \"payments.idemgate_records\"",
        ));
    }
    let pool_size = whole_number("store.pool_size", raw.pool_size, 16, 1..=1000)? as usize;
    Ok(PostgresSettings {
        url,
        table,
        pool_size,
        workers,
        command_timeout,
        max_clock_skew,
        tls_ca_file,
        tls_client,
        allow_async_commit: raw.allow_async_commit.unwrap_or(false),
    })
}

/// A URL tokio-postgres accepts (several hosts, `sslmode`, `target_session_attrs`, ...); the
/// password is never shown in the error.
fn postgres_url(url: String) -> Result<String, ConfigError> {
    let allowed = "a URL such as \"postgres://user:password@host:5432/database\", with several hosts and ?target_session_attrs=read-write to follow a failover";
    if !url.starts_with("postgres://") && !url.starts_with("postgresql://") {
        return Err(ConfigError::invalid("store.url", redact_url(&url), allowed));
    }
    match tokio_postgres::Config::from_str(&url) {
        Ok(parsed) if !parsed.get_hosts().is_empty() => Ok(url),
        Ok(_) => Err(ConfigError::invalid(
            "store.url",
            redact_url(&url),
            "a URL that names the server's host",
        )),
        Err(e) => Err(ConfigError::invalid(
            "store.url",
            redact_url(&url),
            format!("{allowed} ({e})"),
        )),
    }
}

/// `name` or `schema.name`, each part a lowercase SQL identifier: it is written into SQL text
/// (and into the names of the index, the schema table and the notification channel).
fn is_table_name(table: &str) -> bool {
    let part = |p: &str| {
        let mut chars = p.chars();
        matches!(chars.next(), Some('a'..='z' | '_'))
            && chars.all(|c| matches!(c, 'a'..='z' | '0'..='9' | '_'))
            && p.len() <= 48
    };
    match table.split_once('.') {
        Some((schema, name)) => part(schema) && part(name),
        None => part(table),
    }
}
