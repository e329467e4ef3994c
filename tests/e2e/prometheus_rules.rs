//! The Prometheus rules (deploy/prometheus): valid and unit-tested with the real `promtool`,
//! every runbook link leading to a section of docs/operations.md, every metric they name one
//! the gateway exports.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use crate::support::*;

const RULES: &str = "deploy/prometheus/idemgate-rules.yaml";
const TESTS: &str = "deploy/prometheus/idemgate-rules.test.yaml";

/// Runs `promtool` with `args`; its output, or the failure, with what to install.
fn promtool(args: &[&str]) -> String {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap_or_else(|e| {
            panic!("promtool cannot run ({e}): install it (Debian: apt-get install prometheus; scripts/test does)")
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

fn rules_text() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(RULES)).unwrap()
}

#[test]
fn the_rules_are_valid_and_every_alert_fires_as_its_tests_say() {
    let checked = promtool(&["check", "rules", RULES]);
    assert!(checked.contains("SUCCESS"), "{checked}");
    let tested = promtool(&["test", "rules", TESTS]);
    assert!(tested.contains("SUCCESS"), "{tested}");
    // Every alert has a test that expects it to fire.
    let tests = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(TESTS)).unwrap();
    for alert in names(&rules_text(), "- alert: ") {
        // Within that alert's own expectation: up to the next alert named or test group.
        let firing = tests.split("alertname: ").skip(1).any(|t| {
            let own = t.split("- interval:").next().unwrap_or(t);
            own.starts_with(&alert)
                && own[alert.len()..].starts_with('\n')
                && own.contains("exp_labels")
        });
        assert!(firing, "no test expects {alert} to fire");
    }
}

#[test]
fn every_runbook_is_a_section_of_the_operations_guide() {
    let docs =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operations.md"))
            .unwrap();
    let anchors: BTreeSet<String> = docs
        .lines()
        .filter_map(|l| l.strip_prefix("### "))
        .map(|h| h.trim().to_lowercase().replace(' ', "-"))
        .collect();
    let rules = rules_text();
    let links = names(&rules, "runbook_url: \"docs/operations.md#");
    assert!(!links.is_empty());
    for link in links {
        let anchor = link.trim_end_matches('"');
        assert!(
            anchors.contains(anchor),
            "no section for #{anchor}: {anchors:?}"
        );
    }
    for alert in names(&rules, "- alert: ") {
        assert!(
            rules.contains(&format!("docs/operations.md#{}", alert.to_lowercase()))
                || alert.starts_with("IdemgateErrorBudgetBurn")
                || alert == "IdemgateStoreAlmostFull",
            "{alert} has no runbook of its own"
        );
    }
}

/// A metric the rules name that the gateway does not export would make an alert that never
/// fires: every one is checked against a running gateway's `/metrics` and the families
/// src/metrics registers (one without a series yet is not in the exposition).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_rules_name_is_exported() {
    let up = Upstream::counting().await;
    let gw = Running::start(config(&up.url(), PAYMENTS).with_admin())
        .await
        .unwrap();
    let http = Http::new(gw.addr());
    assert_eq!(http.post("/payments", "k1", "{}").await.status, 201);
    // OpenMetrics, as a Prometheus server asks for it: a counter's family is named without
    // `_total` there.
    let got = Http::new(gw.admin_addr().unwrap())
        .request("GET", "/metrics")
        .header(
            "accept",
            "application/openmetrics-text;version=1.0.0,text/plain;q=0.5",
        )
        .send()
        .await;
    assert_eq!(got.status, 200);
    let exposition = got.text();
    assert!(exposition.ends_with("# EOF\n"), "{exposition}");
    let mut families: BTreeSet<String> = exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .map(str::to_string)
        .collect();
    assert!(families.contains("idemgate_requests"), "{families:?}");
    // A family without a series yet (no consumer, no replica, ...) is not in the exposition:
    // those are the names registered in src/metrics.
    families.extend(registered_families());
    let rules = rules_text();
    let named: BTreeSet<&str> = rules
        .match_indices("idemgate_")
        // Not inside a recording rule's name (`route_outcome:idemgate_requests:rate5m`).
        .filter(|(at, _)| {
            !rules[..*at].ends_with(|c: char| c == ':' || c == '_' || c.is_ascii_alphanumeric())
        })
        .map(|(at, _)| {
            let rest = &rules[at..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            &rest[..end]
        })
        .collect();
    assert!(named.len() > 8, "{named:?}");
    // The type of each family in the exposition: a counter is queried as `_total`, a histogram
    // as `_bucket`, `_sum` or `_count`, a gauge by its name.
    let types: std::collections::BTreeMap<&str, &str> = exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .collect();
    for metric in named {
        let (family, suffix) = ["_total", "_count", "_sum", "_bucket"]
            .iter()
            .find_map(|s| metric.strip_suffix(s).map(|f| (f, *s)))
            .unwrap_or((metric, ""));
        assert!(
            families.contains(family),
            "the rules name {metric}, which the gateway does not export: {families:?}"
        );
        let fits = match types.get(family) {
            Some(&"counter") => suffix == "_total",
            Some(&"histogram") => ["_bucket", "_sum", "_count"].contains(&suffix),
            Some(&"gauge") => suffix.is_empty(),
            _ => true,
        };
        assert!(
            fits,
            "{metric}: not how a {:?} is queried",
            types.get(family)
        );
    }
}

