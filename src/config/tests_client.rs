//! How clients are told apart: `client_jwt`, and the certificate headers' rules.

use super::*;

/// A `[server]` that verifies client certificates, its PEM files in `dir`.
fn tls(dir: &std::path::Path) -> String {
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let (c, k) = (
        write("c.pem", &cert.cert.pem()),
        write("k.pem", &cert.key_pair.serialize_pem()),
    );
    format!("[server]\nlisten = \"127.0.0.1:8080\"\ntls_cert = \"{c}\"\ntls_key = \"{k}\"\ntls_client_ca = \"{c}\"\n")
}

fn config(server: &str, route: &str) -> Result<Config, ConfigError> {
    Config::parse(&format!(
        "{server}[upstream]\nurl = \"http://127.0.0.1:3000\"\n[[routes]]\nname = \"payments\"\npath = \"/payments\"\n{route}"
    ))
}

fn plain(route: &str) -> Result<Config, ConfigError> {
    config("[server]\nlisten = \"127.0.0.1:8080\"\n", route)
}

fn refused(r: Result<Config, ConfigError>) -> (String, String) {
    match r {
        Err(ConfigError::Invalid { field, allowed, .. }) => (field, allowed),
        other => panic!("expected Invalid, got {other:?}"),
    }
}

const JWKS: &str = "jwks_url = \"https://auth.example/.well-known/jwks.json\"";

#[test]
fn client_jwt_takes_the_documented_defaults() {
    let c = plain(&format!(
        "client_jwt = {{ {JWKS}, issuer = \"https://auth.example/\" }}"
    ))
    .unwrap();
    let jwt = c.routes[0].policy.client_jwt.as_deref().unwrap();
    assert_eq!(jwt.issuers, ["https://auth.example/"]);
    assert_eq!(jwt.claims, ["sub"]);
    assert_eq!(jwt.header, http::header::AUTHORIZATION);
    assert_eq!(jwt.leeway, Duration::from_secs(60));
    assert_eq!(jwt.refresh, Duration::from_secs(600));
    assert_eq!(jwt.audience, None);
    assert!(matches!(&jwt.keys, client::JwtKeys::Url(u) if u.host() == Some("auth.example")));
}

#[test]
fn client_jwt_needs_one_key_source_an_issuer_and_sane_claims() {
    let with = |fields: &str| plain(&format!("client_jwt = {{ {fields} }}"));
    let iss = "issuer = \"https://a/\"";
    assert_eq!(
        refused(with(iss)).0,
        "routes[0].client_jwt.jwks_url",
        "no key source"
    );
    assert_eq!(
        refused(with(&format!("{JWKS}, jwks_file = \"/x\", {iss}"))).0,
        "routes[0].client_jwt.jwks_url",
        "two key sources"
    );
    assert_eq!(refused(with(JWKS)).0, "routes[0].client_jwt.issuer");
    assert_eq!(
        refused(with(&format!("{JWKS}, issuer = []"))).0,
        "routes[0].client_jwt.issuer"
    );
    assert_eq!(
        refused(with(&format!("jwks_url = \"ftp://a/k\", {iss}"))).0,
        "routes[0].client_jwt.jwks_url"
    );
    let secret = with(&format!("jwks_url = \"https://user:hunter2@a/k\", {iss}"));
    assert!(!format!("{}", secret.as_ref().err().unwrap()).contains("hunter2"));
    assert_eq!(refused(secret).0, "routes[0].client_jwt.jwks_url");
    for claims in ["[]", "[\"iss\"]", "[\"sub\", \"sub\"]", "[\"\"]"] {
        let r = with(&format!("{JWKS}, {iss}, claims = {claims}"));
        assert_eq!(refused(r).0, "routes[0].client_jwt.claims", "{claims}");
    }
    assert_eq!(
        refused(with(&format!("{JWKS}, {iss}, leeway = \"10m\""))).0,
        "routes[0].client_jwt.leeway"
    );
    assert_eq!(
        refused(with(&format!("{JWKS}, {iss}, refresh = \"1s\""))).0,
        "routes[0].client_jwt.refresh"
    );
    assert!(with(&format!("{JWKS}, {iss}, surprise = 1")).is_err());
    // One or the other in a table: with client_jwt, the scope is the token's.
    let both = plain(&format!(
        "client_header = \"X-Api-Key\"\nclient_jwt = {{ {JWKS}, {iss} }}"
    ));
    assert_eq!(refused(both).0, "routes[0].client_header");
}

#[test]
fn an_hmac_secret_is_long_enough_and_never_echoed() {
    let dir = tempfile::tempdir().unwrap();
    let short = dir.path().join("short");
    std::fs::write(&short, "too-short-secret\n").unwrap();
    let r = plain(&format!(
        "client_jwt = {{ hmac_secret_file = \"{}\", issuer = \"i\" }}",
        short.display()
    ));
    let text = format!("{}", r.as_ref().err().unwrap());
    assert!(!text.contains("too-short-secret"), "{text}");
    assert!(text.contains("at least 32 bytes"), "{text}");
    let long = dir.path().join("long");
    std::fs::write(&long, "x".repeat(32)).unwrap();
    let c = plain(&format!(
        "client_jwt = {{ hmac_secret_file = \"{}\", issuer = \"i\" }}",
        long.display()
    ))
    .unwrap();
    let jwt = c.routes[0].policy.client_jwt.as_deref().unwrap();
    assert!(
        !format!("{jwt:?}").contains("xxxx"),
        "Debug never shows the secret"
    );
}

#[test]
fn a_jwks_file_must_be_a_jwks_document() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("jwks.json");
    std::fs::write(&file, "{\"not\": \"keys\"}").unwrap();
    let with = || {
        plain(&format!(
            "client_jwt = {{ jwks_file = \"{}\", issuer = \"i\" }}",
            file.display()
        ))
    };
    assert_eq!(refused(with()).0, "routes[0].client_jwt.jwks_file");
    std::fs::write(&file, "{\"keys\": []}").unwrap();
    assert!(with().is_ok());
}

#[test]
fn require_client_with_client_jwt_needs_no_client_header() {
    let r = plain(&format!(
        "require_client = true\nclient_jwt = {{ {JWKS}, issuer = \"i\" }}"
    ));
    assert!(r.unwrap().routes[0].policy.require_client);
}

#[test]
fn certificate_headers_are_scopes_only_alone_and_where_certificates_are_verified() {
    let dir = tempfile::tempdir().unwrap();
    let tls = tls(dir.path());
    let tls = tls.as_str();
    let (field, _) = refused(plain("client_header = \"X-Client-Cert-URI\"\n"));
    assert_eq!(field, "client_header", "no tls_client_ca");
    assert!(config(tls, "client_header = \"X-Client-Cert-URI\"\n").is_ok());
    assert!(config(
        tls,
        "client_header = [\"X-Client-Cert-URI\", \"X-Client-Cert-Subject\"]\n"
    )
    .is_ok());
    for mixed in [
        "[\"X-Client-Cert-Subject\", \"Authorization\"]",
        "[\"Authorization\", \"X-Client-Cert-URI\"]",
    ] {
        let (field, why) = refused(config(tls, &format!("client_header = {mixed}\n")));
        assert_eq!(field, "client_header (payments)", "{mixed}");
        assert!(why.contains("public"), "{why}");
    }
}
