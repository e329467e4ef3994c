//! The real binary: `idemgate check` and `idemgate run`, as an operator uses them.

use std::process::Command;

use crate::support::*;

const BIN: &str = env!("CARGO_BIN_EXE_idemgate");

#[test]
fn check_accepts_the_shipped_proxy_toml_and_prints_routes() {
    let out = Command::new(BIN)
        .args([
            "check",
            "--config",
            concat!(env!("CARGO_MANIFEST_DIR"), "/proxy.toml"),
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("route \"payments\": POST /payments"),
        "{stdout}"
    );
    assert!(
        stdout.contains("route \"capture\": POST /orders/*/capture"),
        "{stdout}"
    );
    assert!(stdout.contains("config OK"));
}

#[test]
fn check_reads_idemgate_config_from_the_environment() {
    let out = Command::new(BIN)
        .arg("check")
        .env(
            "IDEMGATE_CONFIG",
            concat!(env!("CARGO_MANIFEST_DIR"), "/proxy.toml"),
        )
        .output()
        .unwrap();
    assert!(out.status.success());
}

#[test]
fn bad_config_exits_64_naming_the_field_and_value() {
    let dir = TempDir::new("cli-bad");
    let path = dir.path.join("proxy.toml");
    std::fs::write(
        &path,
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"http://127.0.0.1:1\"\n[[routes]]\npath = \"/p\"\nttl = \"forever\"\n",
    )
    .unwrap();
    for cmd in ["check", "run"] {
        let out = Command::new(BIN)
            .args([cmd, "--config"])
            .arg(&path)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{cmd}: {stderr}");
        assert!(
            stderr.contains("routes[0].ttl") && stderr.contains("forever"),
            "{stderr}"
        );
    }
    let missing = Command::new(BIN)
        .args(["check", "--config", "/nonexistent/proxy.toml"])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("/nonexistent/proxy.toml"));
}

#[tokio::test]
async fn run_serves_then_exits_0_on_sigterm() {
    let up = Upstream::counting().await;
    let gw = GatewayProcess::start(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"{}\"\n{PAYMENTS}",
        up.url()
    ));
    let http = Http::new(gw.addr);
    assert_eq!(http.post("/payments", "k", "{}").await.status, 201);
    assert!(http.post("/payments", "k", "{}").await.is_replay());
    assert_eq!(up.executions(), 1);

    let status = tokio::task::spawn_blocking(move || gw.signal_and_wait("-TERM"))
        .await
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

#[tokio::test]
async fn probe_exits_0_on_2xx_and_1_otherwise() {
    let up = Upstream::start(|seen, _| {
        if seen.path_and_query == "/ok" {
            Reply::json(200, "{}")
        } else {
            Reply::json(503, "{}")
        }
    })
    .await;
    let url = up.url();
    let code = |path: &'static str| {
        let url = format!("{url}{path}");
        tokio::task::spawn_blocking(move || {
            Command::new(BIN)
                .args(["probe", &url])
                .status()
                .unwrap()
                .code()
        })
    };
    assert_eq!(code("/ok").await.unwrap(), Some(0));
    assert_eq!(code("/down").await.unwrap(), Some(1));
    let closed = closed_port().await;
    let out = Command::new(BIN)
        .args(["probe", &format!("http://{closed}/readyz")])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
}

/// `idemgate check | head -1`: a reader that goes away is no reason to panic.
#[test]
fn check_into_a_closed_pipe_exits_cleanly() {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["check", "--config"])
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/proxy.toml"))
        .stdout(writer)
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(0), "{status:?}");
}

/// `check` on the shipped webhook example: with a signing secret missing it fails naming the
/// variable; with all of them set it shows each route's scheme and never a secret.
#[test]
fn check_names_a_missing_signing_secret_and_never_prints_one() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/webhooks.toml");
    let secrets = [
        (
            "STANDARD_WEBHOOKS_SECRET",
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        ),
        ("GITHUB_WEBHOOK_SECRET", "gh-very-secret-value"),
        ("STRIPE_WEBHOOK_SECRET", "whsec_stripe-very-secret-value"),
        ("SHOPIFY_API_SECRET", "shopify-very-secret-value"),
        ("SLACK_SIGNING_SECRET", "slack-very-secret-value"),
    ];
    let run = |skip: Option<&str>| {
        let mut cmd = Command::new(BIN);
        cmd.args(["check", "--config", example]);
        for (k, v) in secrets {
            cmd.env_remove(k);
            if Some(k) != skip {
                cmd.env(k, v);
            }
        }
        cmd.output().unwrap()
    };
    let missing = run(Some("GITHUB_WEBHOOK_SECRET"));
    assert_eq!(missing.status.code(), Some(64));
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(err.contains("GITHUB_WEBHOOK_SECRET"), "{err}");
    assert!(err.contains("routes[1].signature.secret_env"), "{err}");

    let ok = run(None);
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&ok.stdout),
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(ok.status.success(), "{out}");
    assert!(out.contains("signature github (1 secret)"), "{out}");
    assert!(
        out.contains("signature stripe (1 secret, timestamps within 5m)"),
        "{out}"
    );
    for (_, secret) in secrets {
        assert!(!out.contains(secret), "check printed a secret: {out}");
    }
    assert!(!out.contains("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"));
}