/// Every family src/metrics registers: `registered(r, "name", ...)`, as `idemgate_name`.
fn registered_families() -> Vec<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/metrics");
    let mut names = Vec::new();
    for file in std::fs::read_dir(dir).unwrap() {
        let text = std::fs::read_to_string(file.unwrap().path()).unwrap();
        for call in text.split("registered(").skip(1) {
            // `r,` (or `registry,`), then the name as a string literal.
            let Some((_, rest)) = call.split_once(',') else {
                continue;
            };
            let rest = rest.trim_start();
            if let Some(name) = rest.strip_prefix('"').and_then(|r| r.split('"').next()) {
                names.push(format!("idemgate_{name}"));
            }
        }
    }
    assert!(names.len() > 20, "{names:?}");
    names
}

/// The values after `prefix` on each line that has it.
fn names(text: &str, prefix: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.trim_start().strip_prefix(prefix.trim_start()))
        .map(|rest| rest.trim().to_string())
        .collect()
}

/// A real Prometheus server (Debian's `prometheus`), scraping a gateway under load every second
/// with the rules loaded: every rule evaluates without error, and every dashboard panel's query
/// (deploy/grafana/idemgate.json) runs, the traffic, outcome and latency ones returning series.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_evaluates_every_rule_and_panel() {
    let up = Upstream::counting().await;
    let gw = Running::start(config(&up.url(), PAYMENTS).with_admin())
        .await
        .unwrap();
    let admin = gw.admin_addr().unwrap();
    let prometheus = Prometheus::start(admin);
    let http = Http::new(gw.addr());
    let loaded = eventually_within(std::time::Duration::from_secs(30), || async {
        for i in 0..20 {
            let key = format!("k{i}");
            assert_eq!(http.post("/payments", &key, "{}").await.status, 201);
            assert!(http.post("/payments", &key, "{}").await.is_replay());
        }
        !prometheus
            .query("rate(idemgate_requests_total[1m]) > 0")
            .await
            .is_empty()
    })
    .await;
    assert!(loaded, "Prometheus never saw the traffic");
    // Every rule has been evaluated, none with an error.
    let evaluated = eventually(|| async {
        let rules = prometheus.get("/api/v1/rules").await;
        let all: Vec<&serde_json::Value> = rules["data"]["groups"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["rules"].as_array().unwrap())
            .collect();
        !all.is_empty() && all.iter().all(|r| r["health"] == "ok")
    })
    .await;
    assert!(evaluated, "{}", prometheus.get("/api/v1/rules").await);
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/grafana/idemgate.json"),
        )
        .unwrap(),
    )
    .unwrap();
    for panel in dashboard["panels"].as_array().unwrap() {
        let title = panel["title"].as_str().unwrap();
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"]
                .as_str()
                .unwrap()
                .replace("$instance", ".*")
                .replace("$route", ".*")
                .replace("$__rate_interval", "1m");
            let got = prometheus.query(&expr).await;
            let must_have_data = [
                "Requests by outcome",
                "Replay share",
                "Upstream latency",
                "Store latency",
                "Requests in flight",
            ]
            .iter()
            .any(|t| title.starts_with(t));
            assert!(
                !must_have_data || !got.is_empty(),
                "{title}: {expr} returned nothing"
            );
        }
    }
}

