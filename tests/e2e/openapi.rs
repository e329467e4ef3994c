//! The admin API against its contract (docs/openapi.yaml, served at `GET /openapi.json`):
//! schemathesis (tests/openapi/run.py, in the virtualenv scripts/test makes) drives every
//! operation of a running gateway whose store holds completed, unknown and pending records,
//! with the operator token: no 5xx, every answer as documented.

use std::time::Duration;

use crate::support::*;

const TOKEN: &str = "op-token-openapi-5b2c";
/// Unknown outcomes the store holds when schemathesis starts.
const UNKNOWNS: usize = 60;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_keeps_its_openapi_contract() {
    let python = std::env::var("IDEMGATE_SCHEMATHESIS_PYTHON").unwrap_or_else(|_| {
        panic!("IDEMGATE_SCHEMATHESIS_PYTHON is not set: run scripts/test, which makes the virtualenv from tests/openapi/requirements.txt (or: python3 -m venv V && V/bin/pip install -r tests/openapi/requirements.txt && export IDEMGATE_SCHEMATHESIS_PYTHON=V/bin/python)")
    });
    // "hang-..." and "held" never get an answer: unknown once the route's upstream_timeout
    // ends, pending while their request waits.
    let up = Upstream::start(|seen, _| {
        if seen.headers.get("idempotency-key").is_some_and(|k| {
            let k = k.to_str().unwrap_or_default();
            k.starts_with("hang-") || k == "held"
        }) {
            Reply::Hang
        } else {
            Reply::Respond {
                status: 201,
                headers: vec![("content-type", "application/json".into())],
                body: "{\"id\":\"pay_1\"}".into(),
            }
        }
    })
    .await;
    let dir = TempDir::new("openapi");
    let token_file = dir.path.join("admin-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let text = TomlConfig::parse(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"{}\"\n[[routes]]\nname = \"payments\"\npath = \"/payments\"\nupstream_timeout = \"300ms\"\n[[routes]]\nname = \"refunds\"\npath = \"/refunds\"\nupstream_timeout = \"10m\"\n",
        up.url()
    ))
    .set("server.admin", "127.0.0.1:0")
    .set("server.admin_token_file", token_file.display().to_string())
    .text();
    let config = idemgate::config::Config::parse(&text).unwrap();
    let id = |route: &str, key: &str| {
        idemgate::operator::locate(&config, route, &[key.to_string()], &Default::default())
            .unwrap()
            .hex()
    };
    let ids = [
        id("payments", "done"),
        id("payments", "hang-0"),
        id("refunds", "held"),
    ];
    let gw = Running::start(config.clone()).await.unwrap();
    let admin = gw.admin_addr().unwrap();
    let http = Http::new(gw.addr());
    assert_eq!(http.post("/payments", "done", "{}").await.status, 201);
    // Left unknown: the upstream never answered within upstream_timeout. Enough of them for
    // the stateful phase's sequences (list, then resolve or release one) to find one each.
    let unknowns: Vec<_> = (0..UNKNOWNS)
        .map(|i| {
            let http = Http::new(gw.addr());
            tokio::spawn(async move { http.post("/payments", &format!("hang-{i}"), "{}").await })
        })
        .collect();
    for answer in unknowns {
        assert!(answer.await.unwrap().status.is_server_error());
    }
    // Pending for as long as the test runs.
    let held = {
        let http = Http::new(gw.addr());
        tokio::spawn(async move { http.post("/refunds", "held", "{}").await })
    };
    for _ in 0..UNKNOWNS + 2 {
        up.next_arrival().await;
    }
    // The store holds what the run is to meet: the unknown outcomes listed, by their keys,
    // and a record under every id given.
    let listed = Http::new(admin)
        .request("GET", "/keys?state=unknown&limit=1000")
        .header("authorization", &format!("Bearer {TOKEN}"))
        .send()
        .await;
    assert_eq!(listed.status, 200);
    assert_eq!(
        listed.text().matches("\"key\":\"hang-").count(),
        UNKNOWNS,
        "{}",
        listed.text()
    );
    for id in &ids {
        let got = Http::new(admin)
            .request("GET", &format!("/keys/{id}"))
            .header("authorization", &format!("Bearer {TOKEN}"))
            .send()
            .await;
        assert_eq!(got.status, 200, "{id}: {}", got.text());
    }
    let run = tokio::task::spawn_blocking(move || {
        // In a scratch directory: schemathesis keeps a cache (.schemathesis/) where it runs.
        let scratch = TempDir::new("schemathesis");
        std::process::Command::new(python)
            .current_dir(&scratch.path)
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openapi/run.py"))
            .arg(format!("http://{admin}"))
            .arg(TOKEN)
            .args(ids)
            .output()
            .unwrap()
    });
    let out = tokio::time::timeout(Duration::from_secs(600), run)
        .await
        .expect("schemathesis took over 10 minutes")
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "schemathesis found problems:\n{said}");
    // It did test every operation it selected, with many cases (a run that tested nothing
    // would also succeed).
    let number_after = |label: &str| {
        said.split(label)
            .nth(1)
            .map(str::trim_start)
            .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse::<u32>().ok())
            .unwrap_or(0)
    };
    let (selected, tested) = (number_after("Selected: "), number_after("Tested: "));
    assert!(selected >= 8 && tested == selected, "{said}");
    let passed = number_after(" generated, ");
    assert!(passed >= 100, "only {passed} cases passed:\n{said}");
    // Links between operations were followed (which ones, of the 3 the document declares and
    // those schemathesis infers, varies with the number of sequences it draws).
    let (covered, links) = (number_after("API Links: "), number_after(" covered / "));
    assert!(links >= 3 && covered >= 3, "{said}");
    held.abort();
}