/// A Postgres config: `check` shows the store without its password, and `--print-ddl` prints
/// the statements that create its tables (and refuses other backends).
#[test]
fn check_on_postgres_hides_the_password_and_prints_the_ddl() {
    let dir = TempDir::new("cli-pg");
    let path = dir.path.join("proxy.toml");
    let text = TomlConfig::parse(
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"http://127.0.0.1:1\"\n[[routes]]\npath = \"/p\"\n",
    )
    .set("store.backend", "postgres")
    .set(
        "store.url",
        "postgres://app:s3cret-pw@db1:5432,db2:5432/pay?target_session_attrs=read-write",
    )
    .set("store.table", "billing.idem_keys")
    .text();
    std::fs::write(&path, text).unwrap();
    let check = Command::new(BIN)
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success(), "{shown}");
    assert!(
        shown.contains("store postgres postgres://app:***@db1:5432,db2:5432/pay"),
        "{shown}"
    );
    assert!(!shown.contains("s3cret-pw"), "{shown}");
    let ddl = Command::new(BIN)
        .args(["check", "--print-ddl", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    let sql = String::from_utf8_lossy(&ddl.stdout);
    assert!(ddl.status.success());
    assert!(
        sql.contains("CREATE TABLE IF NOT EXISTS billing.idem_keys ("),
        "{sql}"
    );
    assert!(
        sql.contains(
            "CREATE INDEX IF NOT EXISTS idem_keys_expires ON billing.idem_keys (expires_ms);"
        ),
        "{sql}"
    );
    assert!(sql.contains("billing.idem_keys_schema"), "{sql}");

    let memory = dir.path.join("memory.toml");
    std::fs::write(
        &memory,
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"http://127.0.0.1:1\"\n",
    )
    .unwrap();
    let refused = Command::new(BIN)
        .args(["check", "--print-ddl", "--config"])
        .arg(&memory)
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&refused.stderr)
        .contains("--print-ddl is for store.backend = \"postgres\""));
}

/// `check` warns about a signed route keyed by a header its signature does not cover, and not
/// about one keyed by a signed body field or Standard Webhooks' signed id.
#[test]
fn check_warns_of_a_key_the_signature_does_not_cover() {
    let dir = TempDir::new("unsigned-key");
    let secret = dir.path.join("secret");
    std::fs::write(&secret, "It's a Secret to Everybody").unwrap();
    let whsec = dir.path.join("whsec");
    std::fs::write(&whsec, "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
    let config = dir.path.join("idemgate.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"http://127.0.0.1:3000\"\n[defaults]\nclient_header = \"\"\n[[routes]]\nname = \"gh\"\npath = \"/gh\"\nkey = {{ header = \"X-GitHub-Delivery\" }}\nsignature = {{ scheme = \"github\", secret_file = \"{s}\" }}\n[[routes]]\nname = \"shop\"\npath = \"/shop\"\nkey = {{ json = \"/id\" }}\nsignature = {{ scheme = \"shopify\", secret_file = \"{s}\" }}\n[[routes]]\nname = \"svix\"\npath = \"/svix\"\nkey = {{ header = \"webhook-id\" }}\nsignature = {{ scheme = \"standard-webhooks\", secret_file = \"{w}\" }}\n",
            s = secret.display(),
            w = whsec.display()
        ),
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["check", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("warning: route \"gh\" is keyed by x-github-delivery which its github signature does not cover"),
        "{stdout}"
    );
    assert!(!stdout.contains("route \"shop\" is keyed"), "{stdout}");
    assert!(!stdout.contains("route \"svix\" is keyed"), "{stdout}");
}
