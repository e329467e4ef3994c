//! What a config error or a log line may show of a value that can hold a secret: URLs without
//! their credentials, names and paths unless they look like a secret pasted in their place.

/// `redis://user:secret@host` -> `redis://user:***@host`, for messages and logs. Everything
/// between `://` and the last `@` is user info, whatever characters a password holds.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return redact_unschemed(url);
    };
    // The last `@` ends the user info: a password may hold `@`, `?` or `#` itself.
    let (userinfo, hosts) = match rest.rsplit_once('@') {
        Some((userinfo, hosts)) => (Some(userinfo), hosts),
        None => (None, rest),
    };
    let mut out = format!("{scheme}://");
    if let Some(userinfo) = userinfo {
        match userinfo.split_once(':') {
            Some((user, _)) => out.push_str(&format!("{user}:***@")),
            None => out.push_str("***@"),
        }
    }
    // A libpq URL may also carry the password as a parameter (`?password=...`).
    match hosts.split_once('?') {
        Some((hosts, query)) => {
            out.push_str(hosts);
            out.push('?');
            out.push_str(&redact_password_param(query));
        }
        None => out.push_str(hosts),
    }
    out
}

/// A value that should have been a URL but has no `://` (`redis:/:pw@h`, `u:pw@nats:4222`, a
/// libpq `host=db password=...` string): everything before its last `@`, and every
/// `password=` value, hidden.
fn redact_unschemed(value: &str) -> String {
    let hosts = match value.rsplit_once('@') {
        Some((_, hosts)) => format!("***@{hosts}"),
        None => value.to_string(),
    };
    hosts
        .split(' ')
        .map(|word| match word.split_once('=') {
            Some((name, _)) if name.eq_ignore_ascii_case("password") => format!("{name}=***"),
            _ => redact_password_param(word),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A value read as a path or a variable's name, as an error may show it: not at all if it looks
/// like a secret pasted in its place (a PEM key, several lines, a long token).
pub fn shown_name(value: &str) -> String {
    let plain = value.len() <= 256
        && !value.contains("-----")
        && !value.contains(['\n', '\r'])
        && !looks_like_token(value);
    match plain {
        true => value.to_string(),
        false => "(not shown: it looks like a secret, not a name)".into(),
    }
}

/// 32 or more characters with no separator a name or path would have, of which at least one
/// digit and one letter: what `openssl rand -hex` or a provider's secret looks like.
fn looks_like_token(value: &str) -> bool {
    value.len() >= 24
        && !value.contains(['/', '.', ' '])
        && value.chars().any(|c| c.is_ascii_digit())
        && value.chars().any(|c| c.is_ascii_alphabetic())
        && !value
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
}

fn redact_password_param(query: &str) -> String {
    query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if name.eq_ignore_ascii_case("password") => format!("{name}=***"),
            _ => pair.to_string(),
        })
        .collect::<Vec<_>>()
        .join("&")
}