/// `promtool check metrics` finds nothing to say about the exposition a reader that does not ask
/// for OpenMetrics gets (the classic text format), with many families present.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_finds_nothing_wrong_with_the_metrics() {
    let up = Upstream::counting().await;
    let gw = Running::start(config(&up.url(), PAYMENTS).with_admin())
        .await
        .unwrap();
    let http = Http::new(gw.addr());
    // Executed, replayed, refused (key reused, key missing) and passed through.
    assert_eq!(http.post("/payments", "k1", "{}").await.status, 201);
    assert!(http.post("/payments", "k1", "{}").await.is_replay());
    assert_eq!(http.post("/payments", "k1", "{\"a\":1}").await.status, 409);
    assert_eq!(http.request("POST", "/payments").send().await.status, 400);
    http.request("GET", "/elsewhere").send().await;
    let got = Http::new(gw.admin_addr().unwrap())
        .request("GET", "/metrics")
        .send()
        .await;
    assert_eq!(got.status, 200);
    assert_eq!(
        got.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    let exposition = got.text();
    assert!(
        exposition.contains("# TYPE idemgate_requests_total counter")
            && exposition.contains("idemgate_upstream_duration_seconds_bucket"),
        "{exposition}"
    );
    let mut check = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("promtool cannot run ({e}): install it (Debian: apt-get install prometheus; scripts/test does)"));
    use std::io::Write;
    check
        .stdin
        .take()
        .unwrap()
        .write_all(exposition.as_bytes())
        .unwrap();
    let out = check.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool check metrics:\n{said}\non:\n{exposition}"
    );
}

/// A Prometheus server on a free port, scraping one gateway's admin listener every second with
/// deploy/prometheus's rules; stopped on drop.
struct Prometheus {
    url: std::net::SocketAddr,
    child: std::process::Child,
    _dir: TempDir,
}

impl Prometheus {
    fn start(admin: std::net::SocketAddr) -> Prometheus {
        let dir = TempDir::new("prometheus");
        let rules = Path::new(env!("CARGO_MANIFEST_DIR")).join(RULES);
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: idemgate\n    static_configs:\n      - targets: ['{admin}']\n",
            rules.display()
        );
        std::fs::write(dir.path.join("prometheus.yml"), config).unwrap();
        let port = crate::support::redis::free_port(false);
        let url: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", dir.path.join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.path.join("data").display()))
            .arg(format!("--web.listen-address={url}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("prometheus cannot run ({e}): install it (Debian: apt-get install prometheus; scripts/test does)")
            });
        Prometheus {
            url,
            child,
            _dir: dir,
        }
    }

    async fn get(&self, path: &str) -> serde_json::Value {
        let ready = eventually_within(std::time::Duration::from_secs(30), || async {
            // Connected first: the test client panics on a refused connection.
            tokio::net::TcpStream::connect(self.url).await.is_ok()
                && Http::new(self.url)
                    .request("GET", "/-/ready")
                    .send()
                    .await
                    .status
                    == 200
        })
        .await;
        assert!(ready, "Prometheus never got ready");
        let got = Http::new(self.url).request("GET", path).send().await;
        assert_eq!(got.status, 200, "{path}: {}", got.text());
        serde_json::from_slice(&got.body).unwrap()
    }

    /// An instant query's result; the query must be valid.
    async fn query(&self, expr: &str) -> Vec<serde_json::Value> {
        let encoded: String = form_urlencoded::byte_serialize(expr.as_bytes()).collect();
        let answer = self.get(&format!("/api/v1/query?query={encoded}")).await;
        assert_eq!(answer["status"], "success", "{expr}: {answer}");
        answer["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
