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
/// libpq `host=db password=...` string): everything before its last `@` hidden, and everything
/// from a `password` on (libpq allows spaces and quotes around it, and several spellings).
fn redact_unschemed(value: &str) -> String {
    let hosts = match value.rsplit_once('@') {
        Some((_, hosts)) => format!("***@{hosts}"),
        None => value.to_string(),
    };
    match hosts.to_ascii_lowercase().find("password") {
        Some(at) => format!("{}password ***", &hosts[..at]),
        None => match hosts.split_once('?') {
            Some((before, query)) => format!("{before}?{}", redact_password_param(query)),
            None => hosts,
        },
    }
}

/// A value read as a path or a variable's name, as an error may show it: not at all if it looks
/// like a secret pasted in its place (a PEM key, several lines, a JWT, a random token).
pub fn shown_name(value: &str) -> String {
    let secret = value.len() > 256
        || value.contains("-----")
        || value.contains(['\n', '\r'])
        || (value.starts_with("eyJ") && value.matches('.').count() == 2)
        || looks_like_token(value);
    match secret {
        false => value.to_string(),
        true => "(not shown: it looks like a secret, not a name)".into(),
    }
}

/// 20 or more characters that no path (`/`, `.`, `~` first) or word-made name (`_`, `-`)
/// explains, with letters and digits: what `openssl rand -hex`, base64 and base32 secrets look
/// like; or 32 or more mixing upper and lower case with digits, whatever else they hold.
fn looks_like_token(value: &str) -> bool {
    let has = |f: fn(&char) -> bool| value.chars().any(|c| f(&c));
    let random = has(char::is_ascii_digit) && has(char::is_ascii_alphabetic);
    let mixed = has(char::is_ascii_uppercase) && has(char::is_ascii_lowercase);
    value.len() >= 20
        && !value.contains(char::is_whitespace)
        && !value.starts_with(['/', '.', '~'])
        && ((random && !value.contains(['_', '-'])) || (random && mixed && value.len() >= 32))
}

/// A query's parameters, those that name a credential (`password`, `token`, `api_key`,
/// `secret`, `auth`...) with their values hidden.
fn redact_password_param(query: &str) -> String {
    query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if names_a_credential(name) => format!("{name}=***"),
            _ => pair.to_string(),
        })
        .collect::<Vec<_>>()
        .join("&")
}

fn names_a_credential(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    [
        "pass",
        "token",
        "secret",
        "key",
        "auth",
        "signature",
        "credential",
    ]
    .iter()
    .any(|word| name.contains(word))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_paths_are_shown_and_secrets_pasted_in_their_place_are_not() {
        for plain in [
            "STRIPE_WEBHOOK_SECRET",
            "stripe_webhook_secret_v2",
            "/run/secrets/stripe",
            "./secrets/whsec.txt",
            "secrets/stripe",
            "GITHUB_WEBHOOK_SECRET_2024",
        ] {
            assert_eq!(shown_name(plain), plain);
        }
        for secret in [
            "9f8e7d6c5b4a39281706f5e4d3c2b1a0",
            "9F8E7D6C5B4A39281706F5E4D3C2B1A0",
            "aGVsbG8gd29ybGQgdGhpcyBpcyBhIHNlY3JldA==",
            "q8Zt/1kP+3nXc9LmWv2RbY7sHd4JfA0e",
            "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhIn0.c2lnbmF0dXJl",
            "-----BEGIN PRIVATE KEY-----\nMIIE",
        ] {
            assert!(shown_name(secret).starts_with("(not shown"), "{secret}");
        }
    }

    #[test]
    fn credentials_are_hidden_with_or_without_a_scheme() {
        for (url, secret) in [
            ("redis://:pw1@h:6379", "pw1"),
            ("redis:/:pw2@h", "pw2"),
            ("u:pw3@nats:4222", "pw3"),
            ("host=db user=app password=pw4 dbname=pay", "pw4"),
            ("host=db password = 'pw5 x' dbname=pay", "pw5"),
            ("host=db sslpassword=pw6", "pw6"),
            ("https://up/x?api_key=pw7&a=1", "pw7"),
            ("postgres://a@db/p?password=pw8", "pw8"),
            ("h/x?token=pw9", "pw9"),
        ] {
            let shown = redact_url(url);
            assert!(!shown.contains(secret), "{url} => {shown}");
        }
        assert_eq!(redact_url("https://up/x?a=1"), "https://up/x?a=1");
    }
}
